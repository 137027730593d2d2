"""Worker of tests/test_warm_start_sharded.py: on each spawned rank, TorchRec's row-wise
sharded ``EmbeddingCollection`` (fbgemm's fused row-wise AdaGrad) trains a few steps; a
sharded ``DynamicEmbCollection`` is warm-started from it (every rank writes its shard's rows
and momentum, routed to their dynemb owners); then both look up and train on the same
batches. Returns both models' outputs at every step."""
from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

FEATURES = ["f0", "f1"]
NUM_IDS = 60
TABLES = [EmbeddingConfig(name=f"t{i}", embedding_dim=4, num_embeddings=NUM_IDS,
                          feature_names=[f]) for i, f in enumerate(FEATURES)]


class _Wrap(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.ec = module

    def forward(self, kjt):
        return self.ec(kjt)


def _batch(rank: int, step: int) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 4, (len(FEATURES) * 5,), generator=gen)
    return KeyedJaggedTensor.from_lengths_sync(
        FEATURES, torch.randint(0, NUM_IDS, (int(lengths.sum()),), generator=gen), lengths)


def _loss(out) -> torch.Tensor:
    return sum(((jt.values() - 0.2) ** 2).sum() for jt in out.values())


def run_warm_start(rank: int, world_size: int, scenarios: List[Any]) -> List[Dict[str, Any]]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig,
                        OptimizerType, warm_start)
    from dynemb.sharding import DynamicEmbCollectionSharder
    env = ShardingEnv.from_process_group(dist.GroupMember.WORLD)
    sharder = EmbeddingCollectionSharder(fused_params=dict(
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1, eps=1e-8))
    torchrec_model = _Wrap(EmbeddingCollection(tables=TABLES, device=torch.device("meta")))
    plan = ShardingPlan({"ec": construct_module_sharding_plan(
        torchrec_model.ec, {t.name: row_wise(compute_kernel="fused") for t in TABLES},
        sharder=sharder, local_size=world_size, world_size=world_size, device_type="cpu")})
    torchrec_dmp = DistributedModelParallel(torchrec_model, env=env, device=torch.device("cpu"),
                                            plan=plan, sharders=[sharder])
    gen = torch.Generator().manual_seed(7)  # the same rows on every rank
    initial = {t.name: torch.rand(NUM_IDS, 4, generator=gen) - 0.5 for t in TABLES}
    for key, value in torchrec_dmp.state_dict().items():
        shard = value.local_shards()[0]
        first = shard.metadata.shard_offsets[0]
        shard.tensor.detach().copy_(initial[key.split(".")[-2]][first:first +
                                                                 shard.tensor.shape[0]])
    for step in range(3):  # TorchRec trains first
        _loss(torchrec_dmp(_batch(rank, step))).backward()

    optimizer = OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD, learning_rate=0.1, eps=1e-8)
    dyn_model = _Wrap(DynamicEmbCollection(
        TABLES, device=torch.device("meta"), optimizer=optimizer,
        table_options=DynamicEmbTableOptions(bucket_size=16)))
    dyn_dmp = DistributedModelParallel(dyn_model, env=env, device=torch.device("cpu"),
                                       sharders=[DynamicEmbCollectionSharder()])
    written = warm_start(dyn_dmp, torchrec_dmp)  # rows and momentum (collective)
    outputs: Dict[str, List[Any]] = {"torchrec": [], "dynemb": []}
    for step in range(3, 7):  # then both, on the same batches
        kjt = _batch(rank, step)
        for name, dmp in (("torchrec", torchrec_dmp), ("dynemb", dyn_dmp)):
            out = dmp(kjt)
            outputs[name].append([out[f].values().detach().clone() for f in FEATURES])
            _loss(out).backward()
    stats = dyn_dmp.module.ec.stats()
    return [{"written": written, "outputs": outputs,
             "rows_held": {name: s["rows_device"] for name, s in stats.items()}}]
