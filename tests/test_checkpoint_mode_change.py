"""A checkpoint loads into a table whose storage mode is not the one that saved it (a per-rank
device budget makes a table HBM_DIRECT on 2 ranks and CACHE on 1): every saved row, its
optimizer state and its score come back, read from the saved tensors themselves (the
store's entries with the cached ones over them), in whichever mode the table has now; a
table too small for the rows fails naming it and nothing changes. Through ``state_dict`` on
both kernel backends (CUDA under the simulator here); the 2 -> 1 rank case through
``torch.distributed.checkpoint`` is in tests/test_checkpoint_reload_sharded.py."""
import dataclasses

import pytest
import torch
from torchrec import EmbeddingConfig

from checkpoint_models import DIM, OPTIMIZERS, batches, options, roundtrip, train
from checkpoint_reload_worker import loaded_entries, saved_entries
from dynemb import DynamicEmbCollection, ScorePolicy, StorageMode, TableFullError

IDS = torch.arange(600) * 7919 - 1000  # every id batches() draws
CACHE_ROW_BYTES = (DIM + OPTIMIZERS["adam"].state_dim(DIM)) * 4


def build(mode, backend, optimizer="adam", **changes):
    opt = OPTIMIZERS[optimizer]
    table_options = dataclasses.replace(options(mode, opt, policy=ScorePolicy.LFU), **changes)
    ec = DynamicEmbCollection(
        [EmbeddingConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=1024,
                         feature_names=[f"f{i}"]) for i in range(2)],
        table_options=table_options, optimizer=opt, backend=backend)
    assert set(ec.storage_modes().values()) == {StorageMode(mode)}
    return ec


def assert_holds(ec, state):
    """Every entry of ``ec``'s tables is the saved one (row, optimizer state, score)."""
    for table in ec.tables:
        expected, got = saved_entries(state, "", table), loaded_entries(ec, table, IDS)
        assert len(expected) > 20 and sorted(got) == sorted(expected), table
        for key, (row, score) in expected.items():
            assert torch.equal(got[key][0], row), (table, key)
            assert got[key][1] == score, (table, key)


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
@pytest.mark.parametrize("saved_mode, mode", [("hbm_direct", "cache"),
                                              ("cache", "hbm_direct")])
def test_a_checkpoint_loads_into_the_other_mode_with_every_row_state_and_score(
        backend, saved_mode, mode):
    # the simulator runs a thread at a time: fewer steps through a one-bucket cache there
    size, small = (dict(steps=4, batch=10), dict(global_hbm_for_values=32 * CACHE_ROW_BYTES)
                   ) if backend == "cuda" else (dict(steps=8), {})
    source = build(saved_mode, backend, **(small if saved_mode == "cache" else {}))
    train(source, batches(**size))
    if saved_mode == "cache":  # rows both in the cache and only in the store
        assert source.stats()["t0"]["rows_backing"] > 0
    state = roundtrip(source.state_dict())
    target = build(mode, backend, **(small if mode == "cache" else {}))
    train(target, batches(1, seed=4, batch=10))  # rows of its own, replaced by the load
    target.load_state_dict(state)
    assert_holds(target, state)
    assert target.steps == source.steps
    train(target, batches(1, seed=9, batch=10))  # and trains on


@pytest.mark.parametrize("saved_mode, mode", [("default", "cache"), ("cache", "default"),
                                              ("host_only", "cache"),
                                              ("default", "hbm_direct")])
def test_the_other_modes_load_into_each_other(saved_mode, mode):
    source = build(saved_mode, "cpu")
    train(source, batches(8))
    state = roundtrip(source.state_dict())
    target = build(mode, "cpu")
    target.load_state_dict(state)
    assert_holds(target, state)


def test_a_table_too_small_for_the_saved_rows_fails_naming_it_and_nothing_changes():
    source = build("cache", "cpu")
    train(source, batches(8))
    state = roundtrip(source.state_dict())
    target = build("hbm_direct", "cpu", init_capacity=64, max_capacity=64)
    train(target, batches(1, seed=4))
    before = {t: loaded_entries(target, t, IDS) for t in target.tables}
    with pytest.raises(TableFullError, match="table 't0'.*found no free slot"):
        target.load_state_dict(state)
    for table, entries in before.items():
        after = loaded_entries(target, table, IDS)
        assert sorted(after) == sorted(entries)
        assert all(torch.equal(after[k][0], entries[k][0]) for k in entries)


def test_a_damaged_image_of_another_mode_is_still_refused():
    # a DEFAULT image holding a key in both tiers: no mode could have written it
    source = build("default", "cpu")
    train(source, batches(8))
    state = roundtrip(source.state_dict())
    group = "dynamic_tables.t0.rank0_of_1"
    host_keys, device_keys = state[f"{group}.host.keys"], state[f"{group}.device.keys"]
    host_keys[0] = device_keys[0]  # both tiers' entries are live ones
    state[f"{group}.host.layout"][0] = -1  # a compact tier: no slot checks, only by key
    target = build("cache", "cpu")
    with pytest.raises(RuntimeError, match=r"table 't0', tiers \['device', 'host'\].*twice"):
        target.load_state_dict(state)
