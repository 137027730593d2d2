"""Planner support: estimates against real allocations, TorchRec's planner on a mixed model,
its stats output, the footprint report, and hand-computed cases."""
import logging
import re

import pytest
import torch
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import (EmbeddingPerfEstimator,
                                                           EmbeddingStorageEstimator)
from torchrec.distributed.planner.types import ParameterConstraints, Storage
from torchrec.distributed.planner.utils import bytes_to_gb
from torchrec.distributed.types import PipelineType
from torchrec.modules.embedding_configs import DataType, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, FrequencyAdmission,
                    OptimizerConfig, OptimizerType, StorageMode)
from dynemb.planner import (DynamicEmbPerfEstimator, DynamicEmbStorageEstimator,
                            dynamic_embedding_enumerator, dynemb_constraints, footprint_report,
                            footprints, make_planner, measure_allocated, table_footprint)
from dynemb.sharding.plan_rows import local_table_config, local_table_options
from dynemb.sharding.sharder import DynamicEmbCollectionSharder

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


def _config(name="t", rows=ROWS, dim=DIM, features=("f",), data_type=DataType.FP32):
    return EmbeddingConfig(name=name, embedding_dim=dim, num_embeddings=rows,
                           feature_names=list(features), data_type=data_type)


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


# -- (a) estimates vs bytes actually allocated ---------------------------------------------------
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("opt_type", [OptimizerType.SGD, OptimizerType.ADAM])
@pytest.mark.parametrize("mode", list(MODES))
def test_estimate_matches_allocation(mode, opt_type, world):
    config, optimizer = _config(), OptimizerConfig(opt_type)
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
    config = _config(rows=1000)
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


# -- (b) the planner on a model with dynamic tables, an EmbeddingCollection and a Linear --------
BATCH = 64


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        adam = OptimizerConfig(OptimizerType.ADAM)
        self.dyn = DynamicEmbCollection(
            [_config("items", rows=4_000_000, dim=64, features=("history", "target")),
             _config("users", rows=1_000_000, dim=32, features=("user",))], device="meta",
            table_options={
                "items": DynamicEmbTableOptions(caching=True, global_hbm_for_values=256 << 20),
                "users": DynamicEmbTableOptions(
                    admission=FrequencyAdmission(threshold=2, counter_capacity=1 << 20))},
            optimizer=adam)
        self.ec = EmbeddingCollection(
            [_config("cats", rows=100_000, dim=64, features=("cat",))],
            device=torch.device("meta"))
        self.dense = torch.nn.Linear(64, 8)


def _sharders():
    return [DynamicEmbCollectionSharder(), EmbeddingCollectionSharder()]


def _topology():
    return Topology(world_size=2, compute_device="cuda")


def _constraints(model):
    base = {"items": ParameterConstraints(pooling_factors=[20.0, 1.0])}
    return dynemb_constraints(model, base)


def test_dynemb_constraints_only_touch_dynamic_tables():
    model = _Model()
    constraints = _constraints(model)
    assert set(constraints) == {"items", "users"}
    for name in ("items", "users"):
        assert constraints[name].sharding_types == ["row_wise"]
        assert constraints[name].compute_kernels == ["customized_kernel"]
    assert constraints["items"].pooling_factors == [20.0, 1.0]  # kept


