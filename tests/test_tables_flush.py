"""CACHE flush: every cached row goes to the backing store (a user store or the default
HostBackingStore) and stays cached; the store then holds what read_rows reads for every key.
The modules' flush answers per CACHE table."""
import pytest
import torch

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig,
                    OptimizerType, StashMode, StorageMode)
from dynemb.options import choose_storage_mode
from dynemb.tables import build_table
from table_builder import DIM, INIT, prefetch, rows_of, update
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

ADAGRAD = OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD, learning_rate=0.5)


class AppendStore:
    """A user backing store (no hash table of ours): a Python index from key to a row of
    tensors that only grow; counts its insert calls."""

    def __init__(self, width, dtype, device):
        self.width, self.index, self.inserts = width, {}, 0
        self.rows = torch.zeros(0, width, dtype=dtype)
        self.scores = torch.zeros(0, dtype=torch.int64)

    def find(self, keys):
        at = torch.tensor([self.index.get(k, -1) for k in keys.tolist()], dtype=torch.int64)
        found = at >= 0
        rows = torch.zeros(at.numel(), self.width, dtype=self.rows.dtype)
        scores = torch.zeros(at.numel(), dtype=torch.int64)
        rows[found], scores[found] = self.rows[at[found]], self.scores[at[found]]
        return rows, found, scores

    def insert(self, keys, rows, scores):
        self.inserts += 1
        for key in keys.tolist():
            self.index.setdefault(key, len(self.index))
        grow = len(self.index) - self.rows.shape[0]
        self.rows = torch.cat([self.rows, self.rows.new_zeros(grow, self.width)])
        self.scores = torch.cat([self.scores, self.scores.new_zeros(grow)])
        at = torch.tensor([self.index[k] for k in keys.tolist()], dtype=torch.int64)
        self.rows[at], self.scores[at] = rows.cpu(), scores.cpu()
        return 0

    def export(self, start, batch):
        keys = list(self.index)[start:start + batch]
        rows = self.find(torch.tensor(keys, dtype=torch.int64))[0]
        nxt = start + batch if start + batch < len(self.index) else None
        return torch.tensor(keys, dtype=torch.int64), rows, nxt

    def size(self):
        return len(self.index)


def cache_table(backend, store=None, cache_rows=8, bucket_size=4):
    """A CACHE table of ``cache_rows`` cached rows, in buckets of ``bucket_size``."""
    options = DynamicEmbTableOptions(caching=True, bucket_size=bucket_size, initializer=INIT,
                                     local_hbm_for_values=cache_rows * (DIM + 1) * 4,
                                     backing_store=store)
    layout = choose_storage_mode(options, name="t", num_embeddings=1024,
                                 width=DIM + ADAGRAD.state_dim(DIM), state_dim=1,
                                 config_dtype=torch.float32)
    name, device = backend
    table = build_table("t", 7, DIM, layout, options, ADAGRAD, torch.device(device), name)
    assert table.mode is StorageMode.CACHE and table.tier.hash.capacity == cache_rows
    return table


def train(table, keys, step):
    """One step of ``keys`` through the table's group of one."""
    keys = torch.tensor(keys, dtype=torch.int64, device=table.device)
    batch = prefetch(table, keys)
    rows_of(batch)
    unique = batch.keys.numel()
    grads = torch.arange(unique * DIM, dtype=torch.float32,
                         device=table.device).reshape(unique, DIM) / 10 + step
    update(table, batch, grads, lr=0.5, step=step)


def store_rows(store, keys):
    rows, found, scores = store.find(keys)
    return rows.cpu(), found.cpu(), scores.cpu()


def trained(table, steps=30):
    """Train keys 0..39 in overlapping batches: many rows evicted to the store, reloaded,
    trained again (their stored copy stale) while cached."""
    for step in range(1, steps + 1):
        train(table, [(step * 3 + i) % 40 for i in range(3)], step)
    return torch.arange(40, dtype=torch.int64, device=table.device)


@pytest.mark.parametrize("store", [None, AppendStore], ids=["host_store", "user_store"])
def test_after_flush_the_store_holds_every_current_row(backend, store):
    table = cache_table(backend, store)
    keys = trained(table)
    cached = table.tier.hash.export()
    assert cached.keys.numel() == 8 and table.counters.snapshot()["write_backs"] > 0
    before_rows, found_before = table.read_rows(keys, with_state=True)
    stale = store_rows(table.store, cached.keys)
    assert stale[1].any()  # some cached rows have an older copy in the store
    assert not torch.equal(stale[0][stale[1]],
                           table.read_rows(cached.keys, with_state=True)[0].cpu()[stale[1]])

    assert table.flush() == cached.keys.numel()  # hand count: every cached key, once

    rows, found, scores = store_rows(table.store, keys)
    assert torch.equal(found, found_before.cpu())
    assert torch.equal(rows[found], before_rows.cpu()[found])
    # the cached rows went with their scores, and stay cached, slots and scores unchanged
    _, _, cached_scores = store_rows(table.store, cached.keys)
    assert torch.equal(cached_scores, cached.scores.cpu())
    after = table.tier.hash.export()
    assert torch.equal(after.keys, cached.keys) and torch.equal(after.scores, cached.scores)
    assert torch.equal(table.read_rows(keys, with_state=True)[0], before_rows)
    assert table.counters.snapshot()["store_evictions"] == 0


