"""fill_to_load_factor: tables (and a module's tables) filled with synthetic keys through the
training insert path, to a load factor as each storage mode counts it."""
import math

import pytest
import torch
from torchrec import EmbeddingConfig

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, FrequencyAdmission,
                    OptimizerConfig, ScorePolicy, StorageMode)
from dynemb.options import choose_storage_mode
from dynemb.tables import build_table
from dynemb.tables.fill import FillReport, fill_to_load_factor
from key_reference import initial_rows
from table_builder import DIM, INIT, SGD

TABLE_ID = 99


def table_of(backend, **options):
    options.setdefault("initializer", INIT)
    opts = DynamicEmbTableOptions(**options)
    layout = choose_storage_mode(opts, name="t", num_embeddings=2048, width=DIM,
                                 config_dtype=torch.float32)
    name, device = backend
    return build_table("t", TABLE_ID, DIM, layout, opts, SGD, torch.device(device), name)


MODES = {
    StorageMode.HBM_DIRECT: dict(max_capacity=1024),
    StorageMode.CACHE: dict(caching=True, local_hbm_for_values=512 * DIM * 4),
    StorageMode.DEFAULT: dict(local_hbm_for_values=512 * DIM * 4),
    StorageMode.HOST_ONLY: dict(local_hbm_for_values=0, max_capacity=1024),
}


def slots_of(table):
    """Every slot a load factor counts (the module docstring of dynemb.tables.fill)."""
    if table.mode is StorageMode.DEFAULT:
        return table.tier.hash.capacity + table.host_tier.hash.capacity
    return table.tier.hash.capacity


def test_the_target_rows_are_rounded_down():
    """0.1 of 13,952 slots (109 buckets of 128) is 1,395.2 rows: the fill stops at 1,395."""
    table = table_of(("cpu", "cpu"), max_capacity=13952)
    assert table.tier.hash.capacity == 13952
    report = fill_to_load_factor(table, 0.1, seed=1)
    assert report.rows == table.stats()["rows_device"] == 1395
    assert report.load_factor < 0.1


@pytest.mark.parametrize("mode", list(MODES), ids=[m.value for m in MODES])
@pytest.mark.parametrize("load_factor", [0.3, 0.8])
def test_a_table_reaches_its_load_factor_and_stats_agree(backend, mode, load_factor):
    table = table_of(backend, **MODES[mode])
    assert table.mode is mode
    report = fill_to_load_factor(table, load_factor, seed=3, batch_size=100)
    slots = slots_of(table)
    assert isinstance(report, FillReport) and report.capacity == slots
    # rows missing are never overshot: the fill ends at the target row exactly, rounded down
    assert report.rows == math.floor(load_factor * slots + 1e-9)
    assert report.load_factor <= load_factor
    assert abs(report.load_factor - load_factor) <= 100 / slots
    stats = table.stats()
    if mode is StorageMode.DEFAULT:
        assert stats["rows_device"] + stats["rows_backing"] == report.rows
        assert stats["rows_backing"] > 0 and stats["rows_device"] > 0
    elif mode is StorageMode.HOST_ONLY:  # its one tier is in host memory
        assert (stats["rows_backing"], stats["rows_device"]) == (report.rows, 0)
    else:
        assert stats["rows_device"] == report.rows
        assert stats["load_factor"] == report.load_factor
    assert report.inserted == report.rows  # from empty
    # the keys the report names: distinct, every one the table holds (CACHE: the cache and
    # the rows it evicted to the store)
    keys = report.keys
    assert torch.unique(keys).numel() == keys.numel()
    held = report.rows + (stats["rows_backing"] if mode is StorageMode.CACHE else 0)
    assert keys.numel() == held
    rows, found = table.read_rows(keys)
    assert bool(found.all())
    some = keys[:20].cpu()
    want = torch.tensor(initial_rows(INIT, some.tolist(), DIM, seed=0, table_id=TABLE_ID))
    torch.testing.assert_close(rows[:20].cpu(), want)


def test_cache_evictions_go_to_the_store_and_the_keys_stay_findable(backend):
    table = table_of(backend, **MODES[StorageMode.CACHE])
    report = fill_to_load_factor(table, 1.0, batch_size=64)
    stats = table.stats()
    assert report.rows == stats["rows_device"] == 512 and report.load_factor == 1.0
    assert stats["write_backs"] == stats["rows_backing"] > 0  # full buckets evicted early
    assert report.keys.numel() == 512 + stats["rows_backing"]
    assert bool(table.read_rows(report.keys)[1].all())


