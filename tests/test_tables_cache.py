"""CACHE (CacheTable): evicted rows are written back to the store and reloaded trained; the
default store holds every row the table may have; rows keep their scores through it."""
import torch

from dynemb import ScorePolicy, StorageMode
from dynemb.stores.backing_store import HostBackingStore
from key_reference import initial_rows
from table_builder import DIM, INIT, collection, train_step
#: table_identity("t"), pinned in test_initializers.py
TABLE_T_ID = 6256752092847567818


make = collection


# -- write-back and load -----------------------------------------------------------------------
class RecordingStore(HostBackingStore):
    """The in-memory store, recording what it is asked."""

    def __init__(self, width, dtype, device):
        super().__init__(width, dtype, device, initial_capacity=128)
        self.inserted = []

    def insert(self, keys, rows, scores):
        self.inserted.extend(keys.tolist())
        return super().insert(keys, rows, scores)


def test_evicted_rows_go_to_a_custom_store_and_come_back_trained():
    stores = []

    def factory(width, dtype, device):
        stores.append(RecordingStore(width, dtype, device))
        return stores[-1]

    ec = make(1024, caching=True, bucket_size=4, local_hbm_for_values=4 * DIM * 4,
              backing_store=factory)
    assert ec.storage_modes() == {"t": StorageMode.CACHE}
    train_step(ec, [1, 2, 3, 4])
    train_step(ec, [5, 6])      # evicts two of 1..4 to the store
    assert len(stores[0].inserted) == 2 and set(stores[0].inserted) <= {1, 2, 3, 4}
    victim = stores[0].inserted[0]
    out = train_step(ec, [victim])  # reloaded with its trained value
    start = torch.tensor(initial_rows(INIT, [victim], DIM, seed=0, table_id=TABLE_T_ID))
    torch.testing.assert_close(out[0], start[0] - 0.5)
    # the reload evicted a third row
    assert ec.stats()["t"]["loads"] == 1 and ec.stats()["t"]["write_backs"] == 3


# -- CACHE: the default store holds every row the table may have ---------------------------------
def test_cache_filled_to_num_embeddings_loses_no_row():
    ec = make(20_000, caching=True, local_hbm_for_values=1024 * DIM * 4)
    table = ec.tables["t"]
    assert table.mode is StorageMode.CACHE and table.layout.target_rows == 20_000
    assert table.store.max_capacity == 39_936        # 2 x 20,000 in whole buckets of 128
    keys = torch.arange(20_000) * 2654435761 + 12345
    for chunk in keys.split(256):
        train_step(ec, chunk)
    stats = ec.stats()["t"]
    assert stats["store_evictions"] == 0
    assert stats["rows_device"] + stats["rows_backing"] == keys.numel()
    assert bool(ec.read_rows("t", keys)[1].all())


# -- CACHE: a row's score travels with it through the store --------------------------------------
def _one_bucket_cache(policy):
    ec = make(1024, caching=True, local_hbm_for_values=4 * DIM * 4, bucket_size=4,
              score_strategy=policy)
    assert ec.tables["t"].tier.hash.capacity == 4
    return ec


def _device_scores(ec):
    exported = ec.tables["t"].tier.hash.export()
    return dict(zip(exported.keys.tolist(), exported.scores.tolist()))


def _store_scores(ec, ids):
    _, found, scores = ec.tables["t"].store.find(torch.tensor(ids))
    return {k: s for k, f, s in zip(ids, found.tolist(), scores.tolist()) if f}


def test_lfu_count_survives_the_store():
    ec = _one_bucket_cache(ScorePolicy.LFU)
    for key, count in ((1, 6), (2, 7), (3, 8), (4, 9), (5, 10)):
        train_step(ec, [key] * count)    # the fifth evicts key 1 with its count of 6
    assert _device_scores(ec) == {2: 7, 3: 8, 4: 9, 5: 10} and _store_scores(ec, [1]) == {1: 6}
    train_step(ec, [1, 9, 9, 9])         # 1 comes back (6 + 1), 9 is new (3): 2 and 3 leave
    assert _device_scores(ec) == {1: 7, 9: 3, 4: 9, 5: 10}
    assert _store_scores(ec, [2, 3]) == {2: 7, 3: 8}
    train_step(ec, [10])                 # the true counts pick 9, not the reloaded key
    assert _device_scores(ec) == {1: 7, 10: 1, 4: 9, 5: 10}
    assert ec.stats()["t"]["loads"] == 1


def test_step_insertion_age_survives_the_store():
    ec = _one_bucket_cache(ScorePolicy.STEP)
    for key in (1, 2, 3, 4, 5):          # steps 1..5: the fifth evicts key 1
        train_step(ec, [key])
    train_step(ec, [1])                  # step 6: 1 comes back, inserted at step 1; 2 leaves
    assert _device_scores(ec) == {1: 1, 3: 3, 4: 4, 5: 5}
    train_step(ec, [6])                  # step 7: the oldest is 1 again
    assert _device_scores(ec) == {6: 7, 3: 3, 4: 4, 5: 5}
