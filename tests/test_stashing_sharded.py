"""Memory stashing of sharded dynamic tables on 1 and 2 spawned CPU ranks (gloo), under a
plain loop (restoring in the embedding backward, or earlier from a gradient hook),
TorchRec's TrainPipelineSparseDist, the prefetch pipeline, and TorchRec's EMS pipelines
(TrainPipelineSparseDistEmbStash, with and without delayed stashing, and
TrainPipelinePrefetchEMS). Each scenario (tests/stashing_worker.py) trains the same model with
and without stashing: outputs, losses and rows must be equal bit for bit, and the tables must
hold no device memory while the dense layer runs. Worlds are spawned once per module.
"""
import numpy as np
import pytest

from tests.sharded_checks import spawn_scenarios
from tests.stashing_worker import LOOPS, OPTIMIZERS, run_stash_scenarios, scenario

WORLD2 = {
    "plain": scenario(loop="plain"),
    "plain_hook_cache_adam": scenario(loop="plain_hook", mode="cache", optimizer="adam"),
    "pipeline_default_rowwise_values": scenario(loop="pipeline", mode="default",
                                                optimizer="rowwise_adagrad", stash="values"),
    "pipeline_adagrad_state": scenario(loop="pipeline", optimizer="adagrad",
                                       stash="optimizer_state"),
    "prefetch_cache_adagrad_state": scenario(loop="prefetch", mode="cache", optimizer="adagrad",
                                             stash="optimizer_state"),
    "prefetch_adam": scenario(loop="prefetch", optimizer="adam"),
    "embstash_cache_values": scenario(loop="embstash", mode="cache", stash="values"),
    "embstash_delay_rowwise": scenario(loop="embstash_delay", optimizer="rowwise_adagrad"),
    "prefetch_ems_default_adam_values": scenario(loop="prefetch_ems", mode="default",
                                                 optimizer="adam", stash="values"),
    "prefetch_ems_cache_rowwise": scenario(loop="prefetch_ems", mode="cache",
                                           optimizer="rowwise_adagrad"),
}
WORLD1 = {
    "plain_default_adagrad": scenario(loop="plain", mode="default", optimizer="adagrad"),
    "pipeline_cache_adam_values": scenario(loop="pipeline", mode="cache", optimizer="adam",
                                           stash="values"),
    "prefetch": scenario(loop="prefetch"),
    "embstash_adam_state": scenario(loop="embstash", optimizer="adam",
                                    stash="optimizer_state"),
    "prefetch_ems_adagrad": scenario(loop="prefetch_ems", optimizer="adagrad"),
}


@pytest.fixture(scope="module")
def world2():
    return spawn_scenarios(2, run_stash_scenarios, WORLD2)


@pytest.fixture(scope="module")
def world1():
    return spawn_scenarios(1, run_stash_scenarios, WORLD1)


def _check(ranks, s):
    for rank, res in enumerate(ranks):
        plain, stashed = res["plain"], res["stashed"]
        assert stashed["modes"] == plain["modes"] == {"t0": s.mode, "t1": s.mode}
        assert stashed["losses"] == plain["losses"], rank
        for step, (got, want) in enumerate(zip(stashed["outputs"], plain["outputs"])):
            for f in want:
                assert np.array_equal(got[f], want[f]), (rank, step, f)
        for name, (found, rows) in plain["rows"].items():
            assert np.array_equal(stashed["rows"][name][0], found), (rank, name)
            assert np.array_equal(stashed["rows"][name][1], rows), (rank, name)
        # TorchRec's pipelines run the model once more to find its modules: the last steps
        window = stashed["window"][-s.steps:]
        assert window == [{"t0": 0, "t1": 0}] * s.steps, (rank, stashed["window"])
        for name, (stashes, restores, _, _) in stashed["counts"].items():
            assert stashes == restores == s.steps, (rank, name, stashed["counts"])
        assert stashed["stashed_after"] == []
        assert not plain["counts"]


@pytest.mark.parametrize("name", list(WORLD2))
def test_two_ranks_train_alike_with_and_without_stashing(world2, name):
    _check(world2[name], WORLD2[name])


@pytest.mark.parametrize("name", list(WORLD1))
def test_one_rank(world1, name):
    _check(world1[name], WORLD1[name])


def test_scenarios_cover_every_loop_mode_optimizer_and_stash_mode():
    scenarios = list(WORLD2.values()) + list(WORLD1.values())
    assert {s.loop for s in WORLD2.values()} == set(LOOPS)
    assert {s.mode for s in scenarios} == {"hbm_direct", "cache", "default"}
    assert {s.optimizer for s in WORLD2.values()} == set(OPTIMIZERS)
    assert {s.stash for s in WORLD2.values()} == {"all", "values", "optimizer_state"}


def test_prefetch_while_stashed_waits_for_the_rows(world2):
    """In the prefetch pipeline the next batch's prefetch runs while the rows are away: its new
    rows are written when they come back (HBM_DIRECT), or its write-backs and loads bring
    them back first (CACHE)."""
    for res in world2["prefetch_adam"]:
        counts = res["stashed"]["counts"]
        assert all(on_access == 0 and replayed > 0 for _, _, on_access, replayed
                   in counts.values()), counts
    for res in world2["prefetch_cache_adagrad_state"]:
        counts = res["stashed"]["counts"]
        assert sum(on_access for _, _, on_access, _ in counts.values()) > 0, counts