def test_planner_plans_dynamic_and_ordinary_tables():
    model = _Model()
    constraints = _constraints(model)
    pipeline = PipelineType.TRAIN_SPARSE_DIST
    planner = make_planner(_topology(), constraints, batch_size=BATCH, pipeline_type=pipeline)
    plan = planner.plan(model, _sharders())
    for name in ("items", "users"):
        ps = plan.plan["dyn"][name]
        assert ps.sharding_type == "row_wise"
        assert ps.compute_kernel == "customized_kernel"
        assert sorted(ps.ranks) == [0, 1]
    assert plan.plan["ec"]["cats"].compute_kernel != "customized_kernel"

    # storage of every option as the planner's enumerator computes it
    enumerator = dynamic_embedding_enumerator(_topology(), BATCH, constraints, pipeline)
    options = enumerator.enumerate(model, _sharders())
    ours = [o for o in options if o.name in ("items", "users")]
    assert {(o.name, o.sharding_type, o.compute_kernel) for o in ours} == {
        ("items", "row_wise", "customized_kernel"), ("users", "row_wise", "customized_kernel")}
    expected = {f.table: f for f in footprints(model, world_size=2, batch_size=BATCH,
                                               pipeline_type=pipeline, constraints=constraints)}
    for option in ours:
        assert option.cache_params is None  # the perf estimator's stand-in was undone
        fp = expected[option.name]
        assert len(option.shards) == 2
        for shard in option.shards:
            assert shard.storage == Storage(hbm=fp.device_bytes, ddr=fp.host_bytes, ssd=0)
            assert shard.perf is not None and shard.perf.total > 0
    items = expected["items"]
    assert items.mode is StorageMode.CACHE and items.host_bytes > 0
    # the sequence of 20 + 1 ids per sample: 2 x int64 input per batch on the device
    assert items.io_bytes == 2 * BATCH * 21 * 8
    # the rank's device budget, not TorchRec's num_embeddings x dim view of the table
    assert items.values_bytes + items.optimizer_bytes <= (256 << 20) // 2
    assert items.device_bytes < 4_000_000 // 2 * 64 * 4

    # the EmbeddingCollection's options are TorchRec's own, untouched
    plain = EmbeddingEnumerator(
        topology=_topology(), batch_size=BATCH, constraints=constraints,
        estimator=[EmbeddingPerfEstimator(_topology(), constraints),
                   EmbeddingStorageEstimator(_topology(), constraints, pipeline_type=pipeline)])
    reference = {(o.sharding_type, o.compute_kernel): o
                 for o in plain.enumerate(model, [EmbeddingCollectionSharder()])}
    cats = [o for o in options if o.name == "cats"]
    assert {(o.sharding_type, o.compute_kernel) for o in cats} == set(reference)
    for option in cats:
        ref = reference[(option.sharding_type, option.compute_kernel)]
        assert [s.storage for s in option.shards] == [s.storage for s in ref.shards]
        assert [s.perf for s in option.shards] == [s.perf for s in ref.shards]


def test_perf_estimator_restores_labels_and_leaves_others_alone():
    model = _Model()
    constraints = _constraints(model)
    enumerator = EmbeddingEnumerator(topology=_topology(), batch_size=BATCH,
                                     constraints=constraints,
                                     estimator=[DynamicEmbStorageEstimator(_topology(),
                                                                           constraints)])
    options = enumerator.enumerate(model, _sharders())
    before = [(o.name, o.compute_kernel, o.cache_params) for o in options]
    perf = DynamicEmbPerfEstimator(_topology(), constraints)
    kernels = {o.name: perf.proxy_kernel(o) for o in options if o.name != "cats"}
    assert kernels["users"] == ("fused", None)
    kernel, ratio = kernels["items"]
    assert kernel == "fused_uvm_caching"
    layout_ratio = (256 << 20) // 2 // (64 * 3 * 4) // 128 * 128 / 2_000_000
    assert ratio == pytest.approx(layout_ratio)
    perf.estimate(options, enumerator._sharder_data_map)
    assert [(o.name, o.compute_kernel, o.cache_params) for o in options] == before
    assert all(s.perf is not None for o in options for s in o.shards)


