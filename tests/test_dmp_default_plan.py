"""DistributedModelParallel without a plan (TorchRec's default planner) shards dynamic modules
as a hand-written row-wise plan does, with dynemb's storage estimates; ordinary tables keep
TorchRec's estimates."""
import copy

import pytest
import torch
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.estimator.estimator import EmbeddingPerfEstimatorFactory
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.distributed.planner.constants import DEFAULT_PERF_ESTIMATOR

from dynemb import DynamicEmbTableOptions, OptimizerConfig, OptimizerType
from dynemb.planning import table_footprint
from dynemb.sharding import DynamicEmbCollectionSharder
from examples.spawn import run_on_ranks
from tests.dmp_default_plan_worker import SeqAndBagModel, run, sharders
from tests.torchrec_probes import SearchSpaceRecorder
from tests.torchrec_twin import ensure_single_process_group
from tests.torchrec_versions import TORCHREC_VERSION, needs_torchrec_18

pytestmark = pytest.mark.skipif(
    TORCHREC_VERSION < (1, 8),
    reason=needs_torchrec_18("the planner's estimators take sharder_data_map"))


def _assert_same_training(result):
    planned, default = result["planned"], result["default"]
    for (loss_p, seq_p, bag_p), (loss_d, seq_d, bag_d) in zip(planned["steps"],
                                                              default["steps"]):
        torch.testing.assert_close(loss_d, loss_p, rtol=0, atol=0)
        torch.testing.assert_close(seq_d, seq_p, rtol=0, atol=0)
        torch.testing.assert_close(bag_d, bag_p, rtol=0, atol=0)
    for table in ("t", "u"):
        torch.testing.assert_close(default["rows"][table], planned["rows"][table],
                                   rtol=0, atol=0)
    assert sum(r.abs().sum() for r in default["rows"].values()) > 0  # rows were trained


def test_dmp_without_plan_trains_like_the_hand_planned_model_on_one_rank():
    ensure_single_process_group()
    result = run(0, 1)
    assert "customized_kernel" in result["plan"] and "row_wise" in result["plan"]
    _assert_same_training(result)


def test_dmp_without_plan_trains_like_the_hand_planned_model_on_two_ranks():
    for result in run_on_ranks(2, run, timeout=300):
        assert "customized_kernel" in result["plan"]
        _assert_same_training(result)


def _searched_options(topology, model, sharder_list):
    recorder = SearchSpaceRecorder()
    EmbeddingShardingPlanner(topology=topology, stats=recorder.planner_stats()).plan(
        model, sharder_list)
    return recorder.search_space


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_default_planner_estimates_dynamic_tables_with_their_footprint(device):
    world = 2
    optimizer = OptimizerConfig(OptimizerType.ADAM)
    model = SeqAndBagModel(optimizer)
    model.ec = type(model.ec)(model.ec.embedding_configs(), device="meta", optimizer=optimizer,
                              table_options=DynamicEmbTableOptions(
                                  caching=True, local_hbm_for_values=64 * 48 * 4))
    topology = Topology(world_size=world, compute_device=device)
    options = {o.name: o for o in _searched_options(topology, model, sharders())}
    assert set(options) == {"t", "u"}
    for name, module in (("t", model.ec), ("u", model.ebc)):
        option = options[name]
        assert (option.sharding_type, option.compute_kernel) == ("row_wise",
                                                                 "customized_kernel")
        config = module.table_configs()[0]
        for rank, shard in enumerate(option.shards):
            expected = table_footprint(
                config, module.table_options[name], optimizer, world_size=world, rank=rank,
                batch_size=option.batch_size, input_lengths=option.input_lengths,
                compute_device=device, pooled=name == "u").storage()
            assert shard.storage == expected
            assert shard.perf is not None and shard.perf.total > 0


def test_default_planner_gives_ordinary_tables_torchrec_estimates():
    DynamicEmbCollectionSharder()  # what installs dynemb's estimators in the default planner
    topology = Topology(world_size=2, compute_device="cuda")
    model = torch.nn.Sequential(EmbeddingCollection(tables=[EmbeddingConfig(
        name="static", embedding_dim=16, num_embeddings=5000, feature_names=["s"])],
        device=torch.device("meta")))
    torchrec_only = EmbeddingEnumerator(topology, 512, estimator=[
        EmbeddingPerfEstimatorFactory.create(DEFAULT_PERF_ESTIMATOR, topology=topology),
        EmbeddingStorageEstimator(topology=topology)])
    expected = torchrec_only.enumerate(copy.deepcopy(model), [EmbeddingCollectionSharder()])
    got = EmbeddingEnumerator(topology, 512).enumerate(model, [EmbeddingCollectionSharder()])
    assert [(o.sharding_type, o.compute_kernel, [(s.storage, s.perf) for s in o.shards])
            for o in got] == [(o.sharding_type, o.compute_kernel,
                               [(s.storage, s.perf) for s in o.shards]) for o in expected]
    assert len(got) > 1  # TorchRec's planner chose among several options
