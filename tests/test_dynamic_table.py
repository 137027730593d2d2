"""DynamicTable behaviour across its tiers: a failed DEFAULT claim undoes both tiers; the
CACHE store holds every row the table may have, and rows keep their scores through it."""
import pytest
import torch
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, Initializer, InitializerKind,
                    OptimizerConfig, OptimizerType, ScorePolicy, StorageMode, TableFullError)
from dynemb.key_mixing import routes_to_first

DIM = 4
SGD = OptimizerConfig(OptimizerType.SGD, learning_rate=0.5)
INIT = Initializer(InitializerKind.UNIFORM, low=-0.1, high=0.1)


def make(num_embeddings, **options):
    tables = [EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=num_embeddings,
                              feature_names=["f"])]
    return DynamicEmbCollection(tables, table_options=DynamicEmbTableOptions(
        initializer=INIT, **options), optimizer=SGD)


def train_step(ec, ids):
    ids = torch.as_tensor(ids, dtype=torch.int64)
    out = ec(KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.tensor([ids.numel()])))
    out["f"].values().sum().backward()


# -- DEFAULT: a claim that fails in either tier leaves both unchanged --------------------------
def _tier_state(hash_table):
    ex = hash_table.export()
    return (sorted(zip(ex.keys.tolist(), ex.slots.tolist(), ex.scores.tolist())),
            hash_table.size(), hash_table.clock, hash_table.pinned_count())


def _snapshot(ec, keys):
    table = ec.tables["t"]
    stats = {k: v for k, v in ec.stats()["t"].items() if k not in ("lookups", "unique_keys")}
    rows, found = ec.read_rows("t", torch.tensor(keys), with_state=True)
    return (stats, rows.tolist(), found.tolist(), _tier_state(table.tier.hash),
            _tier_state(table.host_tier.hash))


@pytest.mark.parametrize("full_tier", ["host", "device"])
def test_default_no_eviction_failure_leaves_both_tiers_unchanged(full_tier):
    # 4 device rows and 4 host rows, one bucket each: the fifth key of a tier finds no slot.
    ec = make(8, caching=False, local_hbm_for_values=4 * DIM * 4, bucket_size=4,
              score_strategy=ScorePolicy.NO_EVICTION)
    table = ec.tables["t"]
    assert table.mode is StorageMode.DEFAULT and table.host_tier.hash.capacity == 4
    candidates = torch.arange(1, 200)
    to_device = routes_to_first(candidates, 4, 8)  # 4 device rows of 8
    dev, host = candidates[to_device].tolist(), candidates[~to_device].tolist()
    train_step(ec, [dev[0], host[0]])
    if full_tier == "host":
        batch = dev[1:3] + host[1:5]     # the device takes 2, the host tier 3 of its 4
    else:
        batch = dev[1:5] + host[1:3]     # the host tier takes 2, the device 3 of its 4
    keys = dev[:5] + host[:5]
    before = _snapshot(ec, keys)
    with pytest.raises(TableFullError, match="Nothing was inserted"):
        train_step(ec, batch)
    assert _snapshot(ec, keys) == before
    train_step(ec, [dev[1], host[1]])   # the table keeps working
    assert ec.stats()["t"]["rows_device"] == 2 and ec.stats()["t"]["rows_backing"] == 2


# -- CACHE: the default store holds every row the table may have ---------------------------------
def test_cache_filled_to_max_capacity_loses_no_row():
    ec = make(20_000, caching=True, local_hbm_for_values=1024 * DIM * 4)
    table = ec.tables["t"]
    assert table.mode is StorageMode.CACHE and table.layout.max_capacity == 20_096
    keys = torch.arange(table.layout.max_capacity) * 2654435761 + 12345
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
