"""Training scenarios run on every rank of a spawned gloo world (see examples/spawn.py).

Each scenario trains three models on the same batches and returns what each saw:

- the sharded ``DynamicEmbCollection`` (``DistributedModelParallel`` + our sharder), on this
  rank's batch, under a plain loop, ``TrainPipelineSparseDist`` or
  ``PrefetchTrainPipelineSparseDist``;
- the unsharded ``DynamicEmbCollection`` trained on the global batch (every rank's batch
  concatenated) with the loss divided by the world size, as TorchRec's gradient division does;
- optionally TorchRec's row-wise sharded ``EmbeddingCollection`` (fbgemm fused SGD) started
  from the same initial rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from tests.twin_training import (draw_batches, initial_rows, plan_summary, record_rows,
                                  train_side_by_side)

FEATURES = ["f0", "f1", "f2"]
TABLE_OF = {"f0": "t0", "f1": "t0", "f2": "t1"}
NUM_IDS = 400


@dataclass
class Scenario:
    optimizer: str = "sgd"          # sgd | adam | rowwise_adagrad
    loop: str = "plain"             # plain | pipeline | prefetch
    mode: str = "hbm_direct"        # hbm_direct | cache | host_only
    dims: tuple = (8, 8)
    steps: int = 12
    batch: int = 6
    uneven: bool = True             # rank r has batch + r samples
    sharding: str = "hash"          # hash | mod
    admission: Optional[int] = None  # admission threshold
    cache_rows: int = 64            # per rank, CACHE mode
    torchrec_twin: bool = True
    lonely_step: Optional[int] = 3  # at this step every t1 id is owned by rank 0
    eval_every: int = 0             # run an eval forward after every n-th step
    eval_pipeline: bool = False     # after training, evaluate under EvalPipelineSparseDist
    with_ec_and_dense: bool = False
    seed: int = 11


@dataclass
class Batch(Pipelineable):
    features: KeyedJaggedTensor
    dense: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 4))

    def to(self, device, non_blocking=False):
        return Batch(self.features.to(device=device, non_blocking=non_blocking),
                     self.dense.to(device=device, non_blocking=non_blocking))

    def record_stream(self, stream):
        self.features.record_stream(stream)
        self.dense.record_stream(stream)

    def pin_memory(self):
        return Batch(self.features.pin_memory(), self.dense.pin_memory())


def tables(dims) -> List[EmbeddingConfig]:
    return [EmbeddingConfig(name="t0", embedding_dim=dims[0], num_embeddings=NUM_IDS,
                            feature_names=["f0", "f1"]),
            EmbeddingConfig(name="t1", embedding_dim=dims[1], num_embeddings=NUM_IDS,
                            feature_names=["f2"])]


def optimizer_configs(name: str):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from dynemb import OptimizerConfig, OptimizerType
    if name == "sgd":
        return (OptimizerConfig(OptimizerType.SGD, learning_rate=0.05),
                {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.05})
    if name == "rowwise_adagrad":
        return (OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD, learning_rate=0.05, eps=1e-6),
                {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05,
                 "eps": 1e-6})
    if name == "adam":
        return OptimizerConfig(OptimizerType.ADAM, learning_rate=0.01, eps=1e-8), None
    raise ValueError(name)


def table_options(s: Scenario, opt_config, cache_scale: int = 1):
    """Per-rank CACHE budget of ``s.cache_rows`` rows (times ``cache_scale``: the unsharded
    reference sees every rank's batch at once)."""
    from dynemb import (DynamicEmbTableOptions, FrequencyAdmission, Initializer,
                        InitializerKind)
    from dynemb.options import ShardingScheme
    out = {}
    for t in tables(s.dims):
        width = t.embedding_dim + opt_config.state_dim(t.embedding_dim)
        budget = s.cache_rows * cache_scale * width * 4 if s.mode == "cache" else None
        out[t.name] = DynamicEmbTableOptions(
            caching=s.mode == "cache", max_capacity=2048,
            local_hbm_for_values=0 if s.mode == "host_only" else budget,
            bucket_size=16, initializer=Initializer(InitializerKind.UNIFORM, low=-0.1, high=0.1),
            seed=3, sharding=ShardingScheme(s.sharding),
            # t1's refused ids read zeros, t0's the table's initializer rows
            admission=(FrequencyAdmission(
                threshold=s.admission, counter_capacity=4096,
                initializer=(Initializer(InitializerKind.CONSTANT, value=0.0)
                             if t.name == "t1" else None))
                if s.admission else None))
    return out


def make_batches(s: Scenario, world_size: int):
    """``[step][rank] -> {feature: (lengths, values)}``."""
    from tests.key_reference import owner

    def draw_ids(step, f, n, g):
        values = torch.randint(0, NUM_IDS, (n,), generator=g)
        if step == s.lonely_step and TABLE_OF[f] == "t1":
            pool = torch.tensor([k for k in range(NUM_IDS)
                                 if owner(k, world_size, s.sharding) == 0])
            values = pool[torch.randint(0, pool.numel(), (values.numel(),), generator=g)]
        return (values,)
    return draw_batches(s, world_size, FEATURES, draw_ids)


def to_kjt(parts: List[Dict[str, Any]]) -> KeyedJaggedTensor:
    """One KJT from several ranks' batches (the global batch), or from one."""
    lengths = torch.cat([torch.cat([p[f][0] for p in parts]) for f in FEATURES])
    values = torch.cat([torch.cat([p[f][1] for p in parts]) for f in FEATURES])
    return KeyedJaggedTensor.from_lengths_sync(FEATURES, values, lengths)


def targets(dims) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f: torch.randn(dims[0 if TABLE_OF[f] == "t0" else 1], generator=g)
            for f in FEATURES}


