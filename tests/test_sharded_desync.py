"""Ranks out of step, on 2 spawned CPU ranks (gloo).

One rank's loss raises after the sharded module's forward; the rank catches it and goes on
with its next batch, skipping a backward the other rank runs (tests/sharded_desync_worker.py).
Both sharded modules must then raise ``RankDesyncError`` on every rank, naming the ranks
and their batch numbers, before any table changes, instead of aborting in gloo, training on
garbage or hanging. Both scenarios share one world: after the errors the ranks are back in
step (the next scenario starts with a barrier of the world).
"""
import time

import pytest

from examples.spawn import RankError, run_on_ranks
from tests.sharded_checks import spawn_scenarios
from tests.sharded_desync_worker import DesyncScenario, run_desync

SCENARIOS = {
    "sequence_rank0_skips": DesyncScenario(module="sequence", fail_rank=0, fail_step=2),
    "bag_rank1_skips": DesyncScenario(module="bag", fail_rank=1, fail_step=1),
}


@pytest.fixture(scope="module")
def world2():
    return spawn_scenarios(2, run_desync, SCENARIOS)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_rank_raises_when_one_skipped_a_backward(world2, name):
    s = SCENARIOS[name]
    module = {"sequence": "ShardedDynamicEmbCollection 'dyn'",
              "bag": "ShardedDynamicEmbBagCollection 'bags'"}[s.module]
    skipper, other = s.fail_rank, 1 - s.fail_rank
    ranks = world2[name]
    assert ranks[skipper]["loss_errors"] == 1 and ranks[other]["loss_errors"] == 0
    # the skipper's next input dist (batch fail_step + 1) meets the other's backward of
    # batch fail_step: both raise there
    kind, message, phase = ranks[skipper]["error"]
    assert (kind, phase, ranks[skipper]["step"]) == ("RankDesyncError", "forward",
                                                     s.fail_step + 1)
    assert module in message
    assert (f"rank {skipper} runs the input dist of batch {s.fail_step + 1} but rank {other} "
            f"runs the backward of batch {s.fail_step}") in message
    kind, message, phase = ranks[other]["error"]
    assert (kind, phase, ranks[other]["step"]) == ("RankDesyncError", "backward", s.fail_step)
    assert (f"rank {other} runs the backward of batch {s.fail_step} but rank {skipper} "
            f"runs the input dist of batch {s.fail_step + 1}") in message
    for res in ranks:
        assert res["unchanged"], "the failing call changed the tables"
        assert res["steps_done"] == s.fail_step


def _stalled_peer(rank: int, world_size: int) -> str:
    """Rank 0 stalls (longer than the collective timeout); rank 1 waits for it in a
    collective."""
    import torch
    import torch.distributed as dist
    if rank == 0:
        time.sleep(60)
        return "late"
    dist.all_reduce(torch.ones(1))
    return "joined"


def test_a_stalled_peer_fails_the_collective_after_its_timeout():
    # rank 1's collective gives up after the 3 s it was given (gloo names the wait), not
    # after torch's default 30 minutes nor when the run's own timeout kills the ranks
    with pytest.raises(RankError) as err:
        run_on_ranks(2, _stalled_peer, timeout=300, collective_timeout=3)
    report = str(err.value)
    rank1 = report[report.index("rank 1:"):]
    assert "Timed out waiting 3000ms" in rank1, report