def test_flush_of_an_empty_cache_writes_nothing(backend):
    table = cache_table(backend, AppendStore)
    assert table.flush() == 0 and table.store.size() == 0 and table.store.inserts == 0


def test_flush_goes_chunk_by_chunk(backend):
    table = cache_table(backend, AppendStore, cache_rows=64, bucket_size=16)
    train(table, list(range(100, 130)), 1)
    assert table.flush(chunk_rows=16) == 30
    assert table.store.inserts == sum(1 for start in range(0, 64, 16) if table.tier.hash.export(
        start, 16).keys.numel())
    assert table.store.size() == 30
    with pytest.raises(ValueError, match="chunk_rows must be a positive int"):
        table.flush(chunk_rows=0)


def test_the_other_modes_keep_no_second_copy():
    options = DynamicEmbTableOptions(initializer=INIT)
    layout = choose_storage_mode(options, name="t", num_embeddings=64, width=DIM,
                                 config_dtype=torch.float32)
    table = build_table("t", 1, DIM, layout, options, OptimizerConfig(), torch.device("cpu"))
    assert table.flush() is None


# -- the modules -----------------------------------------------------------------------------
def two_tables(store=None, **cache_options):
    configs = [EmbeddingConfig(name=n, embedding_dim=DIM, num_embeddings=1024,
                               feature_names=[f]) for n, f in (("c", "fc"), ("h", "fh"))]
    options = {"c": DynamicEmbTableOptions(caching=True, bucket_size=4, initializer=INIT,
                                           local_hbm_for_values=16 * (DIM + 1) * 4,
                                           backing_store=store, **cache_options),
               "h": DynamicEmbTableOptions(initializer=INIT)}
    return DynamicEmbCollection(configs, table_options=options, optimizer=ADAGRAD)


def kjt(c_ids, h_ids):
    return KeyedJaggedTensor.from_lengths_sync(
        ["fc", "fh"], torch.tensor(c_ids + h_ids, dtype=torch.int64),
        torch.tensor([len(c_ids), len(h_ids)]))


@pytest.mark.parametrize("store", [None, AppendStore], ids=["host_store", "user_store"])
def test_module_flush_counts_cache_tables_and_a_pending_backward_flushes_again(store):
    ec = two_tables(store)
    assert ec.storage_modes() == {"c": StorageMode.CACHE, "h": StorageMode.HBM_DIRECT}
    assert ec.flush() == {"c": 0}
    out = ec(kjt([4, 9, 4, 11], [1, 2]))
    sum(jt.values().sum() for jt in out.values()).backward()
    assert ec.flush() == {"c": 3}  # ids 4, 9, 11; "h" keeps no second copy
    for step in range(5):
        out = ec(kjt([step * 2 + i for i in range(3)], [1, 2]))
        sum(jt.values().sum() for jt in out.values()).backward()
    keys = torch.arange(12)
    out = ec(kjt([30, 31], [3]))  # its backward has not run yet
    counted = ec.tables["c"].tier.hash.size()
    assert ec.flush() == {"c": counted}
    current, found = ec.read_rows("c", torch.cat([keys, torch.tensor([30, 31])]),
                                  with_state=True)
    stored, in_store, _ = store_rows(ec.tables["c"].store, torch.cat([keys,
                                                                       torch.tensor([30, 31])]))
    assert torch.equal(in_store, found) and torch.equal(stored[found], current[found])
    sum(jt.values().sum() for jt in out.values()).backward()  # updates the cached rows only
    updated = ec.read_rows("c", torch.tensor([30, 31]), with_state=True)[0]
    assert not torch.equal(store_rows(ec.tables["c"].store, torch.tensor([30, 31]))[0], updated)
    assert ec.flush() == {"c": counted}
    assert torch.equal(store_rows(ec.tables["c"].store, torch.tensor([30, 31]))[0], updated)


def test_a_stashed_table_brings_its_rows_back_to_flush():
    ec = two_tables(stash=StashMode.ALL)
    out = ec(kjt([1, 2, 3], [1]))
    assert ec.memory_stash.stashed == ["c"]  # rows away until the backward
    assert ec.flush() == {"c": 3}
    assert ec.memory_stash.stashed == []
    keys = torch.tensor([1, 2, 3])
    current = ec.read_rows("c", keys, with_state=True)[0]
    assert torch.equal(store_rows(ec.tables["c"].store, keys)[0], current)
    sum(jt.values().sum() for jt in out.values()).backward()  # the backward still runs
    assert ec.steps["c"] == 1
