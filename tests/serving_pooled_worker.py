"""What each rank runs in the sharded pooled export test (tests/test_serving_pooled_sharded.py):
the sharded DynamicEmbBagCollection of tests/sharded_bag_twin.py, trained a few steps on this
rank's batches, then its eval output on a probe batch of this rank and its share exported by
``to_static`` (saved to ``path``/``<scenario>_rank<r>.pt`` for the test to merge)."""
from __future__ import annotations

from typing import Any, Dict, List

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.sharded_bag_twin import (FEATURES, NUM_IDS, POOLINGS, BagModel, BagScenario,
                                    make_batches, optimizer_configs, shard, to_kjt)
from tests.sharded_twin import Batch, Trainer

#: ids never trained (the workload draws from [0, NUM_IDS))
UNSEEN = torch.tensor([10**9 + 7, -3, 2**62 + 1])


def probe_kjt(rank: int, weighted: bool) -> KeyedJaggedTensor:
    """Per feature: one bag per id of [0, NUM_IDS) and the unseen ids, then bags of 3 ids
    mixing both, then an empty bag; weights in [0.5, 1.5) when ``weighted``. Ranks differ."""
    gen = torch.Generator().manual_seed(100 + rank)
    every = torch.cat([torch.arange(NUM_IDS), UNSEEN])
    ids, lengths = [], []
    for _ in FEATURES:
        mixed = every[torch.randint(0, every.numel(), (3 * (20 + rank),), generator=gen)]
        ids.append(torch.cat([every[torch.randperm(every.numel(), generator=gen)], mixed]))
        lengths.append(torch.cat([torch.ones(every.numel(), dtype=torch.long),
                                  torch.full((20 + rank,), 3), torch.zeros(1, dtype=torch.long)]))
    values = torch.cat(ids)
    weights = (torch.rand(values.numel(), generator=gen) + 0.5) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(FEATURES, values, torch.cat(lengths),
                                               weights=weights)


def export_share(rank: int, world_size: int, name: str, s: BagScenario,
                 path: str) -> Dict[str, Any]:
    from dynemb.serving import to_static
    torch.manual_seed(0)
    opt_config, _ = optimizer_configs(s.optimizer)
    weighted = POOLINGS[s.pooling][2]
    local = [Batch(to_kjt([per_rank[rank]], weighted)) for per_rank in make_batches(s, world_size)]
    dmp = shard(BagModel(s, opt_config), world_size)
    trainer = Trainer(dmp, local, s.loop)
    for _ in range(s.steps):
        trainer.step()
    sharded = dmp.module.bags
    probe = probe_kjt(rank, weighted)
    dmp.eval()
    with torch.no_grad():
        out = sharded(probe)
        values, keys = out.values().clone(), list(out.keys())
    export = to_static(sharded)
    torch.save(export, f"{path}/{name}_rank{rank}.pt")
    ids = torch.arange(NUM_IDS)
    held = {}
    for table in ("t0", "t1"):
        _, found = sharded.read_rows(table, ids)
        held[table] = ids[found].numpy()
    return {"probe": probe, "values": values.numpy(), "keys": keys, "held": held,
            "type": type(sharded).__name__}


def export_shares(rank: int, world_size: int, scenarios: Dict[str, BagScenario],
                  path: str) -> List[Dict[str, Any]]:
    """Every scenario in one spawned world (process start-up dominates small runs)."""
    return [export_share(rank, world_size, name, s, path) for name, s in scenarios.items()]
