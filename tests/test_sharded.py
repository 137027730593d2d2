"""Row-wise sharded DynamicEmbCollection on 1, 2 and 3 spawned CPU ranks (gloo).

Each scenario (tests/sharded_twin.py) trains, on the same batches:
- our sharded module under DistributedModelParallel (plain loop, TrainPipelineSparseDist or
  the prefetch pipeline),
- the unsharded DynamicEmbCollection on the global batch (loss / world size, as TorchRec
  divides sparse gradients by the world size),
- TorchRec's row-wise EmbeddingCollection with fbgemm's fused optimizer from the same
  initial rows (SGD and row-wise AdaGrad; fbgemm's CPU TBE has no Adam).
Outputs and losses must agree at every step, and the rows at the end. Ranks have different
batch sizes; at step 3 every id of table t1 is owned by rank 0, so the other ranks get no
keys for it. Worlds are spawned once per module; scenarios share them.
"""
import numpy as np

from tests.sharded_checks import (check_lookups_add_up, check_rows_on_owners, world_fixtures,
                                  world_tests)
from tests.sharded_twin import FEATURES, NUM_IDS, Scenario, run_scenarios

RTOL, ATOL = 1e-4, 1e-5

WORLD2 = {
    "sgd_plain": Scenario(loop="plain", eval_every=4, eval_pipeline=True),
    "sgd_pipeline": Scenario(loop="pipeline", sharding="mod"),
    "sgd_prefetch": Scenario(loop="prefetch"),
    "adam_plain": Scenario(optimizer="adam", loop="plain", dims=(8, 4), torchrec_twin=False),
    "adam_pipeline": Scenario(optimizer="adam", loop="pipeline", dims=(8, 4),
                              torchrec_twin=False),
    "adam_prefetch": Scenario(optimizer="adam", loop="prefetch", dims=(8, 4),
                              torchrec_twin=False),
    "cache_sgd_pipeline": Scenario(mode="cache", loop="pipeline"),
    "cache_rowwise_prefetch": Scenario(mode="cache", optimizer="rowwise_adagrad",
                                       loop="prefetch"),
    "admission_pipeline": Scenario(admission=2, loop="pipeline", torchrec_twin=False),
    "host_only_pipeline": Scenario(mode="host_only", loop="pipeline"),
    "mixed_model_pipeline": Scenario(loop="pipeline", with_ec_and_dense=True,
                                     torchrec_twin=False),
}
WORLD1 = {"sgd_pipeline": Scenario(loop="pipeline"),
          "adam_prefetch": Scenario(optimizer="adam", loop="prefetch", torchrec_twin=False)}
WORLD3 = {"sgd_pipeline": Scenario(loop="pipeline", sharding="mod"),
          "cache_adam_prefetch": Scenario(mode="cache", optimizer="adam", loop="prefetch",
                                          torchrec_twin=False, cache_rows=96)}


WORLDS = {2: WORLD2, 1: WORLD1, 3: WORLD3}
world2, world1, world3 = world_fixtures(run_scenarios, WORLDS)


def _check_steps(ranks, s):
    for rank, res in enumerate(ranks):
        assert len(res["outputs"]) == s.steps
        for step in range(s.steps):
            for f in FEATURES:
                got = res["outputs"][step][f]
                np.testing.assert_allclose(got, res["ref_outputs"][step][f], rtol=RTOL,
                                           atol=ATOL, err_msg=f"rank {rank} step {step} {f}")
                if s.torchrec_twin:
                    np.testing.assert_allclose(got, res["ec_outputs"][step][f], rtol=RTOL,
                                               atol=ATOL)
        if not s.with_ec_and_dense:  # there the loss also has the EC and dense terms
            np.testing.assert_allclose(res["losses"], res["ref_losses"], rtol=RTOL)
        if s.torchrec_twin:
            np.testing.assert_allclose(res["losses"], res["ec_losses"], rtol=RTOL)


def _check_rows(ranks, s):
    check_rows_on_owners(ranks, s.sharding, NUM_IDS, "ec_rows" if s.torchrec_twin else None, RTOL, ATOL)


