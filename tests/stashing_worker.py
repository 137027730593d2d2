"""Memory-stashing scenarios run on every rank of a spawned gloo world (examples/spawn.py).

Each scenario trains two copies of one model on the same batches under the same loop: one
whose dynamic tables stash (``StashMode``), one whose tables do not. The model is a sharded
``DynamicEmbCollection`` followed by a dense layer ``over`` (the EMS pipelines' injection
site), so the embedding backward comes after the dense backward, as in a real model. Both
copies must give the same outputs and losses at every step and the same rows (with optimizer
state) at the end, bit for bit; while the dense layer runs, the stashing copy's tables must
hold no device memory.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List

import torch

from tests.sharded_twin import (FEATURES, NUM_IDS, Batch, Scenario, dense_optimizer,
                                embedding_loss, make_batches, tables, targets, to_kjt)

OPTIMIZERS = ("sgd", "adam", "adagrad", "rowwise_adagrad")
LOOPS = ("plain", "plain_hook", "pipeline", "prefetch", "embstash", "embstash_delay",
         "prefetch_ems")


@dataclass
class StashScenario:
    loop: str = "plain"           # one of LOOPS
    mode: str = "hbm_direct"      # hbm_direct | cache | default
    optimizer: str = "sgd"        # one of OPTIMIZERS
    stash: str = "all"            # a StashMode value
    dims: tuple = (8, 4)
    steps: int = 7
    batch: int = 5
    device_rows: int = 96         # per rank, CACHE and DEFAULT
    seed: int = 5


def optimizer_config(name: str):
    from dynemb import OptimizerConfig, OptimizerType
    return OptimizerConfig(OptimizerType(name), learning_rate=0.05, eps=1e-6)


def table_options(s: StashScenario, stash: str):
    from dynemb import DynamicEmbTableOptions, Initializer, InitializerKind
    from dynemb.options import StashMode
    opt = optimizer_config(s.optimizer)
    out = {}
    for t in tables(s.dims):
        row_bytes = (t.embedding_dim + opt.state_dim(t.embedding_dim)) * 4
        budget = None if s.mode == "hbm_direct" else s.device_rows * row_bytes
        out[t.name] = DynamicEmbTableOptions(
            caching=s.mode == "cache", local_hbm_for_values=budget, max_capacity=1024,
            bucket_size=16, seed=3, stash=StashMode(stash),
            initializer=Initializer(InitializerKind.UNIFORM, low=-0.1, high=0.1))
    return out


class StashModel(torch.nn.Module):
    """Dynamic tables, then ``over``: a dense layer on the per-feature sums."""

    def __init__(self, s: StashScenario, stash: str):
        super().__init__()
        from dynemb import DynamicEmbCollection
        self.dyn = DynamicEmbCollection(tables(s.dims), device="meta",
                                        table_options=table_options(s, stash),
                                        optimizer=optimizer_config(s.optimizer))
        widths = {t.name: t.embedding_dim for t in tables(s.dims)}
        width = sum(widths["t0" if f != "f2" else "t1"] for f in FEATURES)
        self.over = torch.nn.Linear(width, 1)
        self.tgt = targets(s.dims)
        self.window: List[Dict[str, int]] = []  # device bytes of the rows after over ran
        self.over.register_forward_hook(self._probe)

    def _probe(self, *_) -> None:
        from dynemb.stashing import collection_stashes
        self.window.append({n: s.device_bytes() for c in collection_stashes(self.dyn)
                            for n, s in c.table_stashes().items()})

    def forward(self, batch: Batch):
        out = self.dyn(batch.features)
        values = {f: out[f].values() for f in FEATURES}
        x = torch.cat([values[f].sum(0) for f in FEATURES])
        loss = embedding_loss(out, self.tgt) + self.over(x).pow(2).sum()
        return loss, (loss.detach(), {f: v.detach() for f, v in values.items()})


def shard(model: StashModel, world_size: int):
    import torch.distributed as dist
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from dynemb.sharding import DynamicEmbCollectionSharder
    sharder = DynamicEmbCollectionSharder()
    plan = {"dyn": construct_module_sharding_plan(
        model.dyn, {t.name: row_wise(compute_kernel="customized_kernel")
                    for t in model.dyn.embedding_configs()},
        sharder=sharder, local_size=world_size, world_size=world_size, device_type="cpu")}
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(
        dist.GroupMember.WORLD), device=torch.device("cpu"), plan=ShardingPlan(plan),
        sharders=[sharder])


class Trainer:
    """One model under one loop over its batches."""

    def __init__(self, dmp, batches: List[Batch], loop: str):
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        from dynemb.pipelines import (PrefetchTrainPipelineSparseDist, TrainPipelinePrefetchEMS,
                                      TrainPipelineSparseDistEmbStash)
        self.dmp, self.batches, self.loop = dmp, batches, loop
        self.optimizer = dense_optimizer(dmp)
        self.it = iter(batches)
        self.index = 0
        cpu = torch.device("cpu")
        self.pipeline = {
            "pipeline": lambda: TrainPipelineSparseDist(dmp, self.optimizer, cpu),
            "prefetch": lambda: PrefetchTrainPipelineSparseDist(dmp, self.optimizer, cpu),
            "embstash": lambda: TrainPipelineSparseDistEmbStash(dmp, self.optimizer, cpu,
                                                                site_fqn="over"),
            "embstash_delay": lambda: TrainPipelineSparseDistEmbStash(
                dmp, self.optimizer, cpu, site_fqn="over", delay_stash=True,
                stash_site_fqn="over"),
            "prefetch_ems": lambda: TrainPipelinePrefetchEMS(dmp, self.optimizer, cpu,
                                                             site_fqn="over"),
        }.get(loop, lambda: None)()

    def step(self):
        if self.pipeline is not None:
            return self.pipeline.progress(self.it)
        from dynemb.stashing import restore_on_grad
        batch = self.batches[self.index]
        self.index += 1
        self.optimizer.zero_grad()
        loss, out = self.dmp(batch)
        if self.loop == "plain_hook":  # restore once the dense layer's backward is reached
            restore_on_grad(loss, self.dmp)
        loss.backward()
        self.optimizer.step()
        return out


def _rows(dmp) -> Dict[str, Any]:
    ids = torch.arange(NUM_IDS)
    out = {}
    for name in ("t0", "t1"):
        rows, found = dmp.module.dyn.read_rows(name, ids, with_state=True)
        out[name] = (found.numpy().copy(), rows.numpy().copy())
    return out


def run_stash_scenario(rank: int, world_size: int, s: StashScenario) -> Dict[str, Any]:
    from torchrec.distributed.memory_stashing import MemoryStashingManager

    from dynemb.stashing import collection_stashes
    batch_plan = Scenario(steps=s.steps, batch=s.batch, seed=s.seed, lonely_step=None)
    batches = [Batch(to_kjt([per_rank[rank]])) for per_rank in make_batches(batch_plan,
                                                                            world_size)]
    runs = {}
    for stash in ("none", s.stash):
        torch.manual_seed(0)  # the dense layers start alike
        dmp = shard(StashModel(s, stash), world_size)
        trainer = Trainer(dmp, batches, s.loop)
        losses, outputs = [], []
        for _ in range(s.steps):
            loss, out = trainer.step()
            losses.append(loss.item())
            outputs.append({f: v.numpy().copy() for f, v in out.items()})
        stashes = collection_stashes(dmp)
        runs[stash] = {
            "losses": losses, "outputs": outputs, "rows": _rows(dmp),
            "window": list(dmp.module.window),
            "modes": {k: v.value for k, v in dmp.module.dyn.storage_modes().items()},
            "counts": {n: (t.stashes, t.restores, t.restores_on_access, t.replayed_inits)
                       for c in stashes for n, t in c.table_stashes().items()},
            "stashed_after": [n for c in stashes for n in c.stashed],
        }
        MemoryStashingManager.reset()  # delay_stash and queued callbacks end with the run
    return {"plain": runs["none"], "stashed": runs[s.stash]}


def run_stash_scenarios(rank: int, world_size: int,
                        scenarios: List[StashScenario]) -> List[Dict[str, Any]]:
    """Several scenarios in one spawned world (process start-up dominates small runs)."""
    return [run_stash_scenario(rank, world_size, s) for s in scenarios]


def scenario(**changes) -> StashScenario:
    return dataclasses.replace(StashScenario(), **changes)
