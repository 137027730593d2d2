"""One kernel protocol: the CPU and CUDA backends implement the same operations of
``KernelBackend`` with the same signatures (the CUDA class is read without a GPU), and a
group operation called with the same arguments on either backend treats a lone table as a
group of one: it claims, finds and initializes exactly as the table's own operations do."""
import functools
import inspect

import pytest
import torch

from conftest import BACKENDS
from dynemb.backends.numba_backends import CpuBackend, get_backend
from dynemb.backends.cuda_backend import CudaBackend
from dynemb.backends.protocol import INIT_UNIFORM, KernelBackend, Segments, TableArrays
from dynemb.types import ScorePolicy

#: Public members of a backend that are not kernel operations.
#: what a backend says of itself (``KernelBackend``'s annotated attributes)
CAPABILITIES = {"name", "defers_failures", "reads_strided_grads", "moves_store_rows"}
NOT_OPERATIONS = CAPABILITIES | {"direct_launch_signatures", "numba_launch_refusals"}


def operations(cls) -> set:
    return {name for name in dir(cls) if not name.startswith("_") and name not in NOT_OPERATIONS}


def parameters(cls, name):
    """``(name, kind, default)`` of each parameter of ``cls.name``, without ``self``."""
    member = inspect.getattr_static(cls, name)
    function = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
    found = list(inspect.signature(function).parameters.values())
    if not isinstance(member, staticmethod):
        found = found[1:]
    return [(p.name, p.kind, p.default) for p in found]


def test_cpu_and_cuda_implement_the_same_operations_with_the_same_signatures():
    protocol = operations(KernelBackend)
    assert operations(CpuBackend) == protocol
    assert operations(CudaBackend) == protocol
    for name in sorted(protocol):
        want = parameters(KernelBackend, name)
        assert parameters(CpuBackend, name) == want, f"CpuBackend.{name}"
        assert parameters(CudaBackend, name) == want, f"CudaBackend.{name}"


def test_both_backends_state_every_capability_of_the_protocol():
    assert set(KernelBackend.__annotations__) == CAPABILITIES
    for backend in (CpuBackend, CudaBackend):
        for name in CAPABILITIES - {"name"}:
            assert isinstance(getattr(backend, name), bool), f"{backend.__name__}.{name}"
    # the host kernels raise at once and read host memory; CUDA does neither
    assert [CpuBackend.defers_failures, CpuBackend.moves_store_rows] == [False, True]
    assert [CudaBackend.defers_failures, CudaBackend.moves_store_rows] == [True, False]


def test_the_group_operations_are_in_the_protocol():
    assert {"dedup_segments", "find_group", "find_or_insert_group", "claim_counts_group",
            "init_rows_at_group", "store_find_group", "store_moves_group", "occurrence_csr",
            "copy_rows", "remap_rows", "has_reserved_keys"} <= operations(KernelBackend)


def test_the_cuda_kernels_say_they_have_no_group_stores():
    """A CACHE group on the CUDA kernels runs each table's store by its own calls (the
    stores are in host memory): the host-store group operations refuse clearly instead of
    failing on a missing attribute."""
    cuda = CudaBackend.__new__(CudaBackend)  # no kernels loaded: the refusal comes first
    with pytest.raises(NotImplementedError, match="runs each table.s store by its own calls"):
        cuda.store_find_group(*[None] * 10)
    with pytest.raises(NotImplementedError, match="runs each table.s store by its own calls"):
        cuda.store_moves_group(*[None] * 26)


def test_segments_of_a_group_and_of_a_lone_table():
    segments = Segments([0, 3, 3, 5])
    assert segments.count == 3 and segments.table_of.tolist() == [0, 0, 0, 2, 2]
    assert Segments.single(4).table_of.tolist() == [0, 0, 0, 0]