def embedding_loss(out, tgt) -> torch.Tensor:
    """Per feature ``0.5 * |e - target|^2 + sum(e)`` over its embeddings ``e``."""
    total = 0.0
    for f in FEATURES:
        e = out[f] if isinstance(out[f], torch.Tensor) else out[f].values()
        total = total + ((e - tgt[f]) ** 2).sum() * 0.5 + e.sum()
    return total


class DynModel(torch.nn.Module):
    def __init__(self, s: Scenario, opt_config):
        super().__init__()
        from torchrec import EmbeddingCollection

        from dynemb import DynamicEmbCollection
        self.dyn = DynamicEmbCollection(tables(s.dims), device="meta",
                                        table_options=table_options(s, opt_config),
                                        optimizer=opt_config)
        self.with_extra = s.with_ec_and_dense
        if self.with_extra:  # an ordinary EC table and a dense layer in the same model
            self.ec = EmbeddingCollection(
                tables=[EmbeddingConfig(name="static", embedding_dim=8, num_embeddings=NUM_IDS,
                                        feature_names=["f0"])], device=torch.device("meta"))
            self.dense = torch.nn.Linear(4, 1)
        self.tgt = targets(s.dims)

    def forward(self, batch: Batch):
        out = self.dyn(batch.features)
        loss = embedding_loss(out, self.tgt)
        if self.with_extra:
            loss = loss + self.ec(batch.features)["f0"].values().pow(2).sum() * 0.01
            loss = loss + self.dense(batch.dense).pow(2).sum()
        return loss, (loss.detach(), {f: out[f].values().detach() for f in FEATURES})


class ECModel(torch.nn.Module):
    def __init__(self, s: Scenario):
        super().__init__()
        from torchrec import EmbeddingCollection
        self.ec = EmbeddingCollection(tables=tables(s.dims), device=torch.device("meta"))
        self.tgt = targets(s.dims)

    def forward(self, batch: Batch):
        out = self.ec(batch.features)
        loss = embedding_loss(out, self.tgt)
        return loss, (loss.detach(), {f: out[f].values().detach() for f in FEATURES})


def shard_dyn(model: DynModel, world_size: int):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from dynemb.sharding import DynamicEmbCollectionSharder
    sharders = [DynamicEmbCollectionSharder()]
    if model.with_extra:  # TorchRec's planner places both modules' tables
        from torchrec.distributed.planner import ParameterConstraints, Topology

        from dynemb.planning import dynemb_constraints, make_planner
        sharders.append(EmbeddingCollectionSharder(fused_params={"learning_rate": 0.05}))
        constraints = dynemb_constraints(model, {"static": ParameterConstraints(
            sharding_types=["row_wise"], compute_kernels=["fused"])})
        planner = make_planner(Topology(world_size=world_size, local_world_size=world_size,
                                        compute_device="cpu"), constraints, batch_size=8)
        plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD).plan
    else:
        plan = {"dyn": construct_module_sharding_plan(
            model.dyn, {t.name: row_wise(compute_kernel="customized_kernel")
                        for t in model.dyn.embedding_configs()},
            sharder=sharders[0], local_size=world_size, world_size=world_size,
            device_type="cpu")}
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(
        dist.GroupMember.WORLD), device=torch.device("cpu"), plan=ShardingPlan(plan),
        sharders=sharders)


