"""Row-wise sharded DynamicEmbBagCollection on 1, 2 and 3 spawned CPU ranks (gloo).

Each scenario (tests/sharded_bag_twin.py) trains, on the same batches:
- our sharded pooled module under DistributedModelParallel (plain loop,
  TrainPipelineSparseDist or the prefetch pipeline),
- the unsharded DynamicEmbBagCollection on the global batch (loss / world size, as TorchRec
  divides sparse gradients by the world size),
- in the ``twin`` scenarios, TorchRec's row-wise EmbeddingBagCollection with fbgemm's fused
  optimizer from the same initial rows (equal batch sizes there: TorchRec's uneven
  reduce-scatter has no backward on gloo).
Pooled outputs and losses must agree at every step, and the rows at the end. Elsewhere ranks
have different batch sizes. Worlds are spawned once per module; scenarios share them.
"""
import numpy as np
import pytest
import torch

from tests.sharded_checks import (check_lookups_add_up, check_rows_on_owners, world_fixtures,
                                  world_tests)
from tests.sharded_bag_twin import FEATURES, NUM_IDS, BagScenario, bag_tables, run_scenarios

RTOL, ATOL = 1e-4, 1e-5
TWIN = dict(uneven=False, torchrec_twin=True)

WORLD2 = {
    "sum_sgd_plain_twin": BagScenario(pooling="sum", optimizer="sgd", loop="plain", **TWIN),
    "mean_adagrad_pipeline_twin": BagScenario(pooling="mean", optimizer="adagrad",
                                              loop="pipeline", sharding="mod", **TWIN),
    "weighted_rowwise_prefetch_twin": BagScenario(pooling="weighted",
                                                  optimizer="rowwise_adagrad",
                                                  loop="prefetch", **TWIN),
    "mixed_clipped_pipeline_twin": BagScenario(optimizer="sgd_clipped", loop="pipeline",
                                               **TWIN),
    "cache_rowwise_pipeline_twin": BagScenario(mode="cache", pooling="mean",
                                               optimizer="rowwise_adagrad", loop="pipeline", **TWIN),
    "default_sgd_plain_twin": BagScenario(mode="default", pooling="sum", loop="plain", **TWIN),
    "mixed_adam_plain": BagScenario(optimizer="adam", loop="plain", probe_bad_input=True,
                                    export_state=True),
    "weighted_adam_pipeline": BagScenario(pooling="weighted", optimizer="adam",
                                          loop="pipeline"),
    "weighted_sgd_plain": BagScenario(pooling="weighted", loop="plain", probe_bad_input=True),
    "cache_mean_sgd_prefetch": BagScenario(mode="cache", pooling="mean", loop="prefetch"),
    "mixed_model_pipeline": BagScenario(loop="pipeline", with_ebc_and_dense=True),
    # ranks whose KJTs differ in id and length dtype (each valid alone)
    "int32_then_int64_ids_plain": BagScenario(pooling="weighted", loop="plain",
                                              id_dtypes=("int32", "int64")),
    "int64_then_int32_ids_pipeline": BagScenario(loop="pipeline",
                                                 id_dtypes=("int64", "int32")),
}
WORLD1 = {"mean_sgd_pipeline_twin": BagScenario(pooling="mean", loop="pipeline", **TWIN),
          "weighted_adam_prefetch": BagScenario(pooling="weighted", optimizer="adam",
                                                loop="prefetch")}
WORLD3 = {"mixed_rowwise_pipeline_twin": BagScenario(optimizer="rowwise_adagrad",
                                                     loop="pipeline", **TWIN),
          "cache_mean_adam_prefetch": BagScenario(mode="cache", pooling="mean",
                                                  optimizer="adam", loop="prefetch",
                                                  cache_rows=128),
          "weighted_sgd_plain": BagScenario(pooling="weighted", loop="plain", sharding="mod")}


WORLDS = {2: WORLD2, 1: WORLD1, 3: WORLD3}
world2, world1, world3 = world_fixtures(run_scenarios, WORLDS)


def _check_steps(ranks, s):
    for rank, res in enumerate(ranks):
        assert len(res["outputs"]) == s.steps
        batch = s.batch + (rank if s.uneven else 0)
        for step in range(s.steps):
            for f in FEATURES:
                got = res["outputs"][step][f]
                assert got.shape[0] == batch
                np.testing.assert_allclose(got, res["ref_outputs"][step][f], rtol=RTOL,
                                           atol=ATOL, err_msg=f"rank {rank} step {step} {f}")
                if s.torchrec_twin:
                    np.testing.assert_allclose(got, res["twin_outputs"][step][f], rtol=RTOL,
                                               atol=ATOL, err_msg=f"twin, rank {rank} {f}")
        if not s.with_ebc_and_dense:  # there the loss also has the EBC and dense terms
            np.testing.assert_allclose(res["losses"], res["ref_losses"], rtol=RTOL)


