"""Ranks that fall out of step, run on every rank of a spawned gloo world (see
tests/test_sharded_desync.py).

One rank's loss raises at one step (after the sharded module's forward, before its
backward); that rank catches the error and goes on with the next batch, so it skips one
backward that the other ranks run. Each rank trains until the sharded module raises, and
reports where and what it raised, and whether that call changed its tables.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist


class LossError(Exception):
    """What the user's loss computation raises on the failing rank."""


@dataclass
class DesyncScenario:
    module: str = "sequence"    # sequence (ShardedDynamicEmbCollection) | bag (pooled)
    loop: str = "plain"         # plain | pipeline (TrainPipelineSparseDist)
    fail_rank: Optional[int] = 0  # None: no rank fails (the check must stay quiet)
    fail_step: int = 2
    steps: int = 6


def _flaky(base):
    """``base`` (a twin model class) whose forward raises :class:`LossError` on its
    ``fail_call``-th call, after the sharded module's forward."""
    class Flaky(base):
        def __init__(self, *args, fail_call: Optional[int] = None):
            super().__init__(*args)
            self.fail_call, self.calls = fail_call, 0

        def forward(self, batch):
            out = super().forward(batch)
            self.calls += 1
            if self.calls - 1 == self.fail_call:
                raise LossError(f"loss of call {self.fail_call} failed")
            return out
    return Flaky


def build(rank: int, world_size: int, s: DesyncScenario):
    """(DMP, the sharded module, local batches, table names) for ``s`` on this rank."""
    fail_call = s.fail_step if s.fail_rank == rank else None
    if s.module == "sequence":
        from tests import sharded_twin as twin
        scenario = twin.Scenario(steps=s.steps, loop=s.loop, torchrec_twin=False)
        opt_config, _ = twin.optimizer_configs("sgd")
        model = _flaky(twin.DynModel)(scenario, opt_config, fail_call=fail_call)
        dmp = twin.shard_dyn(model, world_size)
        batches = [twin.Batch(twin.to_kjt([per_rank[rank]]))
                   for per_rank in twin.make_batches(scenario, world_size)]
        return dmp, dmp.module.dyn, batches
    from tests import sharded_bag_twin as twin
    scenario = twin.BagScenario(steps=s.steps, loop=s.loop)
    opt_config, _ = twin.optimizer_configs("sgd")
    model = _flaky(twin.BagModel)(scenario, opt_config, fail_call=fail_call)
    dmp = twin.shard(model, world_size)
    batches = [twin.Batch(twin.to_kjt([per_rank[rank]], False))
               for per_rank in twin.make_batches(scenario, world_size)]
    return dmp, dmp.module.bags, batches


def snapshot(sharded) -> Dict[str, Any]:
    ids = torch.arange(400)
    return {n: sharded.read_rows(n, ids) for n in ("t0", "t1")}


def same(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    return all(torch.equal(a[n][0], b[n][0]) and torch.equal(a[n][1], b[n][1]) for n in a)


class _Stopped(Exception):
    """The sharded module raised: ``error`` is (type name, message)."""

    def __init__(self, error, unchanged: bool):
        super().__init__(str(error))
        self.error, self.unchanged = error, unchanged


def _guarded(sharded, phase: str, fn):
    """``fn()``; an error other than :class:`LossError` stops training, with whether the
    call changed this rank's tables."""
    before = snapshot(sharded)
    try:
        return fn()
    except LossError:
        raise
    except Exception as err:  # noqa: BLE001 - what the sharded module raised, reported
        raise _Stopped((type(err).__name__, str(err), phase), same(before, snapshot(sharded)))


def train(rank: int, world_size: int, s: DesyncScenario) -> Dict[str, Any]:
    from tests.sharded_twin import Trainer
    dmp, sharded, batches = build(rank, world_size, s)
    trainer = Trainer(dmp, batches, s.loop)
    result: Dict[str, Any] = {"error": None, "unchanged": None, "steps_done": 0,
                              "loss_errors": 0}
    for step in range(s.steps):
        try:
            if trainer.pipeline is not None:
                _guarded(sharded, "step", lambda: trainer.pipeline.progress(trainer.it))
            else:
                trainer.optimizer.zero_grad()
                loss, _ = _guarded(sharded, "forward", lambda: dmp(batches[step]))
                _guarded(sharded, "backward", lambda: loss.backward())
                trainer.optimizer.step()
        except LossError:
            result["loss_errors"] += 1  # the user catches it and goes on
            continue
        except StopIteration:  # the pipeline ran out of batches
            break
        except _Stopped as stop:
            result.update(error=stop.error, unchanged=stop.unchanged, step=step)
            return result
        result["steps_done"] += 1
    return result


def run_desync(rank: int, world_size: int,
               scenarios: List[DesyncScenario]) -> List[Dict[str, Any]]:
    """Each scenario in turn; after one, every rank meets at a barrier (the ranks must be
    back in step for the next)."""
    out = []
    for s in scenarios:
        out.append(train(rank, world_size, s))
        dist.barrier()
    return out