def shard_ec(model: ECModel, world_size: int, fused_params, initial: Dict[str, torch.Tensor]):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    sharder = EmbeddingCollectionSharder(fused_params=fused_params)
    plan = ShardingPlan({"ec": construct_module_sharding_plan(
        model.ec, {t.name: row_wise(compute_kernel="fused") for t in model.ec.embedding_configs()},
        sharder=sharder, local_size=world_size, world_size=world_size, device_type="cpu")})
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(
        dist.GroupMember.WORLD), device=torch.device("cpu"), plan=plan, sharders=[sharder])
    for name, offset, tensor in ec_shards(dmp):
        tensor.detach().copy_(initial[name][offset:offset + tensor.shape[0]])
    return dmp


def ec_shards(dmp):
    for key, value in dmp.state_dict().items():
        if not key.endswith(".weight"):
            continue
        shard = value.local_shards()[0]
        yield key.split(".")[-2], shard.metadata.shard_offsets[0], shard.tensor


def dense_optimizer(dmp):
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    if not params:
        return CombinedOptimizer([dmp.fused_optimizer])
    dense = KeyedOptimizerWrapper(params, lambda ps: torch.optim.SGD(ps, lr=0.01))
    return CombinedOptimizer([dmp.fused_optimizer, dense])


class Trainer:
    """Steps one model over its batches under the scenario's loop."""

    def __init__(self, dmp, batches: List[Batch], loop: str):
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        from dynemb.pipelines import PrefetchTrainPipelineSparseDist
        self.dmp, self.optimizer = dmp, dense_optimizer(dmp)
        self.batches = batches
        self.it = iter(batches)
        cls = {"pipeline": TrainPipelineSparseDist,
               "prefetch": PrefetchTrainPipelineSparseDist}.get(loop)
        self.pipeline = cls(dmp, self.optimizer, torch.device("cpu")) if cls else None
        self.index = 0

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self):
        if self.pipeline is not None:
            return self.pipeline.progress(self.it)
        batch = self.batches[self.index]
        self.index += 1
        self.optimizer.zero_grad()
        loss, out = self.dmp(batch)
        loss.backward()
        self.optimizer.step()
        return out


def run_scenario(rank: int, world_size: int, s: Scenario) -> Dict[str, Any]:
    from dynemb import DynamicEmbCollection
    torch.manual_seed(0)
    opt_config, fused_params = optimizer_configs(s.optimizer)
    batches = make_batches(s, world_size)
    local_batches = [Batch(to_kjt([per_rank[rank]])) for per_rank in batches]
    dmp = shard_dyn(DynModel(s, opt_config), world_size)
    trainer = Trainer(dmp, local_batches, s.loop)

    ref = DynamicEmbCollection(tables(s.dims),
                               table_options=table_options(s, opt_config, world_size),
                               optimizer=opt_config)
    ref_tgt = targets(s.dims)
    ec_trainer = None
    if s.torchrec_twin:
        initial = initial_rows(ref, NUM_IDS)
        ec_trainer = Trainer(shard_ec(ECModel(s), world_size, fused_params, initial),
                             local_batches, s.loop)

    def reference_step(step):
        ref_out = ref(to_kjt(batches[step]))
        counts = [{f: int(per_rank[f][1].numel()) for f in FEATURES}
                  for per_rank in batches[step]]
        mine = {}
        for f in FEATURES:
            start = sum(c[f] for c in counts[:rank])
            mine[f] = ref_out[f].values()[start:start + counts[rank][f]]
        (embedding_loss(ref_out, ref_tgt) / world_size).backward()
        return embedding_loss(mine, ref_tgt), mine

    def eval_every_few_steps(step):
        if s.eval_every and step % s.eval_every == 0:
            result["eval"].append(eval_probe(dmp))

    result: Dict[str, Any] = {"plan": plan_summary(dmp), "eval": []}
    train_side_by_side(result, s.steps, opt_config.learning_rate, trainer, ref, reference_step,
                       twin=ec_trainer, twin_key="ec", after_step=eval_every_few_steps)

    if s.eval_pipeline:
        result["eval_pipeline"] = run_eval_pipeline(rank, world_size, s, dmp, trainer, ref)

    seen = sorted({int(v) for per_step in batches for per_rank in per_step
                   for f in FEATURES for v in per_rank[f][1] if TABLE_OF[f] == "t1"})
    record_rows(result, dmp.module.dyn, ref, NUM_IDS)
    result["t1_seen"] = np.array(seen)
    if ec_trainer:
        result["ec_rows"] = {name: (offset, tensor.detach().numpy().copy())
                             for name, offset, tensor in ec_shards(ec_trainer.dmp)}
    return result


