"""Row moves between flat tables (the numba kernels on CPU) against torch indexing, and the
CACHE group's kernel path to its host stores against the path through gathered rows."""
import pytest
import torch

from torchrec import EmbeddingConfig

from dynemb import DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig, OptimizerType
from dynemb.stores.backing_store import HostBackingStore
from dynemb.rows.row_moves import copy_rows, remap_rows
from dynemb.tables.group_stores import moves_in_group
from table_builder import DIM, train_step


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_copy_rows_matches_indexing_and_skips_negative_slots(dtype):
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(50, 7, generator=gen).to(dtype)
    dst = torch.randn(30, 7, generator=gen).to(dtype)
    src_slots = torch.tensor([4, -1, 49, 0, 13, 7])
    dst_slots = torch.tensor([29, 3, 0, -1, 10, 11])
    expected = dst.clone()
    for s, d in zip(src_slots.tolist(), dst_slots.tolist()):
        if s >= 0 and d >= 0:
            expected[d] = src[s]
    copy_rows(src, src_slots, dst, dst_slots)
    assert torch.equal(dst.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       expected.view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_copy_rows_rejects_tables_of_another_width_or_dtype():
    with pytest.raises(ValueError, match="one dtype and width"):
        copy_rows(torch.zeros(4, 3), torch.tensor([0]), torch.zeros(4, 2), torch.tensor([0]))
    with pytest.raises(ValueError, match="one dtype and width"):
        copy_rows(torch.zeros(4, 3), torch.tensor([0]), torch.zeros(4, 3, dtype=torch.float16),
                  torch.tensor([0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_remap_rows_moves_live_rows_and_zeroes_the_rest(dtype):
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(1000, 5, generator=gen).to(dtype)
    remap = torch.randperm(2500, generator=gen)[:1000]
    remap[::4] = -1
    expected = torch.zeros(2500, 5, dtype=dtype)
    live = remap >= 0
    expected[remap[live]] = old[live]
    assert torch.equal(remap_rows(old, remap, 2500), expected)


class ThroughGatheredRows(HostBackingStore):
    """The same store, but its ``find`` / ``insert`` count as the user's own: the cache then
    moves rows through gathered tensors, as it does for any store."""

    def find(self, keys):
        return super().find(keys)

    def insert(self, keys, rows, scores):
        return super().insert(keys, rows, scores)


@pytest.mark.parametrize("optimizer", [OptimizerType.SGD, OptimizerType.ADAM])
def test_cache_moves_rows_to_and_from_its_host_store_as_through_gathered_rows(optimizer):
    """Many evictions and reloads (a 64-row cache over 3000 keys, the store growing from 128
    slots): rows, optimizer state, counters and scores agree with the gathered path."""
    config = OptimizerConfig(optimizer, learning_rate=0.1)
    tables = [EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=4096,
                              feature_names=["f"])]
    width = DIM + config.state_dim(DIM)
    ecs = []
    for store in (HostBackingStore, ThroughGatheredRows):
        options = DynamicEmbTableOptions(
            caching=True, bucket_size=16, local_hbm_for_values=64 * width * 4,
            backing_store=lambda w, d, dev, s=store: s(w, d, dev, initial_capacity=128))
        ecs.append(DynamicEmbCollection(tables, table_options=options, optimizer=config))
    assert moves_in_group(ecs[0].tables["t"]) and not moves_in_group(ecs[1].tables["t"])
    gen = torch.Generator().manual_seed(2)
    for _ in range(12):
        ids = torch.randint(0, 3000, (40,), generator=gen)
        outs = [train_step(ec, ids) for ec in ecs]
        assert torch.equal(outs[0], outs[1])
    keys = torch.arange(3000)
    rows = [ec.read_rows("t", keys, with_state=True) for ec in ecs]
    assert torch.equal(rows[0][0], rows[1][0]) and torch.equal(rows[0][1], rows[1][1])
    stats = [ec.stats()["t"] for ec in ecs]
    assert stats[0] == stats[1] and stats[0]["write_backs"] > 100 and stats[0]["loads"] > 10