def test_a_growing_table_grows_as_training_grows_it(backend):
    table = table_of(backend, init_capacity=256, max_capacity=2048, max_load_factor=0.5)
    assert table.tier.hash.capacity == 256
    report = fill_to_load_factor(table, 0.75)
    assert table.tier.hash.capacity == 2048  # past 0.5 until it could grow no more
    assert report.rows == math.ceil(0.75 * 2048) == table.stats()["rows_device"]
    report = fill_to_load_factor(table, 0.25)  # already there: nothing to do
    assert report.inserted == 0 and report.keys.numel() == 0


def test_admission_lets_the_fill_keys_in_at_once(backend):
    table = table_of(backend, max_capacity=1024, admission=FrequencyAdmission(threshold=5))
    report = fill_to_load_factor(table, 0.5)
    assert report.rows == 512 and table.stats()["admission_rejects"] == 0
    assert table.admission.size() == 0


def test_same_seed_same_keys_and_different_seeds_differ():
    reports = [fill_to_load_factor(table_of(("cpu", "cpu"), max_capacity=1024), 0.2, seed=s)
               for s in (1, 1, 2)]
    assert torch.equal(reports[0].keys, reports[1].keys)
    assert not torch.isin(reports[0].keys, reports[2].keys).any()


def test_a_module_fills_each_table():
    configs = [EmbeddingConfig(name=n, embedding_dim=DIM, num_embeddings=1024,
                               feature_names=[f]) for n, f in (("a", "fa"), ("b", "fb"))]
    ec = DynamicEmbCollection(configs, optimizer=SGD, table_options={
        "a": DynamicEmbTableOptions(max_capacity=1024),
        "b": DynamicEmbTableOptions(caching=True, local_hbm_for_values=256 * DIM * 4,
                                    score_strategy=ScorePolicy.LFU)})
    reports = fill_to_load_factor(ec, 0.5, seed=7)
    assert sorted(reports) == ["a", "b"]
    stats = ec.stats()
    for name, report in reports.items():
        assert stats[name]["rows_device"] == report.rows == stats[name]["device_capacity"] // 2
        assert bool(ec.read_rows(name, report.keys)[1].all())


@pytest.mark.parametrize("args, error, message", [
    ((0.0,), ValueError, "load_factor must be in"),
    ((1.5,), ValueError, "load_factor must be in"),
    ((True,), ValueError, "load_factor must be in"),
    ((0.5, 0), ValueError, "batch_size must be a positive int"),
])
def test_bad_arguments_raise_and_change_nothing(args, error, message):
    table = table_of(("cpu", "cpu"), max_capacity=1024)
    kwargs = {"batch_size": args[1]} if len(args) > 1 else {}
    with pytest.raises(error, match=message):
        fill_to_load_factor(table, args[0], **kwargs)
    assert table.tier.hash.size() == 0
    with pytest.raises(TypeError, match="takes a DynamicTable or a module"):
        fill_to_load_factor(object(), 0.5)
    with pytest.raises(TypeError, match="seed must be an int"):
        fill_to_load_factor(table, 0.5, seed=1.5)


def test_the_default_optimizer_rows_count_too():
    options, optimizer = DynamicEmbTableOptions(max_capacity=1024, initializer=INIT), \
        OptimizerConfig()
    state_dim = optimizer.state_dim(DIM)
    layout = choose_storage_mode(options, name="t", num_embeddings=1024, width=DIM + state_dim,
                                 state_dim=state_dim, config_dtype=torch.float32)
    table = build_table("t", TABLE_ID, DIM, layout, options, optimizer, torch.device("cpu"))
    assert fill_to_load_factor(table, 0.5).rows == 512


def test_a_customized_table_takes_the_score_of_its_fill_keys(backend):
    table = table_of(backend, max_capacity=1024, score_strategy=ScorePolicy.CUSTOMIZED)
    with pytest.raises(ValueError, match="CUSTOMIZED: pass the score its fill keys get"):
        fill_to_load_factor(table, 0.5)
    assert table.tier.hash.size() == 0
    report = fill_to_load_factor(table, 0.5, score=1234)
    assert report.rows == 512
    exported = table.tier.hash.export()
    assert set(exported.scores.tolist()) == {1234}