# -- (c) TorchRec's stats table shows our numbers -------------------------------------------------
def test_stats_table_shows_dynamic_footprint(caplog):
    model = _Model()
    constraints = _constraints(model)
    pipeline = PipelineType.TRAIN_SPARSE_DIST
    caplog.set_level(logging.INFO, logger="torchrec.distributed.planner.stats")
    caplog.set_level(logging.INFO, logger="dynemb.planner")
    make_planner(_topology(), constraints, batch_size=BATCH,
                 pipeline_type=pipeline).plan(model, _sharders())
    stats = [r.getMessage() for r in caplog.records
             if r.name == "torchrec.distributed.planner.stats"]
    assert stats, "EmbeddingStats logged nothing"
    fps = footprints(model, world_size=2, batch_size=BATCH, pipeline_type=pipeline,
                     constraints=constraints)
    total_hbm = total_ddr = 0
    for name in ("items", "users"):
        mine = [f for f in fps if f.table == name]
        hbm, ddr = sum(f.device_bytes for f in mine), sum(f.host_bytes for f in mine)
        total_hbm, total_ddr = total_hbm + hbm, total_ddr + ddr
        cell = f"({round(bytes_to_gb(hbm), 3)} GB, {round(bytes_to_gb(ddr), 3)} GB, 0.0 GB)"
        rows = [line for line in stats if f"dyn.{name} " in line]
        assert len(rows) == 1 and "customized_kernel" in rows[0]
        assert cell in rows[0], (cell, rows[0])
    # TorchRec's view of the items table would be 4M x 64 fp32 weights on HBM, 0 DDR
    assert "(0.954 GB, 0.0 GB" not in "".join(stats)
    kernel_total = (f"customized_kernel: HBM: {round(bytes_to_gb(total_hbm), 3)} GB, "
                    f"DDR: {round(bytes_to_gb(total_ddr), 3)} GB")
    assert any(kernel_total in line for line in stats), kernel_total
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name == "dynemb.planner")
    assert re.search(r"^dyn\.items\s+0\s+CACHE", ours, re.M)
    assert re.search(r"^dyn\.users\s+1\s+HBM_DIRECT", ours, re.M)


# -- (d) the footprint report -------------------------------------------------------------------
def test_footprint_report_lines_and_total():
    model = _Model()
    constraints = _constraints(model)
    pipeline = PipelineType.TRAIN_PREFETCH_SPARSE_DIST
    text = footprint_report(model, 2, BATCH, pipeline, constraints=constraints)
    for name, mode in (("items", "CACHE"), ("users", "HBM_DIRECT")):
        for rank in (0, 1):
            assert re.search(rf"^{name}\s+{rank}\s+{mode}\s", text, re.M), text
        assert re.search(rf"^{name}\s+all\s", text, re.M)
    assert re.search(r"^\(all tables\)\s+0\s", text, re.M)
    total = re.search(r"^total: device ([\d,]+) bytes .* host ([\d,]+) bytes", text, re.M)
    device, host = (int(g.replace(",", "")) for g in total.groups())

    enumerator = dynamic_embedding_enumerator(_topology(), BATCH, constraints, pipeline)
    options = [o for o in enumerator.enumerate(model, _sharders()) if o.name != "cats"]
    assert device == sum(s.storage.hbm for o in options for s in o.shards)
    assert host == sum(s.storage.ddr for o in options for s in o.shards)
    # the per-rank line of a table carries the numbers of its shard
    items = [o for o in options if o.name == "items"][0]
    line = re.search(r"^items\s+0\s+CACHE.*$", text, re.M).group(0)
    host_mib = f"{items.shards[0].storage.ddr / 2**20:,.2f}"
    assert line.split()[-1] == host_mib


