"""Owner ranks and the deduplicated, rank-ordered ids a rank sends, against hand-computed
values and a pure-Python model whose owners come from tests/key_reference.py."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynemb.options import ShardingScheme
from dynemb.sharding.routing import owner_ranks, route_unique
from key_reference import bucket_of, owner


def test_owner_ranks_mod_by_hand():
    keys = torch.tensor([0, 1, 2, 5, -1, -6, 2**62 + 3])
    assert owner_ranks(keys, 3, ShardingScheme.MOD).tolist() == [0, 1, 2, 2, 2, 0, 1]


def test_owner_ranks_hash_follow_the_python_reference():
    keys = torch.randint(-(2**63), 2**63 - 1, (300,), generator=torch.Generator().manual_seed(3))
    for world in (1, 2, 5):
        assert owner_ranks(keys, world, ShardingScheme.HASH).tolist() == [
            owner(k, world, "hash") for k in keys.tolist()]


def test_owner_ranks_hash_is_balanced_where_mod_is_not():
    even = torch.arange(0, 200_000, 2)  # ids sharing a stride with the world size
    assert torch.bincount(owner_ranks(even, 2, ShardingScheme.MOD), minlength=2).tolist() == [
        100_000, 0]
    counts = torch.bincount(owner_ranks(even, 2, ShardingScheme.HASH), minlength=2)
    assert abs(int(counts[0]) - 50_000) < 1_000
    for world in (3, 8):
        counts = torch.bincount(owner_ranks(even, world, ShardingScheme.HASH), minlength=world)
        assert counts.min() > 0.95 * even.numel() / world


def test_keys_of_one_rank_spread_over_every_bucket():
    # the owner hash is independent of the bucket hash of the rank's own table
    keys = torch.arange(100_000)
    mine = keys[owner_ranks(keys, 2, ShardingScheme.HASH) == 0]
    counts = torch.bincount(torch.tensor([bucket_of(k, 64) for k in mine.tolist()]),
                            minlength=64)
    assert counts.min() > 0.8 * mine.numel() / 64


def _route_model(ids_per_table, scheme, world):
    """Per (rank, table) the distinct ids in first-seen order, and their counts."""
    sent = [[[] for _ in ids_per_table] for _ in range(world)]
    counts = [[[] for _ in ids_per_table] for _ in range(world)]
    for t, ids in enumerate(ids_per_table):
        for k in ids:
            r = owner(k, world, scheme.value)
            if k in sent[r][t]:
                counts[r][t][sent[r][t].index(k)] += 1
            else:
                sent[r][t].append(k)
                counts[r][t].append(1)
    return sent, counts


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.one_of(st.integers(-50, 50), st.sampled_from([2**62, -(2**63) + 2])),
                         max_size=30), min_size=1, max_size=3),
       st.integers(1, 4), st.sampled_from(list(ShardingScheme)))
def test_route_unique_matches_model(ids_per_table, world, scheme):
    tensors = [torch.tensor(ids, dtype=torch.int64) for ids in ids_per_table]
    segments = [(f"f{t}", len(ids)) for t, ids in enumerate(ids_per_table)]
    routed = route_unique(tensors, [scheme] * len(tensors), world, segments)
    sent, counts = _route_model(ids_per_table, scheme, world)
    tables = range(len(tensors))
    assert routed.values.tolist() == [k for r in range(world) for t in tables for k in sent[r][t]]
    assert routed.counts.tolist() == [c for r in range(world) for t in tables
                                      for c in counts[r][t]]
    assert routed.lengths.tolist() == [len(sent[r][t]) for r in range(world) for t in tables]
    # every occurrence gathers its own id back
    assert routed.values[routed.gather].tolist() == [k for ids in ids_per_table for k in ids]
    assert routed.segments == segments


def test_route_unique_on_the_cuda_kernels_sends_what_the_cpu_sends():
    """The CUDA kernels pad a group's unique ids (fixed shapes), so their tables are deduped
    one by one (sorted): the same ids, counts and lengths per (rank, table) as on CPU, and
    every occurrence gathers its own id back."""
    from dynemb.backends.numba_backends import get_backend
    ids = [torch.tensor([5, 3, 5, 9, 12]), torch.tensor([7]), torch.tensor([3, 3, 1, 8])]
    segments = [(f"f{t}", len(part)) for t, part in enumerate(ids)]
    schemes = [ShardingScheme.MOD] * 3
    cpu, cuda = (route_unique(ids, schemes, 2, segments, kernels=get_backend(name))
                 for name in ("cpu", "cuda"))
    assert cuda.lengths.tolist() == cpu.lengths.tolist()
    bounds = torch.cumsum(cpu.lengths, 0).tolist()
    for lo, hi in zip([0] + bounds[:-1], bounds):
        assert (sorted(zip(cuda.values[lo:hi].tolist(), cuda.counts[lo:hi].tolist()))
                == sorted(zip(cpu.values[lo:hi].tolist(), cpu.counts[lo:hi].tolist())))
    assert torch.equal(cuda.values[cuda.gather], torch.cat(ids))