def _claims(kernels, device, as_group, rounds):
    """Claims of ``rounds`` (unique keys each) into one table of 64 slots (4 buckets of 16),
    each claim's pins dropped before the next: by the table's own ``find_or_insert`` or as a
    group of one. Returns the arrays and every claim's outputs."""
    table = TableArrays.empty(64, 16, device)
    on = functools.partial(torch.tensor, device=device)
    outputs = []
    for clock, ukeys in enumerate(rounds, start=5):
        n = ukeys.numel()
        counts = torch.arange(n, device=device) + 1  # distinct scores
        given = torch.zeros(n, dtype=torch.int64, device=device)
        slots, prev_keys, prev_scores = (torch.empty(n, dtype=torch.int64, device=device)
                                         for _ in range(3))
        inserted, failed = (torch.empty(n, dtype=torch.bool, device=device) for _ in range(2))
        if as_group:
            stats = torch.full((1, 3), -1, dtype=torch.int64, device=device)
            kernels.find_or_insert_group(
                table, table.size, Segments.single(n, device), on([0]), on([table.num_buckets]),
                ukeys, counts, given, ScorePolicy.LFU.code, on([clock]), True, slots, inserted,
                prev_keys, prev_scores, failed, stats)
        else:
            stats = torch.zeros(2, dtype=torch.int64, device=device)
            kernels.find_or_insert(table, ukeys, counts, given, ScorePolicy.LFU.code, clock,
                                   True, True, slots, inserted, prev_keys, prev_scores, failed,
                                   stats)
        outputs.append(tuple(t.cpu() for t in (ukeys, slots, inserted, prev_keys, prev_scores,
                                               failed, stats)))
        kernels.add_refcounts(table, slots, -1)
    return TableArrays(*(t.cpu() for t in table[:4]), *table[4:]), outputs


def _placement_free(table, outputs):
    """What a claim must agree on whatever slot each key of a bucket took (CUDA threads
    race for a bucket's slots): every live key's score and pins, the size, and per key of
    each claim whether it was inserted, its previous score if it hit, the evicted keys and
    their scores."""
    live = table.keys >= 0
    state = sorted(zip(table.keys[live].tolist(), table.scores[live].tolist(),
                       table.refcnt[live].tolist()))
    ukeys, slots = outputs[-1][:2]
    assert torch.equal(table.keys[slots[slots >= 0]], ukeys[slots >= 0])  # the last claim's
    claims = []
    for ukeys, slots, inserted, prev_keys, prev_scores, failed, _ in outputs:
        hits = (slots >= 0) & ~inserted
        evicted = inserted & (prev_keys >= 0)
        claims.append((sorted(zip(ukeys.tolist(), inserted.tolist(), failed.tolist())),
                       sorted(zip(ukeys[hits].tolist(), prev_scores[hits].tolist())),
                       sorted(zip(prev_keys[evicted].tolist(), prev_scores[evicted].tolist()))))
    return state, int(table.size), claims