def _check(ranks, s):
    _check_steps(ranks, s)
    _check_rows(ranks, s)
    if s.eval_every:
        return  # eval lookups count too
    check_lookups_add_up(ranks)


# every scenario of each world: test_two_ranks_match_unsharded_and_torchrec[<name>], ...
(test_two_ranks_match_unsharded_and_torchrec, test_one_rank,
 test_three_ranks) = world_tests(_check, WORLDS)


def test_pipelines_pick_up_the_sharded_module(world2):
    for name in ("sgd_pipeline", "sgd_prefetch", "mixed_model_pipeline"):
        pipelined = world2[name][0]["pipelined"]
        assert "ShardedDynamicEmbCollection" in pipelined, (name, pipelined)
    assert "ShardedEmbeddingCollection" in world2["mixed_model_pipeline"][0]["pipelined"]
    s = WORLD2["sgd_prefetch"]
    for res in world2["sgd_prefetch"]:  # the prefetch pipeline calls our prefetch each batch
        assert res["prefetch_calls"] == s.steps
    assert all(res["prefetch_calls"] == 0 for res in world2["sgd_pipeline"])


def test_cache_mode_evicts_when_sharded(world2):
    for name in ("cache_sgd_pipeline", "cache_rowwise_prefetch"):
        s = WORLD2[name]
        for res in world2[name]:
            assert res["modes"] == {"t0": "cache", "t1": "cache"}
            stats = res["stats"]["t0"]
            assert stats["rows_device"] == s.cache_rows
            assert stats["evictions"] > s.steps and stats["write_backs"] == stats["evictions"]
            assert stats["loads"] > 0


def test_host_only_when_sharded(world2):
    for res in world2["host_only_pipeline"]:  # the twin tests check its outputs and rows
        assert res["modes"] == {"t0": "host_only", "t1": "host_only"}
        assert res["stats"]["t0"]["rows_device"] == 0 < res["stats"]["t0"]["rows_backing"]


def test_admission_when_sharded(world2):
    ranks = world2["admission_pipeline"]
    rejects = sum(r["stats"]["t0"]["admission_rejects"] for r in ranks)
    assert rejects == ranks[0]["ref_stats"]["t0"]["admission_rejects"] > 0


def test_a_rank_with_no_keys_for_a_table(world2):
    # at step 3 every t1 id is owned by rank 0; rank 1 still gets its outputs (checked
    # against the references in the twin tests) and rank 1's t1 shard saw none of them
    s = WORLD2["sgd_plain"]
    assert s.lonely_step is not None and s.uneven
    ranks = world2["sgd_plain"]
    assert all(len(r["outputs"][s.lonely_step]["f2"]) > 0 for r in ranks)


def test_eval_inserts_and_updates_nothing(world2):
    for res in world2["sgd_plain"]:
        assert res["eval"], "eval probes ran"
        for probe in res["eval"]:
            assert probe["inserts_before"] == probe["inserts_after"]
            for values in probe["out"].values():  # unseen ids: the eval initializer (zeros)
                assert values.shape[0] == 2 and not values.any()


def test_eval_pipeline_reads_without_writing(world2):
    for res in world2["sgd_plain"]:
        ev = res["eval_pipeline"]
        assert ev["inserts_before"] == ev["inserts_after"] and ev["rows_unchanged"]
        for got, expected in zip(ev["outputs"], ev["expected"]):
            for f in FEATURES:  # seen ids: their trained rows; new ids: zeros
                np.testing.assert_allclose(got[f], expected[f], rtol=RTOL, atol=ATOL)
                assert got[f].any(axis=1).sum() > 0 and (~got[f].any(axis=1)).sum() > 0


def test_mixed_model_planned_by_torchrec_planner(world2):
    # dynamic tables, a TorchRec EC table and a dense layer; the plan comes from
    # EmbeddingShardingPlanner (dynemb.planning.make_planner); dynamic rows still match
    ranks = world2["mixed_model_pipeline"]
    assert ranks[0]["plan"] == {
        "dyn": {"t0": ("row_wise", "customized_kernel"), "t1": ("row_wise", "customized_kernel")},
        "ec": {"static": ("row_wise", "fused")}}
    _check_rows(ranks, WORLD2["mixed_model_pipeline"])
