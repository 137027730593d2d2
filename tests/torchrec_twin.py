"""TorchRec's own ``EmbeddingCollection``, sharded on one CPU process with fbgemm's fused
optimizer: the reference that dynamic tables are trained against in twin tests."""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist


def ensure_single_process_group() -> dist.ProcessGroup:
    """A world of one rank (created once per test process): gloo, and NCCL for CUDA tensors
    where there is a GPU."""
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.GroupMember.WORLD


class _Wrapper(torch.nn.Module):
    def __init__(self, collection: torch.nn.Module):
        super().__init__()
        self.ec = collection

    def forward(self, kjt):
        return self.ec(kjt)


class TorchRecTwin:
    """``EmbeddingCollection`` (or, with ``pooled``, ``EmbeddingBagCollection``, weighted
    when ``is_weighted``) row-wise sharded on one rank (fbgemm CPU TBE, fused optimizer).
    ``initial`` gives every table's starting weights [num_embeddings, dim]."""

    def __init__(self, tables, initial: Dict[str, torch.Tensor], fused_params: dict, *,
                 pooled: bool = False, is_weighted: bool = False):
        from torchrec import EmbeddingBagCollection, EmbeddingCollection
        from torchrec.distributed import DistributedModelParallel
        from torchrec.distributed.embedding import EmbeddingCollectionSharder
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
        from torchrec.distributed.types import ShardingEnv, ShardingPlan

        pg = ensure_single_process_group()
        meta = torch.device("meta")
        if pooled:
            model = _Wrapper(EmbeddingBagCollection(tables=tables, is_weighted=is_weighted,
                                                    device=meta))
            sharder = EmbeddingBagCollectionSharder(fused_params=fused_params)
        else:
            model = _Wrapper(EmbeddingCollection(tables=tables, device=meta))
            sharder = EmbeddingCollectionSharder(fused_params=fused_params)
        plan = ShardingPlan({"ec": construct_module_sharding_plan(
            model.ec, {t.name: row_wise(compute_kernel="fused") for t in tables},
            sharder=sharder, local_size=1, world_size=1, device_type="cpu")})
        self.dmp = DistributedModelParallel(module=model, device=torch.device("cpu"), plan=plan,
                                            env=ShardingEnv.from_process_group(pg),
                                            sharders=[sharder])
        for name, tensor in self._shards().items():
            tensor.detach().copy_(initial[name])

    def _shards(self) -> Dict[str, torch.Tensor]:
        out = {}
        for key, value in self.dmp.state_dict().items():
            name = key.split(".")[-2]
            out[name] = value.local_shards()[0].tensor
        return out

    def __call__(self, kjt):
        return self.dmp(kjt)

    def weights(self) -> Dict[str, torch.Tensor]:
        return {name: t.detach().clone() for name, t in self._shards().items()}

    def set_learning_rate(self, lr: float) -> None:
        for group in self.dmp.fused_optimizer.param_groups:
            group["lr"] = lr
        self.dmp.fused_optimizer.zero_grad()  # where TorchRec hands the new lr to fbgemm


def same_batches(num_steps: int, features: List[str], num_ids: int, batch: int, seed: int,
                 max_len: int = 4):
    """Lists of (lengths, values) per feature; some lengths are zero."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(num_steps):
        lengths = torch.randint(0, max_len + 1, (len(features) * batch,), generator=g)
        values = torch.randint(0, num_ids, (int(lengths.sum()),), generator=g)
        steps.append((lengths, values))
    return steps
