"""TorchRec's planner with the dynamic-table estimators (dynemb.planning.estimators) on a
model with dynamic tables, an EmbeddingCollection and a Linear; its stats output."""
import logging
import re

import pytest
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import (EmbeddingPerfEstimator,
                                                           EmbeddingStorageEstimator)
from torchrec.distributed.planner.types import Storage
from torchrec.distributed.planner.utils import bytes_to_gb
from torchrec.distributed.types import PipelineType

from dynemb import StorageMode
from dynemb.planning import (DynamicEmbPerfEstimator, DynamicEmbStorageEstimator,
                             dynamic_embedding_enumerator, footprints, make_planner)
from tests.planning_models import BATCH, MixedModel, mixed_constraints, sharders, topology
from tests.torchrec_probes import sharder_data_map


def test_dynemb_constraints_only_touch_dynamic_tables():
    model = MixedModel()
    constraints = mixed_constraints(model)
    assert set(constraints) == {"items", "users"}
    for name in ("items", "users"):
        assert constraints[name].sharding_types == ["row_wise"]
        assert constraints[name].compute_kernels == ["customized_kernel"]
    assert constraints["items"].pooling_factors == [20.0, 1.0]  # kept


def test_planner_plans_dynamic_and_ordinary_tables():
    model = MixedModel()
    constraints = mixed_constraints(model)
    pipeline = PipelineType.TRAIN_SPARSE_DIST
    planner = make_planner(topology(), constraints, batch_size=BATCH, pipeline_type=pipeline)
    plan = planner.plan(model, sharders())
    for name in ("items", "users"):
        ps = plan.plan["dyn"][name]
        assert ps.sharding_type == "row_wise"
        assert ps.compute_kernel == "customized_kernel"
        assert sorted(ps.ranks) == [0, 1]
    assert plan.plan["ec"]["cats"].compute_kernel != "customized_kernel"

    # storage of every option as the planner's enumerator computes it
    enumerator = dynamic_embedding_enumerator(topology(), BATCH, constraints, pipeline)
    options = enumerator.enumerate(model, sharders())
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
        topology=topology(), batch_size=BATCH, constraints=constraints,
        estimator=[EmbeddingPerfEstimator(topology(), constraints),
                   EmbeddingStorageEstimator(topology(), constraints, pipeline_type=pipeline)])
    reference = {(o.sharding_type, o.compute_kernel): o
                 for o in plain.enumerate(model, [EmbeddingCollectionSharder()])}
    cats = [o for o in options if o.name == "cats"]
    assert {(o.sharding_type, o.compute_kernel) for o in cats} == set(reference)
    for option in cats:
        ref = reference[(option.sharding_type, option.compute_kernel)]
        assert [s.storage for s in option.shards] == [s.storage for s in ref.shards]
        assert [s.perf for s in option.shards] == [s.perf for s in ref.shards]


def test_perf_estimator_restores_labels_and_leaves_others_alone():
    model = MixedModel()
    constraints = mixed_constraints(model)
    enumerator = EmbeddingEnumerator(topology=topology(), batch_size=BATCH,
                                     constraints=constraints,
                                     estimator=[DynamicEmbStorageEstimator(topology(),
                                                                           constraints)])
    options = enumerator.enumerate(model, sharders())
    before = [(o.name, o.compute_kernel, o.cache_params) for o in options]
    perf = DynamicEmbPerfEstimator(topology(), constraints)
    kernels = {o.name: perf.proxy_kernel(o) for o in options if o.name != "cats"}
    assert kernels["users"] == ("fused", None)
    kernel, ratio = kernels["items"]
    assert kernel == "fused_uvm_caching"
    layout_ratio = (256 << 20) // 2 // (64 * 3 * 4) // 128 * 128 / 2_000_000
    assert ratio == pytest.approx(layout_ratio)
    perf.estimate(options, sharder_data_map(enumerator))
    assert [(o.name, o.compute_kernel, o.cache_params) for o in options] == before
    assert all(s.perf is not None for o in options for s in o.shards)


# -- TorchRec's stats table shows our numbers -------------------------------------------------
def test_stats_table_shows_dynamic_footprint(caplog):
    model = MixedModel()
    constraints = mixed_constraints(model)
    pipeline = PipelineType.TRAIN_SPARSE_DIST
    caplog.set_level(logging.INFO, logger="torchrec.distributed.planner.stats")
    caplog.set_level(logging.INFO, logger="dynemb.planning")
    make_planner(topology(), constraints, batch_size=BATCH,
                 pipeline_type=pipeline).plan(model, sharders())
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
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name == "dynemb.planning")
    assert re.search(r"^dyn\.items\s+0\s+CACHE", ours, re.M)
    assert re.search(r"^dyn\.users\s+1\s+HBM_DIRECT", ours, re.M)


def test_bag_tables_are_estimated_as_pooled():
    # TorchRec calls every EmbeddingCollectionInterface unpooled and everything else pooled:
    # DynamicEmbBagCollection is an EmbeddingBagCollectionInterface, as TorchRec's EBC
    import torch
    from torchrec.distributed.planner import Topology
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    from dynemb import DynamicEmbBagCollection
    from dynemb.planning import dynemb_constraints
    from dynemb.sharding import DynamicEmbBagCollectionSharder

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bags = DynamicEmbBagCollection(
                [EmbeddingBagConfig(name="b", embedding_dim=16, num_embeddings=10_000,
                                    feature_names=["f"])], device="meta")

    model = Model()
    topo = Topology(world_size=2, local_world_size=2, compute_device="cpu")
    constraints = dynemb_constraints(model)
    enumerator = EmbeddingEnumerator(topology=topo, batch_size=BATCH, constraints=constraints,
                                     estimator=[DynamicEmbStorageEstimator(topo, constraints)])
    options = enumerator.enumerate(model, [DynamicEmbBagCollectionSharder()])
    assert options and all(o.is_pooled for o in options)
    DynamicEmbPerfEstimator(topo, constraints).estimate(options, sharder_data_map(enumerator))
    assert all(s.perf is not None for o in options for s in o.shards)
