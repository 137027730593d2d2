"""The footprint model (dynemb.planning.footprint): estimates against real allocations,
hand-computed cases, and the table layer's sizing rules it asks for."""
import pytest
import torch
from torchrec.distributed.planner.types import Storage
from torchrec.distributed.types import PipelineType
from torchrec.modules.embedding_configs import DataType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, FrequencyAdmission,
                    OptimizerConfig, OptimizerType, StorageMode)
from dynemb.stores.backing_store import default_store
from dynemb.planning import measure_allocated, table_footprint
from dynemb.modules.rank_share import local_table_config, local_table_options
from dynemb.tables import DynamicTable, PlannedRows
from tests.planning_models import table_config

DIM = 16
ROWS = 12_000
ROW_BYTES = {OptimizerType.SGD: DIM * 4, OptimizerType.ADAM: 3 * DIM * 4}
MODES = {
    "hbm_direct": lambda opt: DynamicEmbTableOptions(),
    # a quarter of the table's values + state fits the device
    "cache": lambda opt: DynamicEmbTableOptions(
        caching=True, global_hbm_for_values=ROWS * ROW_BYTES[opt] // 4),
    "default": lambda opt: DynamicEmbTableOptions(
        caching=False, global_hbm_for_values=ROWS * ROW_BYTES[opt] // 4,
        admission=FrequencyAdmission(threshold=2, counter_capacity=3000)),
}


def _rank_collection(config, options, optimizer, world):
    """What one rank of a row-wise sharded collection builds (as the sharder does)."""
    return DynamicEmbCollection(
        [local_table_config(config, world)], "cpu",
        table_options={config.name: local_table_options(options, world)},
        optimizer=optimizer)


def _fill_store(table):
    """Write back rows until the CACHE store has grown to its largest size (it keeps room
    for twice the table's rows)."""
    start = 0
    while table.store.capacity < table.store.max_capacity:
        keys = torch.arange(start, start + 4096) * 7 + 1
        table.store.insert(keys, torch.zeros(keys.numel(), table.width),
                           torch.zeros(keys.numel(), dtype=torch.int64))
        start += 4096


def _close(estimate, actual, rel=0.05):
    return abs(estimate - actual) <= rel * actual


# -- estimates vs bytes actually allocated -------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("opt_type", [OptimizerType.SGD, OptimizerType.ADAM])
@pytest.mark.parametrize("mode", list(MODES))
def test_estimate_matches_allocation(mode, opt_type, world):
    config, optimizer = table_config(), OptimizerConfig(opt_type)
    options = MODES[mode](opt_type)
    for rank in range(world):
        collection = _rank_collection(config, options, optimizer, world)
        table = collection.tables["t"]
        assert table.mode.value == mode
        if table.mode is StorageMode.CACHE:
            before = measure_allocated(collection)["t"].host_bytes
            _fill_store(table)
            assert measure_allocated(collection)["t"].host_bytes > before  # it grew
        actual = measure_allocated(collection)["t"]
        est = table_footprint(config, options, optimizer, world_size=world, rank=rank)
        assert est.mode is table.mode
        # device: values, optimizer state, hash metadata, admission counter
        assert _close(est.device_static_bytes, actual.device_bytes), (est, actual)
        assert _close(est.host_bytes, actual.host_bytes), (est, actual)
        assert _close(est.static_bytes, actual.total_bytes), (est, actual)
        # the big categories are exact
        assert est.values_bytes == actual.values_bytes
        assert est.optimizer_bytes == actual.optimizer_bytes
        assert est.hash_bytes == actual.hash_bytes
        assert est.admission_bytes == actual.admission_bytes
        assert est.host_values_bytes == actual.host_values_bytes
        assert est.host_optimizer_bytes == actual.host_optimizer_bytes
        assert est.host_hash_bytes == actual.host_hash_bytes
        # and independent of the estimator: the tensors the table really holds
        weights = table.tier.flat.weights
        assert actual.values_bytes + actual.optimizer_bytes == weights.numel() * 4
        if opt_type is OptimizerType.SGD:
            assert actual.optimizer_bytes == 0
        else:
            assert actual.optimizer_bytes == 2 * actual.values_bytes
        if mode == "hbm_direct":
            assert actual.host_values_bytes == 0
        else:  # a quarter of the rank's budget on the device, the rest behind it
            budget = ROWS * ROW_BYTES[opt_type] // 4 // world
            assert weights.numel() * 4 <= budget


def test_growing_table_reaches_its_estimate():
    """HBM_DIRECT starting small grows, under training, to the size the planner reserves."""
    config = table_config(rows=1000)
    options = DynamicEmbTableOptions(init_capacity=128, max_capacity=512)
    optimizer = OptimizerConfig(OptimizerType.ADAM, learning_rate=0.1)
    collection = _rank_collection(config, options, optimizer, 1)
    est = table_footprint(config, options, optimizer)
    assert measure_allocated(collection)["t"].device_bytes < est.device_static_bytes
    for start in (0, 250):
        ids = torch.arange(start, start + 250) * 1000003
        kjt = KeyedJaggedTensor.from_lengths_sync(["t"], ids, torch.ones(250, dtype=torch.int64))
        collection(kjt)["t"].values().sum().backward()
    actual = measure_allocated(collection)["t"]
    assert collection.tables["t"].tier.hash.capacity == 512
    assert actual.device_bytes == est.device_static_bytes
    assert actual.in_flight_bytes == 0


# -- the table layer's sizing rules ----------------------------------------------------------------
@pytest.mark.parametrize("mode", list(MODES))
def test_planned_rows_are_the_built_tables(mode):
    options = MODES[mode](OptimizerType.SGD)
    table = _rank_collection(table_config(), options, OptimizerConfig(), 1).tables["t"]
    planned = type(table).planned_rows(table.layout, table.options)
    assert planned.device_rows == table.tier.hash.capacity == table.tier.flat.weights.shape[0]
    if mode == "hbm_direct":
        assert planned == PlannedRows(device_rows=table.layout.max_capacity)
    elif mode == "cache":  # the store at the most it grows to
        assert planned.host_rows == planned.host_hash_slots == table.store.max_capacity
    else:
        host = table.host_tier
        assert planned.host_rows == planned.host_hash_slots == host.hash.capacity
        assert planned.host_rows == host.flat.weights.shape[0]
    assert planned.host_exact


def test_planned_rows_of_a_user_store_count_rows_only():
    options = DynamicEmbTableOptions(caching=True, global_hbm_for_values=ROWS * DIM,
                                     backing_store=default_store(ROWS))
    table = _rank_collection(table_config(), options, OptimizerConfig(), 1).tables["t"]
    planned = type(table).planned_rows(table.layout, table.options)
    assert planned == PlannedRows(table.layout.device_capacity,
                                  host_rows=ROWS, host_hash_slots=0,
                                  host_exact=False)


def test_fixed_memory_is_what_every_table_holds():
    fixed = DynamicTable.fixed_memory()
    for mode, make in MODES.items():
        built = _rank_collection(table_config(), make(OptimizerType.SGD), OptimizerConfig(), 1)
        actual = measure_allocated(built)["t"]
        assert (actual.other_bytes, actual.host_other_bytes) == (
            fixed.other_bytes, fixed.host_other_bytes), mode


# -- hand-computed small cases ---------------------------------------------------------------------
def test_hand_computed_hbm_direct_adam():
    # 1000 rows over 2 ranks: 500 ids per rank, which fit without evicting in 6 buckets of
    # 128 slots (slots_for_keys(500) = 768 rows)
    fp = table_footprint(table_config(rows=1000, dim=8), DynamicEmbTableOptions(),
                         OptimizerConfig(OptimizerType.ADAM), world_size=2, batch_size=64,
                         input_lengths=[3.0], unique_ratio=0.5,
                         pipeline_type=PipelineType.TRAIN_SPARSE_DIST)
    assert fp.mode is StorageMode.HBM_DIRECT and fp.device_rows == 768
    assert fp.values_bytes == 768 * 8 * 4                 # 24,576
    assert fp.optimizer_bytes == 768 * 16 * 4             # Adam m and v: 49,152
    assert fp.hash_bytes == 768 * (8 + 8 + 4) + 8         # key, score, refcount; size: 15,368
    assert fp.admission_bytes == 0
    assert fp.input_bytes == 64 * 3 // 2 * 8              # 96 distinct ids of 192: 768
    assert fp.output_bytes == 64 * 3 * 8 * 4              # float32 rows per occurrence: 6,144
    assert fp.io_bytes == 2 * 768                         # TRAIN_SPARSE_DIST: 2 x input
    assert fp.device_bytes == 24_576 + 49_152 + 15_368 + 88 + 1_536  # 88: 11 int64 counters
    assert fp.host_bytes == 0
    assert fp.storage() == Storage(hbm=90_720, ddr=0)


def test_hand_computed_cache_fp16_sgd_prefetch_pipeline():
    # fp16, dim 4, SGD: 8 bytes per row. Budget 8192 over 2 ranks = 4096 bytes = 512 rows.
    options = DynamicEmbTableOptions(caching=True, global_hbm_for_values=8192,
                                     admission=FrequencyAdmission(2, counter_capacity=1000))
    fp = table_footprint(table_config(rows=10_000, dim=4, data_type=DataType.FP16), options,
                         OptimizerConfig(OptimizerType.SGD), world_size=2, batch_size=100,
                         input_lengths=[2.0, 1.0],
                         pipeline_type=PipelineType.TRAIN_PREFETCH_SPARSE_DIST)
    assert fp.mode is StorageMode.CACHE and fp.dtype is torch.float16
    assert fp.device_rows == 512
    assert fp.values_bytes == 512 * 4 * 2 and fp.optimizer_bytes == 0
    assert fp.hash_bytes == 512 * 20 + 8
    assert fp.admission_bytes == 512 * 20 + 8             # 1000 / 2 ranks -> 4 buckets of 128
    # the store has room for twice the rank's 5000 rows, in whole buckets: 78 x 128 = 9984
    assert fp.host_rows == 9_984
    assert fp.host_bytes == 9_984 * 4 * 2 + 9_984 * 20 + 8
    ids = 100 * 2 + 100 * 1                               # per rank and batch
    assert fp.input_bytes == ids * 8 and fp.prefetch_bytes == ids * 8
    assert fp.output_bytes == ids * 4 * 4                 # float32 out, not fp16
    assert fp.io_bytes == 3 * 2400 + int(7 * 2400)        # 3 x input + (1 + 6) x prefetch
    assert fp.device_bytes == 4096 + 10_248 + 10_248 + 88 + 24_000


def test_hand_computed_default_on_cpu_topology():
    # DEFAULT: device 256 rows; 1024 ids need 1664 slots, the host tier takes the other 1408
    options = DynamicEmbTableOptions(local_hbm_for_values=256 * 8 * 4)
    fp = table_footprint(table_config(rows=1024, dim=8), options, OptimizerConfig(),
                         batch_size=10, compute_device="cpu")
    assert fp.mode is StorageMode.DEFAULT
    assert (fp.device_rows, fp.host_rows) == (256, 1408)
    assert fp.host_bytes == 1408 * 32 + 1408 * 20 + 8
    # CPU: one memory, input and output counted once (TorchRec's CPU rule)
    assert fp.storage() == Storage(hbm=0, ddr=256 * 32 + 256 * 20 + 8 + 88 + fp.host_bytes
                                   + 10 * 8 + 10 * 8 * 4)


def test_bad_unique_ratio():
    with pytest.raises(ValueError, match="unique_ratio"):
        table_footprint(table_config(), DynamicEmbTableOptions(), OptimizerConfig(),
                        unique_ratio=0)


def test_hand_computed_pooled_io():
    # a DynamicEmbBagCollection's table: ids travel per occurrence (no dedup before the
    # all-to-all) and the owner pools one row per bag of every rank's batch
    fp = table_footprint(table_config(rows=1000, dim=8), DynamicEmbTableOptions(),
                         OptimizerConfig(OptimizerType.SGD), world_size=2, batch_size=64,
                         input_lengths=[3.0], unique_ratio=0.5, pooled=True,
                         pipeline_type=PipelineType.TRAIN_SPARSE_DIST)
    assert fp.input_bytes == 64 * 3 * 8                   # all 192 occurrences: 1,536
    assert fp.output_bytes == 2 * 64 * 8 * 4              # 2 ranks x 64 bags x dim 8: 4,096
    assert fp.io_bytes == 2 * 1_536                       # TRAIN_SPARSE_DIST: 2 x input
