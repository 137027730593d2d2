"""A model holding a DynamicEmbCollection and a DynamicEmbBagCollection, sharded by
DistributedModelParallel twice on the current process group: once without a plan (TorchRec's
default planner) and once with a hand-written row-wise plan; both train on the same batches.
Used in-process on one rank and on spawned ranks (tests/test_dmp_default_plan.py)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagConfig, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

NUM_IDS = 300
STEPS = 4
PROBE = torch.arange(NUM_IDS)


class SeqAndBagModel(torch.nn.Module):
    """``ec`` (sequence table ``t``, feature ``a``) and ``ebc`` (bag table ``u``, feature
    ``b``); the loss pulls every embedding towards 0.1."""

    def __init__(self, optimizer=None):
        super().__init__()
        from dynemb import (DynamicEmbBagCollection, DynamicEmbCollection,
                            DynamicEmbTableOptions, ScorePolicy)
        options = DynamicEmbTableOptions(score_strategy=ScorePolicy.LRU)
        self.ec = DynamicEmbCollection(
            [EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=NUM_IDS,
                             feature_names=["a"])],
            device="meta", table_options=options, optimizer=optimizer)
        self.ebc = DynamicEmbBagCollection(
            [EmbeddingBagConfig(name="u", embedding_dim=8, num_embeddings=NUM_IDS,
                                feature_names=["b"])],
            device="meta", table_options=options, optimizer=optimizer)

    def forward(self, kjt: KeyedJaggedTensor):
        seq = self.ec(kjt)["a"].values()
        bags = self.ebc(kjt).values()
        loss = ((seq - 0.1) ** 2).sum() + ((bags - 0.1) ** 2).sum()
        return loss, (loss.detach(), seq.detach(), bags.detach())


def batches(rank: int, steps: int = STEPS, batch: int = 4) -> List[KeyedJaggedTensor]:
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 4, (2 * batch,), generator=g)
        values = torch.randint(0, NUM_IDS, (int(lengths.sum()),), generator=g)
        out.append(KeyedJaggedTensor.from_lengths_sync(["a", "b"], values, lengths))
    return out


def sharders(fused_params: Optional[Dict[str, Any]] = None):
    from dynemb.sharding import DynamicEmbBagCollectionSharder, DynamicEmbCollectionSharder
    kwargs = {"fused_params": fused_params} if fused_params else {}
    return [DynamicEmbCollectionSharder(**kwargs), DynamicEmbBagCollectionSharder(**kwargs)]


def hand_plan(model: SeqAndBagModel, world_size: int):
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan
    ec_sharder, ebc_sharder = sharders()
    plans = {}
    for name, module, sharder in (("ec", model.ec, ec_sharder), ("ebc", model.ebc, ebc_sharder)):
        plans[name] = construct_module_sharding_plan(
            module, {c.name: row_wise(compute_kernel="customized_kernel")
                     for c in module.table_configs()},
            sharder=sharder, local_size=world_size, world_size=world_size, device_type="cpu")
    return ShardingPlan(plans)


def shard(model: SeqAndBagModel, plan=None, fused_params=None):
    """``model`` under DMP on the world group: ``plan`` None lets DMP plan it."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    return DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
        device=torch.device("cpu"), plan=plan, sharders=sharders(fused_params))


def train(dmp, kjts: List[KeyedJaggedTensor]) -> Dict[str, Any]:
    """Plain loop: per step the loss and outputs; at the end this rank's rows of the probe
    ids (zero where another rank owns them)."""
    steps = []
    for kjt in kjts:
        loss, (value, seq, bags) = dmp(kjt)
        loss.backward()
        steps.append((value, seq, bags))
    rows = {}
    for name, table in (("ec", "t"), ("ebc", "u")):
        found_rows, found = getattr(dmp.module, name).read_rows(table, PROBE)
        rows[table] = torch.where(found[:, None], found_rows, torch.zeros_like(found_rows))
    return {"steps": steps, "rows": rows}


def run(rank: int, world_size: int, optimizer=None) -> Dict[str, Any]:
    """Both paths on this rank: ``{"planned": ..., "default": ..., "plan": str}``."""
    from dynemb import OptimizerConfig, OptimizerType
    optimizer = optimizer or OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD, learning_rate=0.1)
    kjts = batches(rank)
    planned_model = SeqAndBagModel(optimizer)
    planned = train(shard(planned_model, hand_plan(planned_model, world_size)), kjts)
    default_dmp = shard(SeqAndBagModel(optimizer))
    default = train(default_dmp, kjts)
    return {"planned": planned, "default": default, "plan": str(default_dmp.plan)}