def _check_rows(ranks, s):
    check_rows_on_owners(ranks, s.sharding, NUM_IDS, "twin_rows" if s.torchrec_twin else None, RTOL, ATOL)


def _check(ranks, s):
    _check_steps(ranks, s)
    _check_rows(ranks, s)
    if s.probe_bad_input:
        return  # the probe's recovery step counts too
    check_lookups_add_up(ranks)


# every scenario of each world: test_two_ranks_match_unsharded_and_torchrec[<name>], ...
(test_two_ranks_match_unsharded_and_torchrec, test_one_rank,
 test_three_ranks) = world_tests(_check, WORLDS)


def test_pipelines_pick_up_the_sharded_module(world2):
    for name in ("mean_adagrad_pipeline_twin", "weighted_rowwise_prefetch_twin",
                 "mixed_model_pipeline"):
        assert "ShardedDynamicEmbBagCollection" in world2[name][0]["pipelined"], name
    assert "ShardedEmbeddingBagCollection" in world2["mixed_model_pipeline"][0]["pipelined"]
    assert world2["sum_sgd_plain_twin"][0]["type"] == "ShardedDynamicEmbBagCollection"


def test_storage_modes_when_sharded(world2):
    for name, mode in (("cache_rowwise_pipeline_twin", "cache"),
                       ("default_sgd_plain_twin", "default"),
                       ("mixed_adam_plain", "hbm_direct")):
        for res in world2[name]:
            assert res["modes"] == {"t0": mode, "t1": mode}, name
    s = WORLD2["cache_rowwise_pipeline_twin"]
    for res in world2["cache_rowwise_pipeline_twin"]:  # more evictions than steps
        stats = res["stats"]["t0"]
        assert stats["rows_device"] == s.cache_rows
        assert stats["evictions"] > s.steps and stats["write_backs"] == stats["evictions"]


def test_mixed_model_planned_by_torchrec_planner(world2):
    # dynamic bag tables, a TorchRec EBC table and a dense layer, planned by
    # EmbeddingShardingPlanner with dynemb's estimators; the dynamic rows still match
    ranks = world2["mixed_model_pipeline"]
    assert ranks[0]["plan"] == {
        "bags": {"t0": ("row_wise", "customized_kernel"),
                 "t1": ("row_wise", "customized_kernel")},
        "static": {"static": ("table_wise", "fused")}}
    _check_rows(ranks, WORLD2["mixed_model_pipeline"])


@pytest.mark.parametrize("name", ["mixed_adam_plain", "weighted_sgd_plain"])
def test_bad_input_raises_and_changes_nothing(world2, name):
    for res in world2[name]:
        probe = res["bad_input"]
        errors = probe["errors"]
        assert "['f0']" in errors["missing_feature"] and "not in the KJT" in errors[
            "missing_feature"]
        if WORLD2[name].pooling == "weighted":
            assert "has no weights" in errors["no_weights"]
        assert "reserved key" in errors["reserved_id"]
        assert probe["unchanged"]


def test_sharded_state_loads_into_an_unsharded_module(world2):
    """Both ranks' shares of the tables, saved by the sharded module's state_dict, load by
    key into the unsharded module: every row the reference trained, with its optimizer
    state."""
    from dynemb import DynamicEmbBagCollection
    from tests.sharded_bag_twin import optimizer_configs, table_options
    s = WORLD2["mixed_adam_plain"]
    opt_config, _ = optimizer_configs(s.optimizer)
    state = {}
    for res in world2["mixed_adam_plain"]:
        state.update({k[len("bags."):]: v for k, v in res["state"].items()})
    assert any("rank1_of_2" in k for k in state) and any("rank0_of_2" in k for k in state)
    unsharded = DynamicEmbBagCollection(bag_tables(s), table_options=table_options(
        s, opt_config, 2), optimizer=opt_config)
    unsharded.load_state_dict(state)
    for name in ("t0", "t1"):
        held = {}
        for res in world2["mixed_adam_plain"]:
            held.update(zip(*(a.tolist() for a in res["rows"][name])))
        keys = torch.tensor(sorted(held))
        rows, found = unsharded.read_rows(name, keys)
        assert bool(found.all())
        np.testing.assert_allclose(rows.numpy(), np.array([held[k] for k in sorted(held)]),
                                   rtol=0, atol=0)


def test_eval_reads_without_writing(world2):
    for res in world2["mixed_adam_plain"]:
        probe = res["eval"]
        assert probe["inserts_before"] == probe["inserts_after"]
        for f in FEATURES:
            assert probe["unseen"][f].shape[0] == 2 and not probe["unseen"][f].any()
            np.testing.assert_allclose(probe["seen"][f], probe["expected"][f], rtol=RTOL,
                                       atol=ATOL)
            assert probe["seen"][f].any()