def eval_probe(dmp) -> Dict[str, Any]:
    """An eval forward (plain ``model.eval()``) on new ids: nothing is inserted or updated."""
    before = dmp.module.dyn.stats()
    dmp.eval()
    fresh = KeyedJaggedTensor.from_lengths_sync(
        FEATURES, torch.arange(10**9, 10**9 + 6), torch.tensor([2, 2, 2]))
    with torch.no_grad():
        _, (_, out) = dmp(Batch(fresh))
    dmp.train()
    after = dmp.module.dyn.stats()
    return {"inserts_before": {n: s["inserts"] for n, s in before.items()},
            "inserts_after": {n: s["inserts"] for n, s in after.items()},
            "out": {f: v.numpy().copy() for f, v in out.items()}}


def run_scenarios(rank: int, world_size: int, scenarios: List[Scenario]) -> List[Dict[str, Any]]:
    """Several scenarios in one spawned world (process start-up dominates small runs).
    Also counts the calls of the sharded module's ``prefetch``."""
    from dynemb.sharding import ShardedDynamicEmbCollection
    calls = {"n": 0}
    original = ShardedDynamicEmbCollection.prefetch

    def counting(self, *args, **kwargs):
        calls["n"] += 1
        return original(self, *args, **kwargs)

    ShardedDynamicEmbCollection.prefetch = counting
    out = []
    for s in scenarios:
        calls["n"] = 0
        result = run_scenario(rank, world_size, s)
        result["prefetch_calls"] = calls["n"]
        out.append(result)
    return out


def run_eval_pipeline(rank, world_size, s: Scenario, dmp, trainer, ref) -> Dict[str, Any]:
    """Eval batches (half the ids seen in training, half new) under TorchRec's
    EvalPipelineSparseDist: outputs against the unsharded module in eval mode, and the
    tables before and after."""
    from torchrec.distributed.train_pipeline import EvalPipelineSparseDist
    sharded = dmp.module.dyn
    ids = torch.arange(NUM_IDS)
    before = {n: sharded.read_rows(n, ids) for n in ("t0", "t1")}
    inserts = {n: v["inserts"] for n, v in sharded.stats().items()}
    g = torch.Generator().manual_seed(99)
    batches = []
    for _ in range(3):
        per_rank = []
        for r in range(world_size):
            d = {}
            for f in FEATURES:
                lengths = torch.randint(1, 4, (s.batch,), generator=g)
                values = torch.randint(0, 2 * NUM_IDS, (int(lengths.sum()),), generator=g)
                d[f] = (lengths, values)
            per_rank.append(d)
        batches.append(per_rank)
    dmp.eval()
    ref.eval()
    pipeline = EvalPipelineSparseDist(dmp, trainer.optimizer, torch.device("cpu"))
    it = iter([Batch(to_kjt([per_rank[rank]])) for per_rank in batches])
    outputs, expected = [], []
    with torch.no_grad():
        for per_rank in batches:
            _, out = pipeline.progress(it)
            outputs.append({f: v.numpy().copy() for f, v in out.items()})
            ref_out = ref(to_kjt(per_rank))
            mine = {}
            for f in FEATURES:
                counts = [p[f][1].numel() for p in per_rank]
                start = sum(counts[:rank])
                mine[f] = ref_out[f].values()[start:start + counts[rank]].numpy().copy()
            expected.append(mine)
    after = {n: sharded.read_rows(n, ids) for n in ("t0", "t1")}
    return {"outputs": outputs, "expected": expected,
            "inserts_before": inserts,
            "inserts_after": {n: v["inserts"] for n, v in sharded.stats().items()},
            "rows_unchanged": all(torch.equal(before[n][0], after[n][0]) and
                                  torch.equal(before[n][1], after[n][1]) for n in before)}
