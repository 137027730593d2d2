"""Small models and workloads for the checkpoint tests: one DynamicEmbCollection of two
tables in a chosen storage mode, trained on a fixed Zipf-like id stream whose distinct ids
outnumber the device rows (so CACHE evicts to its store and DEFAULT uses its host tier)."""
import io

import torch
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, FrequencyAdmission,
                    Initializer, InitializerKind, OptimizerConfig, OptimizerType, ScorePolicy,
                    StorageMode)
from dynemb.module_interface import DynamicModuleInterface

DIM = 8
DEVICE_ROWS = 128
OPTIMIZERS = {
    "sgd": OptimizerConfig(OptimizerType.SGD, learning_rate=0.1),
    "adagrad": OptimizerConfig(OptimizerType.ADAGRAD, learning_rate=0.1),
    "rowwise_adagrad": OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD, learning_rate=0.1),
    "adam": OptimizerConfig(OptimizerType.ADAM, learning_rate=0.01),
}
MODES = ("hbm_direct", "cache", "default", "host_only")


def options(mode: str, optimizer: OptimizerConfig, policy=ScorePolicy.LRU, admission=False,
            dtype=None):
    width = DIM + optimizer.state_dim(DIM)
    itemsize = (dtype or torch.float32).itemsize
    kwargs = dict(initializer=Initializer(InitializerKind.UNIFORM, low=-0.5, high=0.5),
                  score_strategy=policy, bucket_size=32, embedding_dtype=dtype)
    if admission:
        kwargs["admission"] = FrequencyAdmission(threshold=2, counter_capacity=512)
    if mode == "hbm_direct":
        kwargs.update(init_capacity=64, max_capacity=2048)  # grows while training
    elif mode == "cache":
        kwargs.update(caching=True, global_hbm_for_values=DEVICE_ROWS * width * itemsize)
    elif mode == "host_only":  # every row in host memory
        kwargs.update(global_hbm_for_values=0)
    else:
        kwargs.update(global_hbm_for_values=DEVICE_ROWS * width * itemsize)
    return DynamicEmbTableOptions(**kwargs)


def model(mode="hbm_direct", optimizer="sgd", *, policy=ScorePolicy.LRU, admission=False,
          dtype=None, dims=(DIM, DIM)):
    opt = OPTIMIZERS[optimizer] if isinstance(optimizer, str) else optimizer
    configs = [EmbeddingConfig(name=f"t{i}", embedding_dim=d, num_embeddings=1024,
                               feature_names=[f"f{i}"]) for i, d in enumerate(dims)]
    ec = DynamicEmbCollection(configs, table_options=options(mode, opt, policy, admission,
                                                             dtype), optimizer=opt)
    expected = StorageMode(mode)
    assert set(ec.storage_modes().values()) == {expected}, ec.storage_modes()
    return ec


def batches(steps, seed=0, batch=24, universe=600):
    """KJTs of two features with Zipf-like ids in [0, universe) (some big, some negative)."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, universe + 1, dtype=torch.float64)
    probs = 1.0 / ranks
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 4, (2 * batch,), generator=gen)  # two features x batch
        total = int(lengths.sum())
        ids = torch.multinomial(probs, max(total, 1), replacement=True, generator=gen)[:total]
        ids = ids * 7919 - 1000  # spread and include negatives
        out.append(KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], ids, lengths))
    return out


def loss_of(out, seed=1):
    """A loss that weighs every output element differently (fixed weights)."""
    total = 0.0
    for name in sorted(out):
        values = out[name].values()
        gen = torch.Generator().manual_seed(seed + values.numel())
        weights = torch.randn(values.shape, generator=gen).to(values.device)
        total = total + (values * weights).sum() + (values ** 2).sum() * 0.1
    return total


def customized_score(step):
    """The score a CUSTOMIZED table's training batch writes at optimizer step ``step``: not
    monotonic in the step, so that its evictions are not LRU's."""
    return (step * 37) % 11 * 1000 + step


def train(ec, kjts):
    """Train on ``kjts``; returns the losses and the outputs of each step. CUSTOMIZED tables
    get :func:`customized_score` of their step before each one."""
    losses, outputs = [], []
    options = ec.table_options if isinstance(ec, DynamicModuleInterface) else {}  # not a DMP
    custom = [n for n, o in options.items() if o.score_strategy is ScorePolicy.CUSTOMIZED]
    for kjt in kjts:
        if custom:
            ec.set_scores({n: customized_score(ec.steps[n]) for n in custom})
        out = ec(kjt)
        loss = loss_of(out)
        loss.backward()
        losses.append(loss.detach())
        outputs.append({f: jt.values().detach().clone() for f, jt in out.items()})
    return losses, outputs


def roundtrip(state):
    """``state`` through torch.save / torch.load, as a file would take it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def all_rows(ec, table, keys):
    rows, found = ec.read_rows(table, keys, with_state=True)
    return rows, found


def eval_output(module, kjt):
    """``module(kjt)`` in eval mode under ``torch.no_grad()``, the module left training."""
    module.eval()
    try:
        with torch.no_grad():
            return module(kjt)
    finally:
        module.train()


def stored_scores(table, ids: torch.Tensor) -> torch.Tensor:
    """Each of ``ids``' score where ``table`` (a ``DynamicTable``) keeps it: its tiers' over
    its backing store's; 0 where the table holds no such id."""
    scores = torch.zeros(ids.numel(), dtype=torch.int64)
    store = getattr(table, "store", None)
    if store is not None:
        _, in_store, stored = store.find(ids)
        scores = torch.where(in_store, stored, scores)
    for tier in (table.tier, getattr(table, "host_tier", None)):
        if tier is not None:
            slots = tier.hash.find(ids)
            scores = torch.where(slots >= 0, tier.hash.scores_at(slots), scores)
    return scores


def sharded_row_wise(model: torch.nn.Module, tables, world_size: int):
    """``model`` under ``DistributedModelParallel`` on this CPU process group, the tables
    ``tables`` of its ``dyn`` collection row-wise over ``world_size`` ranks."""
    import torch.distributed as dist
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from dynemb.sharding import DynamicEmbCollectionSharder
    sharder = DynamicEmbCollectionSharder()
    plan = ShardingPlan({"dyn": construct_module_sharding_plan(
        model.dyn, {t: row_wise(compute_kernel="customized_kernel") for t in tables},
        sharder=sharder, local_size=world_size, world_size=world_size, device_type="cpu")})
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(
        dist.GroupMember.WORLD), device=torch.device("cpu"), plan=plan, sharders=[sharder])