@pytest.mark.parametrize("name,device", BACKENDS, ids=[b for b, _ in BACKENDS])
def test_a_lone_table_is_a_group_of_one(name, device):
    """The same calls on both backends (per-table values as tensors on the backend's
    device); the second claim hits, inserts and evicts."""
    kernels, device = get_backend(name), torch.device(device)
    gen = torch.Generator().manual_seed(3)
    first = torch.randperm(200, generator=gen)[:40] + 1
    rounds = [first, torch.cat([first[:10], torch.randperm(200, generator=gen)[:30] + 201])]
    rounds = [r.to(device) for r in rounds]
    alone, alone_out = _claims(kernels, device, False, rounds)
    group, group_out = _claims(kernels, device, True, rounds)
    assert _placement_free(alone, alone_out) == _placement_free(group, group_out)
    for claim_alone, claim_group in zip(alone_out, group_out):
        failed, evicted = claim_alone[6].tolist()
        added = int(claim_group[2].sum()) - evicted
        assert claim_group[6][0].tolist() == [added, evicted, failed]
    assert group_out[1][6][0, 1] > 0 and not group_out[1][5].any()  # evicts, none failed
    ukeys, slots, inserted, prev_keys = (t.to(device) for t in group_out[1][:4])
    per_table = torch.zeros(1, 3, dtype=torch.int64, device=device)
    kernels.claim_counts_group(Segments.single(40, device), slots, inserted, prev_keys,
                               per_table)
    assert per_table[0].tolist() == [int(v) for v in kernels.claim_summary(slots, inserted,
                                                                            prev_keys)]

    on = functools.partial(torch.tensor, device=device)
    found_alone, found_group = (torch.empty(40, dtype=torch.int64, device=device)
                                for _ in range(2))
    alone_arrays = TableArrays(*(t.to(device) for t in alone[:4]), *alone[4:])
    group_arrays = TableArrays(*(t.to(device) for t in group[:4]), *group[4:])
    kernels.find(alone_arrays, ukeys, found_alone)
    kernels.find_group(group_arrays, Segments.single(40, device), on([0]),
                       on([group.num_buckets]), ukeys, found_group)
    assert torch.equal(found_group, slots)
    assert torch.equal(alone_arrays.keys[found_alone], ukeys)

    rows_alone, rows_group = (torch.zeros(64, 6, device=device) for _ in range(2))
    kernels.init_rows_at(rows_alone, found_alone, ukeys, inserted, 4, 11, 2, INIT_UNIFORM,
                         -1.0, 1.0, 0.0, 0.0)
    kernels.init_rows_at_group(rows_group, slots, ukeys, inserted, Segments.single(40, device),
                               4, on([11]), on([2]), on([INIT_UNIFORM]),
                               *(on([v], dtype=torch.float64) for v in (-1.0, 1.0, 0.0, 0.0)))
    assert torch.equal(rows_alone[found_alone], rows_group[slots])
    assert bool(rows_group[slots[inserted], :4].abs().sum() > 0)


def test_both_backends_give_a_group_the_same_claim():
    """Three tables of one group (one without keys, one with more keys than slots), the same
    call on CPU and on the CUDA kernels: the CUDA threads race for a bucket's slots, but each
    table keeps only its own keys, in the same numbers, with the same counts and failures."""
    gen = torch.Generator().manual_seed(7)
    parts = [torch.randperm(90, generator=gen)[:n] + 1 + 1000 * t
             for t, n in enumerate((30, 0, 50))]
    results = []
    for name, device in BACKENDS:
        device = torch.device(device)
        ukeys = torch.cat(parts).to(device)
        n = ukeys.numel()
        table = TableArrays.empty(3 * 32, 16, device,
                                  size=torch.zeros(3, dtype=torch.int64, device=device))
        slots, prev_keys, prev_scores = (torch.empty(n, dtype=torch.int64, device=device)
                                         for _ in range(3))
        inserted, failed = (torch.empty(n, dtype=torch.bool, device=device) for _ in range(2))
        stats = torch.zeros(3, 3, dtype=torch.int64, device=device)
        ones, zeros = torch.ones_like(ukeys), torch.zeros_like(ukeys)
        on = functools.partial(torch.tensor, device=device)
        get_backend(name).find_or_insert_group(
            table, table.size, Segments([0, 30, 30, 80], device), on([0, 32, 64]),
            on([2, 2, 2]), ukeys, ones, zeros, ScorePolicy.LRU.code, on([1, 4, 9]), True, slots,
            inserted, prev_keys, prev_scores, failed, stats)
        keys = table.keys.cpu()
        for t, part in enumerate(parts):
            kept = keys[32 * t:32 * (t + 1)]
            assert set(kept[kept >= 0].tolist()) <= set(part.tolist())
        results.append((table.size.tolist(), stats.tolist(), int(failed.sum())))
    assert results[0] == results[-1]
    sizes, stats, failures = results[0]
    assert sizes[1] == 0 and sizes[2] == 32 and [row[0] for row in stats] == sizes
    assert failures == sum(row[2] for row in stats) > 0


