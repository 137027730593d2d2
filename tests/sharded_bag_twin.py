"""Pooled training scenarios run on every rank of a spawned gloo world (see examples/spawn.py).

Each scenario trains, on the same batches:

- the sharded ``DynamicEmbBagCollection`` (``DistributedModelParallel`` +
  ``DynamicEmbBagCollectionSharder``) on this rank's batch, under a plain loop,
  ``TrainPipelineSparseDist`` or ``PrefetchTrainPipelineSparseDist``;
- the unsharded ``DynamicEmbBagCollection`` on the global batch (every rank's batch
  concatenated) with the loss divided by the world size, as TorchRec's gradient division does;
- optionally TorchRec's row-wise sharded ``EmbeddingBagCollection`` (fbgemm fused optimizer)
  from the same initial rows (needs equal batch sizes: TorchRec's uneven reduce-scatter has
  no gloo backward).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb.types import EMPTY_KEY
from tests.sharded_twin import Batch, Trainer, targets
from tests.twin_training import (draw_batches, initial_rows, plan_summary, record_rows,
                                  train_side_by_side)

FEATURES = ["f0", "f1", "f2"]
NUM_IDS = 400
#: pooling of t0 and t1, and whether the KJT carries per-id weights
POOLINGS = {"sum": (PoolingType.SUM, PoolingType.SUM, False),
            "mean": (PoolingType.MEAN, PoolingType.MEAN, False),
            "mixed": (PoolingType.MEAN, PoolingType.SUM, False),
            "weighted": (PoolingType.SUM, PoolingType.SUM, True)}


@dataclass
class BagScenario:
    optimizer: str = "sgd"          # sgd | adagrad | rowwise_adagrad | adam | sgd_clipped
    loop: str = "plain"             # plain | pipeline | prefetch
    mode: str = "hbm_direct"        # hbm_direct | cache | default
    pooling: str = "mixed"          # see POOLINGS
    dims: tuple = (8, 4)
    steps: int = 10
    batch: int = 6
    uneven: bool = True             # rank r has batch + r samples
    sharding: str = "hash"          # hash | mod
    cache_rows: int = 64            # per rank, CACHE / DEFAULT device rows
    torchrec_twin: bool = False     # needs uneven=False and an fbgemm optimizer
    with_ebc_and_dense: bool = False
    probe_bad_input: bool = False    # after training: bad KJTs must raise and change nothing
    export_state: bool = False       # return this rank's share of the dynamic tables' state
    id_dtypes: tuple = ()           # per rank, the dtype of its KJT's ids and lengths
    seed: int = 5


def bag_tables(s: BagScenario) -> List[EmbeddingBagConfig]:
    p0, p1, _ = POOLINGS[s.pooling]
    return [EmbeddingBagConfig(name="t0", embedding_dim=s.dims[0], num_embeddings=NUM_IDS,
                               feature_names=["f0", "f1"], pooling=p0),
            EmbeddingBagConfig(name="t1", embedding_dim=s.dims[1], num_embeddings=NUM_IDS,
                               feature_names=["f2"], pooling=p1)]


def optimizer_configs(name: str):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from dynemb import OptimizerConfig, OptimizerType
    lr = 0.05
    table = {
        "sgd": (OptimizerConfig(OptimizerType.SGD, learning_rate=lr),
                {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": lr}),
        "sgd_clipped": (OptimizerConfig(OptimizerType.SGD, learning_rate=lr, max_gradient=0.3),
                        {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": lr,
                         "gradient_clipping": True, "max_gradient": 0.3}),
        "adagrad": (OptimizerConfig(OptimizerType.ADAGRAD, learning_rate=lr, eps=1e-6),
                    {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": lr,
                     "eps": 1e-6}),
        "rowwise_adagrad": (
            OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD, learning_rate=lr, eps=1e-6),
            {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": lr,
             "eps": 1e-6}),
        "adam": (OptimizerConfig(OptimizerType.ADAM, learning_rate=0.01, eps=1e-8), None),
    }
    return table[name]


def table_options(s: BagScenario, opt_config, scale: int = 1):
    """Per-rank device budget of ``s.cache_rows`` rows in CACHE and DEFAULT mode (times
    ``scale``: the unsharded reference sees every rank's batch at once)."""
    from dynemb import DynamicEmbTableOptions, Initializer, InitializerKind
    from dynemb.options import ShardingScheme
    out = {}
    for t in bag_tables(s):
        width = t.embedding_dim + opt_config.state_dim(t.embedding_dim)
        budget = (s.cache_rows * scale * width * 4 if s.mode in ("cache", "default")
                  else None)
        out[t.name] = DynamicEmbTableOptions(
            caching=s.mode == "cache", local_hbm_for_values=budget, max_capacity=2048,
            bucket_size=16, initializer=Initializer(InitializerKind.UNIFORM, low=-0.1, high=0.1),
            seed=3, sharding=ShardingScheme(s.sharding))
    return out


def make_batches(s: BagScenario, world_size: int):
    """``[step][rank] -> {feature: (lengths, values, weights)}``; some bags are empty."""
    def draw_ids_and_weights(step, f, n, g):
        return torch.randint(0, NUM_IDS, (n,), generator=g), torch.rand(n, generator=g) + 0.5
    return draw_batches(s, world_size, FEATURES, draw_ids_and_weights)


def to_kjt(parts: List[Dict[str, Any]], weighted: bool,
           dtype: torch.dtype = torch.int64) -> KeyedJaggedTensor:
    """One KJT from several ranks' batches (the global batch), or from one; ids and lengths
    of ``dtype``."""
    def cat(i):
        return torch.cat([torch.cat([p[f][i] for p in parts]) for f in FEATURES])
    return KeyedJaggedTensor.from_lengths_sync(FEATURES, cat(1).to(dtype), cat(0).to(dtype),
                                               weights=cat(2) if weighted else None)


def bag_loss(out, tgt) -> torch.Tensor:
    """Per feature ``0.5 * |bag - target|^2 + sum(bag)`` over the samples' bags."""
    total = 0.0
    for f in FEATURES:
        e = out[f]
        total = total + ((e - tgt[f]) ** 2).sum() * 0.5 + e.sum()
    return total


class BagModel(torch.nn.Module):
    """The dynamic bag collection (or TorchRec's EBC), plus optionally an ordinary EBC table
    and a dense layer."""

    def __init__(self, s: BagScenario, opt_config=None, torchrec_ebc: bool = False):
        super().__init__()
        from torchrec import EmbeddingBagCollection

        from dynemb import DynamicEmbBagCollection
        weighted = POOLINGS[s.pooling][2]
        meta = torch.device("meta")
        if torchrec_ebc:
            self.bags = EmbeddingBagCollection(tables=bag_tables(s), is_weighted=weighted,
                                               device=meta)
        else:
            self.bags = DynamicEmbBagCollection(bag_tables(s), is_weighted=weighted, device=meta,
                                                table_options=table_options(s, opt_config),
                                                optimizer=opt_config)
        self.with_extra = s.with_ebc_and_dense
        if self.with_extra:
            self.static = EmbeddingBagCollection(
                tables=[EmbeddingBagConfig(name="static", embedding_dim=8,
                                           num_embeddings=NUM_IDS, feature_names=["f0"])],
                is_weighted=weighted, device=meta)
            self.dense = torch.nn.Linear(4, 1)
        self.tgt = targets(s.dims)

    def forward(self, batch: Batch):
        out = self.bags(batch.features)
        loss = bag_loss(out, self.tgt)
        if self.with_extra:
            loss = loss + self.static(batch.features)["f0"].pow(2).sum() * 0.01
            loss = loss + self.dense(batch.dense).pow(2).sum()
        return loss, (loss.detach(), {f: out[f].detach() for f in FEATURES})


def shard(model: BagModel, world_size: int, fused_params=None):
    """DistributedModelParallel over the world: row-wise plans built by hand, or (with the
    extra EBC) by TorchRec's planner with dynemb's estimators."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import ParameterConstraints, Topology
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from dynemb.planning import dynemb_constraints, make_planner
    from dynemb.sharding import DynamicEmbBagCollectionSharder
    env = ShardingEnv.from_process_group(dist.GroupMember.WORLD)
    if fused_params is not None:  # TorchRec's own EBC, the twin
        sharder = EmbeddingBagCollectionSharder(fused_params=fused_params)
        plan = {"bags": construct_module_sharding_plan(
            model.bags, {t.name: row_wise(compute_kernel="fused")
                         for t in model.bags.embedding_bag_configs()},
            sharder=sharder, local_size=world_size, world_size=world_size, device_type="cpu")}
        return DistributedModelParallel(model, env=env, device=torch.device("cpu"),
                                        plan=ShardingPlan(plan), sharders=[sharder])
    sharders = [DynamicEmbBagCollectionSharder()]
    if model.with_extra:
        sharders.append(EmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.05}))
        constraints = dynemb_constraints(model, {"static": ParameterConstraints(
            sharding_types=["table_wise"], compute_kernels=["fused"])})
        planner = make_planner(Topology(world_size=world_size, local_world_size=world_size,
                                        compute_device="cpu"), constraints, batch_size=8)
        plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD).plan
    else:
        plan = {"bags": construct_module_sharding_plan(
            model.bags, {t.name: row_wise(compute_kernel="customized_kernel")
                         for t in model.bags.embedding_bag_configs()},
            sharder=sharders[0], local_size=world_size, world_size=world_size,
            device_type="cpu")}
    return DistributedModelParallel(model, env=env, device=torch.device("cpu"),
                                    plan=ShardingPlan(plan), sharders=sharders)


def ebc_shards(dmp):
    for key, value in dmp.state_dict().items():
        if key.startswith("bags.") and key.endswith(".weight"):
            shard_ = value.local_shards()[0]
            yield key.split(".")[-2], shard_.metadata.shard_offsets[0], shard_.tensor


def run_scenario(rank: int, world_size: int, s: BagScenario) -> Dict[str, Any]:
    from dynemb import DynamicEmbBagCollection
    torch.manual_seed(0)
    opt_config, fused_params = optimizer_configs(s.optimizer)
    weighted = POOLINGS[s.pooling][2]
    batches = make_batches(s, world_size)
    dtype = getattr(torch, s.id_dtypes[rank]) if s.id_dtypes else torch.int64
    local = [Batch(to_kjt([per_rank[rank]], weighted, dtype)) for per_rank in batches]
    dmp = shard(BagModel(s, opt_config), world_size)
    trainer = Trainer(dmp, local, s.loop)
    ref = DynamicEmbBagCollection(bag_tables(s), is_weighted=weighted,
                                  table_options=table_options(s, opt_config, world_size),
                                  optimizer=opt_config)
    tgt = targets(s.dims)
    twin = None
    if s.torchrec_twin:
        initial = initial_rows(ref, NUM_IDS)
        twin_dmp = shard(BagModel(s, torchrec_ebc=True), world_size, fused_params)
        for name, offset, tensor in ebc_shards(twin_dmp):
            tensor.detach().copy_(initial[name][offset:offset + tensor.shape[0]])
        twin = Trainer(twin_dmp, local, s.loop)

    def reference_step(step):
        ref_out = ref(to_kjt(batches[step], weighted))
        sizes = [per_rank[FEATURES[0]][0].numel() for per_rank in batches[step]]
        start = sum(sizes[:rank])
        mine = {f: ref_out[f][start:start + sizes[rank]] for f in FEATURES}
        (bag_loss(ref_out, tgt) / world_size).backward()
        return bag_loss(mine, tgt).detach(), mine

    result: Dict[str, Any] = {"plan": plan_summary(dmp)}
    train_side_by_side(result, s.steps, opt_config.learning_rate, trainer, ref, reference_step,
                       twin=twin, twin_key="twin")

    sharded = dmp.module.bags
    record_rows(result, sharded, ref, NUM_IDS)
    result["type"] = type(sharded).__name__
    if s.export_state:
        result["state"] = {k: v.clone() for k, v in dmp.state_dict().items()
                           if ".dynamic_tables." in k}
    if s.probe_bad_input:
        result["eval"] = probe_eval(dmp, ref, batches[0], rank, weighted)
        result["bad_input"] = probe_bad_input(dmp, batches[0][rank], weighted)
    if twin:
        result["twin_rows"] = {name: (offset, tensor.detach().numpy().copy())
                               for name, offset, tensor in ebc_shards(twin.dmp)}
    return result


def probe_eval(dmp, ref, per_rank: List[Dict[str, Any]], rank: int,
               weighted: bool) -> Dict[str, Any]:
    """Eval forwards under ``no_grad``: seen ids give the unsharded module's eval output,
    unseen ids zeros (the eval initializer), and nothing is inserted or updated."""
    sharded = dmp.module.bags
    inserts = {n: v["inserts"] for n, v in sharded.stats().items()}
    fresh = KeyedJaggedTensor.from_lengths_sync(
        FEATURES, torch.arange(10**9, 10**9 + 6), torch.ones(6, dtype=torch.int64),
        weights=torch.ones(6) if weighted else None)
    dmp.eval()
    ref.eval()
    with torch.no_grad():
        _, (_, unseen) = dmp(Batch(fresh))
        _, (_, seen) = dmp(Batch(to_kjt([per_rank[rank]], weighted)))
        expected = ref(to_kjt(per_rank, weighted))
    dmp.train()
    ref.train()
    sizes = [p[FEATURES[0]][0].numel() for p in per_rank]
    start = sum(sizes[:rank])
    return {"unseen": {f: v.numpy().copy() for f, v in unseen.items()},
            "seen": {f: v.numpy().copy() for f, v in seen.items()},
            "expected": {f: expected[f][start:start + sizes[rank]].numpy().copy()
                         for f in FEATURES},
            "inserts_before": inserts,
            "inserts_after": {n: v["inserts"] for n, v in sharded.stats().items()}}


def probe_bad_input(dmp, batch: Dict[str, Any], weighted: bool) -> Dict[str, Any]:
    """Bad KJTs on every rank: each must raise ``ValueError`` before any collective, and
    leave the rows and counters as they were."""
    sharded = dmp.module.bags
    ids = torch.arange(NUM_IDS)
    before = ({n: sharded.read_rows(n, ids) for n in ("t0", "t1")}, sharded.stats())
    good = to_kjt([batch], weighted)
    lengths, values = good.lengths(), good.values()
    n0 = int(good["f0"].lengths().sum())
    cases = {
        "missing_feature": KeyedJaggedTensor(
            keys=["f1", "f2"], values=values[n0:], lengths=lengths[good.stride():],
            weights=good.weights()[n0:] if weighted else None),
        "reserved_id": KeyedJaggedTensor(
            keys=FEATURES, values=torch.full_like(values, EMPTY_KEY), lengths=lengths,
            weights=good.weights() if weighted else None),
    }
    if weighted:  # an unweighted module ignores weights, as TorchRec's does
        cases["no_weights"] = KeyedJaggedTensor(keys=FEATURES, values=values, lengths=lengths)
    errors = {}
    for name, kjt in cases.items():
        try:
            dmp(Batch(kjt))
            errors[name] = None
        except ValueError as err:
            errors[name] = str(err)
    after = ({n: sharded.read_rows(n, ids) for n in ("t0", "t1")}, sharded.stats())
    unchanged = (after[1] == before[1] and all(
        torch.equal(before[0][n][0], after[0][n][0]) and
        torch.equal(before[0][n][1], after[0][n][1]) for n in ("t0", "t1")))
    dmp(Batch(good))[0].backward()  # the module still trains
    return {"errors": errors, "unchanged": unchanged}


def run_scenarios(rank: int, world_size: int,
                  scenarios: List[BagScenario]) -> List[Dict[str, Any]]:
    """Several scenarios in one spawned world (process start-up dominates small runs)."""
    return [run_scenario(rank, world_size, s) for s in scenarios]
