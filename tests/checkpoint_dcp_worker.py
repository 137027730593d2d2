"""What each rank runs in the torch.distributed.checkpoint tests (tests/test_checkpoint_dcp.py).

The model: five dynamic tables (t0 HBM_DIRECT with Adam, t1 CACHE with rows in its store,
t2 DEFAULT with admission, t3 and t4 CACHE with the LFU_LRU and CUSTOMIZED score policies,
t4's score set per step through the sharded module's ``set_scores``; all with the same
fused optimizer), a TorchRec
``EmbeddingCollection`` table with fbgemm's fused row-wise AdaGrad (it has optimizer state)
and a dense layer trained by SGD, under ``DistributedModelParallel``. Every rank trains on
its slice of one global batch; the loss of each rank is scaled by the world size so the
gradients (TorchRec divides sparse gradients by the world size, DDP averages dense ones)
are those of the global batch whatever the world size: a run resumed on another world size
can be compared with the uninterrupted one.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.checkpoint_models import stored_scores

FEATURES = ["f0", "f1", "f2", "f3", "f4"]
TABLES = [f"t{i}" for i in range(len(FEATURES))]
STATIC_FEATURE = "s"  # ids in [0, NUM_IDS) for the TorchRec table
NUM_IDS = 300
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks
DIM = 8


def dynamic_options():
    from dynemb import (DynamicEmbTableOptions, FrequencyAdmission, Initializer,
                        InitializerKind, OptimizerConfig, OptimizerType, ScorePolicy)
    opt = OptimizerConfig(OptimizerType.ADAM, learning_rate=0.02)
    width = DIM + opt.state_dim(DIM)
    init = Initializer(InitializerKind.UNIFORM, low=-0.1, high=0.1)
    common = dict(initializer=init, bucket_size=16, max_capacity=1024, seed=5)
    return opt, {
        "t0": DynamicEmbTableOptions(**common),
        "t1": DynamicEmbTableOptions(caching=True, global_hbm_for_values=96 * width * 4,
                                     **common),
        "t2": DynamicEmbTableOptions(global_hbm_for_values=128 * width * 4,
                                     admission=FrequencyAdmission(threshold=2,
                                                                  counter_capacity=1024),
                                     **common),
        "t3": DynamicEmbTableOptions(caching=True, global_hbm_for_values=96 * width * 4,
                                     score_strategy=ScorePolicy.LFU_LRU, **common),
        "t4": DynamicEmbTableOptions(caching=True, global_hbm_for_values=96 * width * 4,
                                     score_strategy=ScorePolicy.CUSTOMIZED, **common),
    }


def customized_score(step: int) -> int:
    """t4's score at global step ``step`` (not monotonic: its evictions are not LRU's)."""
    return (step * 37) % 11 * 1000 + step


class Model(torch.nn.Module):
    def __init__(self, world_size: int):
        super().__init__()
        from dynemb import DynamicEmbCollection
        opt, options = dynamic_options()
        self.dyn = DynamicEmbCollection(
            [EmbeddingConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=NUM_IDS,
                             feature_names=[f"f{i}"]) for i in range(len(FEATURES))],
            device="meta", table_options=options, optimizer=opt)
        self.ec = EmbeddingCollection(tables=[EmbeddingConfig(
            name="static", embedding_dim=DIM, num_embeddings=NUM_IDS,
            feature_names=[STATIC_FEATURE])],
            device=torch.device("meta"))
        self.dense = torch.nn.Linear(DIM, 1)
        self.scale = float(world_size)

    def forward(self, kjt: KeyedJaggedTensor):
        out = self.dyn(kjt)
        static = self.ec(kjt)[STATIC_FEATURE].values()
        loss = self.dense(static).pow(2).sum()
        for i, f in enumerate(FEATURES):
            e = out[f].values()
            loss = loss + ((e - 0.1 * (i + 1)) ** 2).sum() + e.sum() * 0.01
        return loss * self.scale, {f: out[f].values().detach() for f in FEATURES}


def shard(world_size: int):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from dynemb.sharding import DynamicEmbCollectionSharder
    torch.manual_seed(0)
    model = Model(world_size)
    dyn_sharder = DynamicEmbCollectionSharder()
    ec_sharder = EmbeddingCollectionSharder(fused_params={
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-6})
    plan = ShardingPlan({
        "dyn": construct_module_sharding_plan(
            model.dyn, {f"t{i}": row_wise(compute_kernel="customized_kernel")
                        for i in range(len(FEATURES))},
            sharder=dyn_sharder, local_size=world_size, world_size=world_size,
            device_type="cpu"),
        "ec": construct_module_sharding_plan(
            model.ec, {"static": row_wise(compute_kernel="fused")}, sharder=ec_sharder,
            local_size=world_size, world_size=world_size, device_type="cpu")})
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(
        dist.GroupMember.WORLD), device=torch.device("cpu"), plan=plan,
        sharders=[dyn_sharder, ec_sharder])
    for key, value in dmp.state_dict().items():  # the same static rows whatever the world
        if key.endswith("ec.embeddings.static.weight"):
            shard_ = value.local_shards()[0]
            offset = shard_.metadata.shard_offsets[0]
            g = torch.Generator().manual_seed(1)
            full = torch.rand(NUM_IDS, DIM, generator=g) * 0.2 - 0.1
            shard_.tensor.detach().copy_(full[offset:offset + shard_.tensor.shape[0]])
    with torch.no_grad():
        dmp.module.dense.weight.fill_(0.05)
        dmp.module.dense.bias.fill_(0.0)
    return dmp


def optimizer(dmp, world_size):
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    # DDP averages dense gradients over the ranks: the learning rate makes up for it
    dense = KeyedOptimizerWrapper(params, lambda ps: torch.optim.SGD(ps, lr=0.01))
    return CombinedOptimizer([("sparse", dmp.fused_optimizer), ("dense", dense)])


def global_batches(steps: int, seed: int = 3) -> List[Dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        batch = {}
        for f in FEATURES + [STATIC_FEATURE]:
            lengths = torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)
            values = torch.randint(0, NUM_IDS, (int(lengths.sum()),), generator=g)
            batch[f] = (lengths, values if f == STATIC_FEATURE else values * 1009 - 77)
        out.append(batch)
    return out


def local_kjt(batch, rank: int, world_size: int) -> KeyedJaggedTensor:
    per = GLOBAL_BATCH // world_size
    lengths, values = [], []
    for f in FEATURES + [STATIC_FEATURE]:
        ls, vs = batch[f]
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), ls.cumsum(0)])
        lo, hi = rank * per, (rank + 1) * per
        lengths.append(ls[lo:hi])
        values.append(vs[offsets[lo]:offsets[hi]])
    return KeyedJaggedTensor.from_lengths_sync(FEATURES + [STATIC_FEATURE], torch.cat(values),
                                               torch.cat(lengths))


def train(dmp, opt, batches, rank, world_size, first_step=0) -> List[float]:
    """Global loss of each step (the sum over ranks, unscaled); ``first_step``: the global
    step of ``batches[0]`` (t4's score)."""
    losses = []
    for step, batch in enumerate(batches, first_step):
        dmp.module.dyn.set_scores({"t4": customized_score(step)})
        opt.zero_grad()
        loss, _ = dmp(local_kjt(batch, rank, world_size))
        loss.backward()
        opt.step()
        total = loss.detach() / world_size
        dist.all_reduce(total)
        losses.append(float(total))
    return losses


def table_rows(dmp) -> Dict[str, Any]:
    """Every id's row (with optimizer state) as its owner holds it, gathered to all ranks."""
    ids = torch.arange(NUM_IDS) * 1009 - 77
    sharded = dmp.module.dyn
    out = {}
    for name in TABLES:
        rows, found = sharded.read_rows(name, ids, with_state=True)
        rows = rows * found[:, None]
        dist.all_reduce(rows)
        count = found.to(torch.int64)
        dist.all_reduce(count)
        out[name] = (rows.numpy(), count.numpy())
    return out


def key_scores(dmp) -> Dict[str, Any]:
    """Every id's score as its owner holds it (the cached one, else the store's; 0 for ids
    not stored), gathered to all ranks."""
    ids = torch.arange(NUM_IDS) * 1009 - 77
    out = {}
    for name, table in dmp.module.dyn.local.tables.items():
        scores = stored_scores(table, ids)
        dist.all_reduce(scores)
        out[name] = scores.numpy()
    return out


def save_and_continue(rank, world_size, path, steps_before, steps_after):
    """Train, save with dcp.save, train further: the uninterrupted run."""
    dmp = shard(world_size)
    opt = optimizer(dmp, world_size)
    batches = global_batches(steps_before + steps_after)
    before = train(dmp, opt, batches[:steps_before], rank, world_size)
    dcp.save({"model": dmp.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
    after = train(dmp, opt, batches[steps_before:], rank, world_size, steps_before)
    return {"before": before, "after": after, "rows": table_rows(dmp),
            "stats": dmp.module.dyn.stats()}


def async_save_and_continue(rank, world_size, path, steps_before, steps_after):
    """The uninterrupted run of :func:`save_and_continue`, saved with ``dcp.async_save``
    (``DynamicEmbAsyncStager``, a process group of its own for the background save): the
    steps after it run while the checkpoint is written (its writer waits until they have)."""
    import threading

    from torch.distributed.checkpoint import FileSystemWriter

    from dynemb.checkpoint import DynamicEmbAsyncStager
    trained = threading.Event()

    class HeldWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            assert trained.wait(120), "the steps after the save never ended"
            return super().write_data(plan, planner)

    dmp = shard(world_size)
    opt = optimizer(dmp, world_size)
    batches = global_batches(steps_before + steps_after)
    before = train(dmp, opt, batches[:steps_before], rank, world_size)
    saving = dcp.async_save({"model": dmp.state_dict(), "optim": opt.state_dict()},
                            storage_writer=HeldWriter(path),
                            async_stager=DynamicEmbAsyncStager(),
                            process_group=dist.new_group(backend="gloo"))
    after = train(dmp, opt, batches[steps_before:], rank, world_size, steps_before)
    written_during_training = saving.done()
    trained.set()
    saving.result()
    return {"before": before, "after": after, "rows": table_rows(dmp),
            "stats": dmp.module.dyn.stats(), "written_during_training": written_during_training}


def load_and_continue(rank, world_size, path, steps_before, steps_after, planner="dynemb"):
    """Build a fresh model on this world size, load the checkpoint, train further."""
    from dynemb.checkpoint import DynamicEmbLoadPlanner
    dmp = shard(world_size)
    opt = optimizer(dmp, world_size)
    state = {"model": dmp.state_dict(), "optim": opt.state_dict()}
    kwargs = {"planner": DynamicEmbLoadPlanner()} if planner == "dynemb" else {}
    dcp.load(state, checkpoint_id=path, **kwargs)
    dmp.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    loaded_rows, loaded_scores = table_rows(dmp), key_scores(dmp)
    batches = global_batches(steps_before + steps_after)
    after = train(dmp, opt, batches[steps_before:], rank, world_size, steps_before)
    return {"after": after, "rows": table_rows(dmp), "loaded_rows": loaded_rows,
            "loaded_scores": loaded_scores,
            "stats": dmp.module.dyn.stats()}


def run(rank, world_size, jobs):
    """Run ``jobs`` (``(function name, args)``) in order; errors come back as strings."""
    results = []
    for name, args in jobs:
        try:
            results.append(globals()[name](rank, world_size, *args))
        except (Exception, CheckpointException) as err:  # the test checks the message
            results.append({"error": f"{type(err).__name__}: {err}"})
            dist.barrier()
    return results