# -- (e) hand-computed small cases ---------------------------------------------------------------
def test_hand_computed_hbm_direct_adam():
    # 1000 rows over 2 ranks: 500 per rank, rounded up to whole 128-slot buckets = 512 rows
    fp = table_footprint(_config(rows=1000, dim=8), DynamicEmbTableOptions(),
                         OptimizerConfig(OptimizerType.ADAM), world_size=2, batch_size=64,
                         input_lengths=[3.0], unique_ratio=0.5,
                         pipeline_type=PipelineType.TRAIN_SPARSE_DIST)
    assert fp.mode is StorageMode.HBM_DIRECT and fp.device_rows == 512
    assert fp.values_bytes == 512 * 8 * 4                 # 16,384
    assert fp.optimizer_bytes == 512 * 16 * 4             # Adam m and v: 32,768
    assert fp.hash_bytes == 512 * (8 + 8 + 4) + 8         # key, score, refcount; size: 10,248
    assert fp.admission_bytes == 0
    assert fp.input_bytes == 64 * 3 // 2 * 8              # 96 distinct ids of 192: 768
    assert fp.output_bytes == 64 * 3 * 8 * 4              # float32 rows per occurrence: 6,144
    assert fp.io_bytes == 2 * 768                         # TRAIN_SPARSE_DIST: 2 x input
    assert fp.device_bytes == 16_384 + 32_768 + 10_248 + 96 + 1_536
    assert fp.host_bytes == 8
    assert fp.storage() == Storage(hbm=61_032, ddr=8)


def test_hand_computed_cache_fp16_sgd_prefetch_pipeline():
    # fp16, dim 4, SGD: 8 bytes per row. Budget 8192 over 2 ranks = 4096 bytes = 512 rows.
    options = DynamicEmbTableOptions(caching=True, global_hbm_for_values=8192,
                                     admission=FrequencyAdmission(2, counter_capacity=1000))
    fp = table_footprint(_config(rows=10_000, dim=4, data_type=DataType.FP16), options,
                         OptimizerConfig(OptimizerType.SGD), world_size=2, batch_size=100,
                         input_lengths=[2.0, 1.0],
                         pipeline_type=PipelineType.TRAIN_PREFETCH_SPARSE_DIST)
    assert fp.mode is StorageMode.CACHE and fp.dtype is torch.float16
    assert fp.device_rows == 512
    assert fp.values_bytes == 512 * 4 * 2 and fp.optimizer_bytes == 0
    assert fp.hash_bytes == 512 * 20 + 8
    assert fp.admission_bytes == 512 * 20 + 8             # 1000 / 2 ranks -> 4 buckets of 128
    # the store has room for twice the rank's 5000 rows (rounded to 40 buckets of 128 = 5120)
    assert fp.host_rows == 10_240
    assert fp.host_bytes == 10_240 * 4 * 2 + 10_240 * 20 + 8 + 8
    ids = 100 * 2 + 100 * 1                               # per rank and batch
    assert fp.input_bytes == ids * 8 and fp.prefetch_bytes == ids * 8
    assert fp.output_bytes == ids * 4 * 4                 # float32 out, not fp16
    assert fp.io_bytes == 3 * 2400 + int(7 * 2400)        # 3 x input + (1 + 6) x prefetch
    assert fp.device_bytes == 4096 + 10_248 + 10_248 + 96 + 24_000


def test_hand_computed_default_on_cpu_topology():
    # DEFAULT: device 256 rows, host tier takes the other 1024 - 256 = 768 rows
    options = DynamicEmbTableOptions(local_hbm_for_values=256 * 8 * 4)
    fp = table_footprint(_config(rows=1024, dim=8), options, OptimizerConfig(), batch_size=10,
                         compute_device="cpu")
    assert fp.mode is StorageMode.DEFAULT
    assert (fp.device_rows, fp.host_rows) == (256, 768)
    assert fp.host_bytes == 768 * 32 + 768 * 20 + 8 + 8
    # CPU: one memory, input and output counted once (TorchRec's CPU rule)
    assert fp.storage() == Storage(hbm=0, ddr=256 * 32 + 256 * 20 + 8 + 96 + fp.host_bytes
                                   + 10 * 8 + 10 * 8 * 4)


def test_bad_unique_ratio():
    with pytest.raises(ValueError, match="unique_ratio"):
        table_footprint(_config(), DynamicEmbTableOptions(), OptimizerConfig(), unique_ratio=0)
