"""Worker of tests/test_sharded_groups.py: on each spawned rank, the same model sharded
twice, once with its tables grouped and once table by table (``group_tables=False``),
trained side by side on the same batches; returns each step's outputs and the final local
rows, state and counters of both."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

import numpy as np
import torch
from torchrec import EmbeddingBagConfig, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

FEATURES = ["a", "b", "c", "d"]


@dataclass
class GroupScenario:
    module: str = "sequence"       # sequence | bag
    optimizer: str = "adam"        # sgd | adam | rowwise_adagrad
    cache: bool = False            # CACHE tables: 48 device rows per rank, the rest stored
    steps: int = 10
    batch: int = 8


class _Model(torch.nn.Module):
    def __init__(self, s: GroupScenario, grouped: bool):
        super().__init__()
        from dynemb import (DynamicEmbBagCollection, DynamicEmbCollection,
                            DynamicEmbTableOptions, OptimizerConfig, OptimizerType)
        kind = {"sgd": OptimizerType.SGD, "adam": OptimizerType.ADAM,
                "rowwise_adagrad": OptimizerType.ROWWISE_ADAGRAD}[s.optimizer]
        optimizer = OptimizerConfig(kind, learning_rate=0.05)
        # t0..t2 group (t1 reads two features); t3 (HBM_DIRECT) has another dim: a group of one
        features = [["a"], ["b", "c"], ["d"]]
        rows = 400 if s.cache else 40  # CACHE: more ids than device rows
        options = {f"t{i}": DynamicEmbTableOptions(max_capacity=256, bucket_size=16)
                   for i in range(4)}
        if s.cache:
            width = 8 + optimizer.state_dim(8)
            options.update({f"t{i}": DynamicEmbTableOptions(
                caching=True, bucket_size=16, local_hbm_for_values=64 * width * 4)
                for i in range(3)})
        config, module = ((EmbeddingConfig, DynamicEmbCollection) if s.module == "sequence"
                          else (EmbeddingBagConfig, DynamicEmbBagCollection))
        configs = [config(name=f"t{i}", embedding_dim=8, num_embeddings=rows, feature_names=f)
                   for i, f in enumerate(features)]
        configs.append(config(name="t3", embedding_dim=4, num_embeddings=40,
                              feature_names=["a"]))
        self.dyn = module(configs, device="meta", table_options=options, optimizer=optimizer,
                          group_tables=grouped)

    def forward(self, kjt):
        return self.dyn(kjt)


def _shard(model: torch.nn.Module, world_size: int):
    import torch.distributed as dist
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    from dynemb.sharding import DynamicEmbBagCollectionSharder, DynamicEmbCollectionSharder
    return DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
        device=torch.device("cpu"),
        sharders=[DynamicEmbCollectionSharder(), DynamicEmbBagCollectionSharder()])


def _batch(s: GroupScenario, rank: int, step: int) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(0, 5, (len(FEATURES) * s.batch,), generator=gen)
    ids = torch.randint(0, 400, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor.from_lengths_sync(FEATURES, ids, lengths)


def _values(out) -> List[torch.Tensor]:
    """The output's tensors: a KeyedTensor's values, or each feature's JaggedTensor values
    (the sharded modules answer with lazy awaitables of those)."""
    values = out.values()
    if isinstance(values, torch.Tensor):
        return [values]
    return [out[k].values() for k in sorted(out.keys())]


def run_group_twins(rank: int, world_size: int, scenarios: List[GroupScenario]
                    ) -> List[Dict[str, Any]]:
    results = []
    for s in scenarios:
        torch.manual_seed(0)
        models = {name: _shard(_Model(s, grouped), world_size)
                  for name, grouped in (("grouped", True), ("alone", False))}
        outputs = {name: [] for name in models}
        for step in range(s.steps):
            kjt = _batch(s, rank, step)
            for name, dmp in models.items():
                values = _values(dmp(kjt))
                sum((v * (1 + torch.arange(v.numel()).view_as(v) % 3)).sum()
                    for v in values).backward()
                outputs[name].append([v.detach().numpy().copy() for v in values])
        evals = {name: [] for name in models}  # then eval lookups: one per group, too
        for step in range(s.steps, s.steps + 2):
            kjt = _batch(s, rank, step)
            for name, dmp in models.items():
                dmp.eval()
                with torch.no_grad():
                    evals[name].append([v.numpy().copy() for v in _values(dmp(kjt))])
                dmp.train()
        state = {name: {k: v.detach().clone().numpy() for k, v in dmp.state_dict().items()
                        if isinstance(v, torch.Tensor) and v.numel()}
                 for name, dmp in models.items()}
        local = {name: dmp.module.dyn.local for name, dmp in models.items()}
        results.append({
            "outputs": outputs, "evals": evals, "state": state,
            "stats": {name: m.stats() for name, m in local.items()},
            "groups": {name: m.table_groups() for name, m in local.items()},
            "evictions": int(np.sum([st["evictions"] for st in local["grouped"].stats()
                                     .values()])),
            "write_backs": int(np.sum([st["write_backs"] for st in local["grouped"].stats()
                                       .values()])),
        })
    return results
