"""Expiry of a row-wise sharded module, run on every rank of a spawned gloo world (see
tests/test_expiry.py): each rank trains the twin model for a few steps (plain loop, every
backward run), then expires its share, rank 0 twice as often as the others (no collective:
a rank that expires alone must not wait for the rest). Reports what each rank erased and
which keys it still holds."""
from __future__ import annotations

from typing import Any, Dict


def run(rank: int, world_size: int) -> Dict[str, Any]:
    import torch

    from tests import sharded_twin as twin
    scenario = twin.Scenario(steps=6, torchrec_twin=False, lonely_step=None)
    opt_config, _ = twin.optimizer_configs("sgd")
    dmp = twin.shard_dyn(twin.DynModel(scenario, opt_config), world_size)
    batches = twin.make_batches(scenario, world_size)
    for per_rank in batches:
        loss, _ = dmp(twin.Batch(twin.to_kjt([per_rank[rank]])))
        loss.backward()
    dyn = dmp.module.dyn
    erased = [dyn.expire(older_than=3)]
    if rank == 0:  # alone: returns without the other ranks
        erased.append(dyn.expire(["t1"], where=lambda keys, scores: keys % 2 == 0))
    keys = torch.arange(twin.NUM_IDS)
    held = {name: keys[dyn.read_rows(name, keys)[1]].tolist() for name in ("t0", "t1")}
    return {"erased": erased, "held": held, "stats": dyn.stats()}