@pytest.mark.parametrize("with_lookups", [False, True])
@pytest.mark.parametrize("name,device", BACKENDS, ids=[b for b, _ in BACKENDS])
def test_claim_counts_add_up_per_table_as_counted_by_hand(name, device, with_lookups):
    """``add_claim_counts`` against a count key by key in Python, on segments of many sizes:
    empty, shorter than a block, and across blocks (the CUDA kernel sums a block of one table
    in shared memory and a block across tables key by key)."""
    from dynemb.types import EMPTY_KEY, TOMBSTONE_KEY
    kernels, device = get_backend(name), torch.device(device)
    gen = torch.Generator().manual_seed(11)
    bounds = [0, 0, 5, 75, 76, 300, 301]
    n = bounds[-1]
    ukeys = torch.randint(1, 1000, (n,), generator=gen)
    ukeys[torch.rand(n, generator=gen) < 0.2] = EMPTY_KEY
    slots = torch.where(ukeys == EMPTY_KEY, -1, torch.randint(-1, 500, (n,), generator=gen))
    inserted = (slots >= 0) & (torch.rand(n, generator=gen) < 0.4)
    prev_keys = torch.randint(1, 1000, (n,), generator=gen)
    prev_keys[torch.rand(n, generator=gen) < 0.3] = EMPTY_KEY
    prev_keys[torch.rand(n, generator=gen) < 0.1] = TOMBSTONE_KEY
    lookups = torch.randint(1, 4, (n,), generator=gen) if with_lookups else None
    out = torch.full((len(bounds) - 1, 8), 7, dtype=torch.int64)  # adds to what is there
    want = out.clone()
    for t in range(len(bounds) - 1):
        for i in range(bounds[t], bounds[t + 1]):
            hit = bool(slots[i] >= 0 and not inserted[i])
            real = int(ukeys[i]) != EMPTY_KEY
            want[t, 0] += int(lookups[i]) if with_lookups else 1
            want[t, 1] += real
            want[t, 2] += hit
            want[t, 3] += real and not hit
            want[t, 4] += bool(inserted[i])
            want[t, 5] += bool(inserted[i]) and int(prev_keys[i]) not in (EMPTY_KEY,
                                                                           TOMBSTONE_KEY)
    on = [x if x is None else x.to(device) for x in (ukeys, slots, inserted, prev_keys,
                                                     lookups, out)]
    kernels.add_claim_counts(Segments(bounds, device), *on)
    assert on[-1].cpu().tolist() == want.tolist()


@pytest.mark.parametrize("name,device", BACKENDS, ids=[b for b, _ in BACKENDS])
def test_gather_rows_reads_each_occurrences_row_and_zeros_without_a_slot(name, device):
    kernels, device = get_backend(name), torch.device(device)
    gen = torch.Generator().manual_seed(5)
    weights = torch.randn(50, 7, generator=gen)  # 4 embedding columns, 3 of state
    slots = torch.tensor([3, -1, 49, 0, 3, -1])
    index = torch.randint(0, 6, (40,), generator=gen)
    out = torch.full((40, 4), float("nan"))
    on = [t.to(device) for t in (weights, slots, index, out)]
    kernels.gather_rows(on[0], on[1], on[2], 4, on[3])
    want = torch.where((slots[index] >= 0)[:, None], weights[slots[index].clamp(min=0), :4], 0.0)
    assert torch.equal(on[3].cpu(), want)


@pytest.mark.parametrize("name,device", BACKENDS, ids=[b for b, _ in BACKENDS])
def test_gather_rows_reads_the_fallback_row_of_a_key_without_a_slot(name, device):
    """An eval or admission batch's occurrences: a key with a slot reads its stored row, one
    without reads its own fallback row (counted by unique index, as the slots are); rows of
    the fallback that no slot-less key owns are never read (here NaN)."""
    kernels, device = get_backend(name), torch.device(device)
    gen = torch.Generator().manual_seed(6)
    weights = torch.randn(50, 7, generator=gen)  # 4 embedding columns, 3 of state
    slots = torch.tensor([3, -1, 49, 0, -1, -1])
    fallback = torch.randn(6, 4, generator=gen)
    fallback[slots >= 0] = float("nan")
    index = torch.randint(0, 6, (40,), generator=gen)
    out = torch.full((40, 4), float("nan"))
    on = [t.to(device) for t in (weights, slots, index, out, fallback)]
    kernels.gather_rows(on[0], on[1], on[2], 4, on[3], on[4])
    stored = slots[index] >= 0
    want = torch.where(stored[:, None], weights[slots[index].clamp(min=0), :4],
                       fallback[index].nan_to_num())
    assert torch.equal(on[3].cpu(), want)


