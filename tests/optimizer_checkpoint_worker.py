"""What each rank runs in tests/test_optimizer_checkpoint_sharded.py: the model of
tests/checkpoint_dcp_worker.py (three dynamic tables, a TorchRec table with fbgemm's fused
row-wise AdaGrad, a dense layer; DMP's ``fused_optimizer`` combined with a dense SGD) trained
under an LR schedule, saved with ``torch.distributed.checkpoint`` together with the
scheduler, and loaded into a freshly built model that trains on."""
from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.checkpoint_dcp_worker import (customized_score, global_batches, local_kjt, optimizer,
                                         shard, table_rows)


def dynamic_fused_optimizer(dmp):
    """The dynamic collection's own optimizer among those DMP's ``fused_optimizer`` holds."""
    return dict(dmp.fused_optimizer.optimizers)["dyn"]


def build(world_size: int, scenario: str):
    """``(dmp, optimizer, scheduler)``. ``dynamic``: StepLR over the dynamic collection's
    fused optimizer, TorchRec's defaults (no param groups saved). ``all``: LambdaLR over the
    whole CombinedOptimizer, which saves its param groups (the TorchRec table's and the dense
    lr are saved only then)."""
    dmp = shard(world_size)
    opt = optimizer(dmp, world_size)
    if scenario == "dynamic":
        scheduler = torch.optim.lr_scheduler.StepLR(dynamic_fused_optimizer(dmp), step_size=2,
                                                    gamma=0.5)
    else:
        opt.save_param_groups(True)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return dmp, opt, scheduler


def train(dmp, opt, scheduler, batches, rank, world_size) -> Dict[str, List[Any]]:
    """Each step's global loss and the lr of every param group its backward used."""
    out: Dict[str, List[Any]] = {"losses": [], "lrs": []}
    fused = dynamic_fused_optimizer(dmp)
    for batch in batches:
        # t4 scores CUSTOMIZED: one score for every step, the same whether or not the run
        # was interrupted (this test is about learning rates)
        dmp.module.dyn.set_scores({"t4": customized_score(0)})
        opt.zero_grad()  # TorchRec's fused tables take the group's lr here
        loss, _ = dmp(local_kjt(batch, rank, world_size))
        out["lrs"].append([group["lr"] for group in opt.param_groups])
        loss.backward()
        opt.step()
        fused.step()  # does nothing: the StepLR of the "dynamic" scenario follows it
        scheduler.step()
        total = loss.detach() / world_size
        dist.all_reduce(total)
        out["losses"].append(float(total))
    return out


def state_of(dmp, opt, scheduler):
    return {"model": dmp.state_dict(), "optim": opt.state_dict(),
            "sched": scheduler.state_dict()}


def save_and_continue(rank, world_size, scenario, path, steps_before, steps_after):
    dmp, opt, scheduler = build(world_size, scenario)
    batches = global_batches(steps_before + steps_after)
    train(dmp, opt, scheduler, batches[:steps_before], rank, world_size)
    dcp.save(state_of(dmp, opt, scheduler), checkpoint_id=path)
    after = train(dmp, opt, scheduler, batches[steps_before:], rank, world_size)
    return {**after, "rows": table_rows(dmp)}


def load_and_continue(rank, world_size, scenario, path, steps_before, steps_after):
    from dynemb.checkpoint import DynamicEmbLoadPlanner
    dmp, opt, scheduler = build(world_size, scenario)
    state = state_of(dmp, opt, scheduler)
    dcp.load(state, checkpoint_id=path, planner=DynamicEmbLoadPlanner())
    dmp.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    scheduler.load_state_dict(state["sched"])
    batches = global_batches(steps_before + steps_after)
    after = train(dmp, opt, scheduler, batches[steps_before:], rank, world_size)
    return {**after, "rows": table_rows(dmp)}


def run(rank, world_size, jobs):
    """Run ``jobs`` (``(function name, args)``) in order."""
    return [globals()[name](rank, world_size, *args) for name, args in jobs]