@pytest.mark.parametrize("name,device", BACKENDS, ids=[b for b, _ in BACKENDS])
def test_gather_rows_keeps_the_rows_of_keys_without_a_slot(name, device):
    """A DEFAULT group's two tiers gathered into one output: the second gather (``keep``)
    writes only the rows of the keys it holds, the first's stay."""
    kernels, device = get_backend(name), torch.device(device)
    gen = torch.Generator().manual_seed(8)
    first, second = torch.randn(50, 7, generator=gen), torch.randn(30, 5, generator=gen)
    first_slots = torch.tensor([3, -1, 49, -1, -1])
    second_slots = torch.tensor([-1, 7, -1, 29, -1])  # key 4 in neither: the first's zeros
    index = torch.randint(0, 5, (40,), generator=gen)
    out = torch.full((40, 4), float("nan"))
    on = [t.to(device) for t in (first, first_slots, second, second_slots, index, out)]
    kernels.gather_rows(on[0], on[1], on[4], 4, on[5])
    kernels.gather_rows(on[2], on[3], on[4], 4, on[5], keep=True)
    in_first, in_second = first_slots[index] >= 0, second_slots[index] >= 0
    want = torch.where(in_second[:, None], second[second_slots[index].clamp(min=0), :4],
                       torch.where(in_first[:, None], first[first_slots[index].clamp(min=0), :4],
                                   0.0))
    assert torch.equal(on[5].cpu(), want)


@pytest.mark.parametrize("name,device", BACKENDS, ids=[b for b, _ in BACKENDS])
def test_route_keys_group_places_each_key_as_key_mixing_does(name, device):
    """Each table's keys go to the tier the pure-Python tier hash gives them under that
    table's rows (hand-checked keys included), ``EMPTY_KEY`` in the other tier and for
    padding."""
    from key_reference import routes_to_first
    from dynemb.types import EMPTY_KEY
    kernels, device = get_backend(name), torch.device(device)
    gen = torch.Generator().manual_seed(5)
    keys = torch.randint(0, 2**62, (70,), generator=gen)
    keys[:4] = torch.tensor([0, 1, 42, 7])  # under (1024, 2048): first, second, first, second
    keys[30:40] = EMPTY_KEY  # table 0's padding
    bounds = [0, 40, 40, 70]
    first_rows, total_rows = torch.tensor([1024, 8, 300]), torch.tensor([2048, 16, 1000])
    on_first, on_second = (torch.empty(70, dtype=torch.int64, device=device) for _ in range(2))
    kernels.route_keys_group(Segments(bounds, device), keys.to(device), first_rows.to(device),
                             total_rows.to(device), on_first, on_second)
    on_first, on_second = on_first.cpu(), on_second.cpu()
    assert on_first[:4].tolist() == [0, EMPTY_KEY, 42, EMPTY_KEY]
    want = torch.tensor([routes_to_first(int(k), int(first_rows[t]), int(total_rows[t]))
                         for t, k in zip([0] * 40 + [2] * 30, keys.tolist())])
    valid = keys != EMPTY_KEY
    assert torch.equal(on_first, torch.where(valid & want, keys, EMPTY_KEY))
    assert torch.equal(on_second, torch.where(valid & ~want, keys, EMPTY_KEY))
    assert 0 < int((on_first[40:] != EMPTY_KEY).sum()) < 30  # table 2 splits both ways
