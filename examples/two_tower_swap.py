"""A two-tower retrieval model trained on TorchRec's ``EmbeddingBagCollection`` and on
``dynemb.DynamicEmbBagCollection``, with only the class name changed between the two.

The model is the kind TorchRec's retrieval examples train: a user tower and an item tower,
each an embedding bag collection followed by an MLP, both reading one shared
``KeyedJaggedTensor`` (each tower's collection picks its own features and ignores the other
tower's). The towers' outputs are scored by dot product and trained with an in-batch softmax:
in a batch of B (user, clicked item) pairs, each user's clicked item is the positive and the
other B - 1 items are the negatives.

Data: a built-in synthetic stream (no files, no servers). Items belong to hidden clusters
and have Zipf popularity within their cluster; each user has two favourite clusters and
clicks mostly inside them. A user is described by their id and a bag of recent clicks
(MEAN-pooled), an item by its id and its cluster (the category). Ids lie in
``[0, num_embeddings)`` so that TorchRec's fixed tables can take them too. The held-out
metric is recall@10: how often a held-out click's item ranks in the top 10 of the whole
catalog for its user (chance is 10 / items).

:func:`build_model` takes the embedding module class and is called with
``EmbeddingBagCollection`` and with ``DynamicEmbBagCollection``: same ``EmbeddingBagConfig``s
(``weight_init_min/max``), same seed (the MLPs start identical), same batches, same loss and
dense optimizer (Adam). It trains both twice:

1. **Single process, unsharded**, in a plain loop, the tables getting row-wise AdaGrad
   inside backward from ``torchrec.optim.apply_optimizer_in_backward`` on their parameters
   (:func:`single_process_model`; the code is the same for both).
2. **Sharded** by ``DistributedModelParallel`` **without a plan** over ``--nproc`` spawned CPU
   ranks (gloo), under TorchRec's ``TrainPipelineSparseDist``. The code is the same for both:
   the sharders list holds both libraries' sharders with the same ``fused_params``
   (row-wise AdaGrad; a TorchRec script adds dynemb's sharder to its list, docs/migrating.md
   step 5), and DMP's default planner picks each library's own sharding for each collection
   (on 2 CPU ranks TorchRec's tables go table-wise, since its EBC sharder offers no row-wise
   sharding on CPU; dynemb's tables are always row-wise). On one rank TorchRec's planner
   may make a small table data-parallel, which the dense optimizer then trains, as in any
   TorchRec model.

The rows start from different random draws (TorchRec's from torch's generator, dynemb's from
a hash of (seed, table, id), both uniform in the configs' ``weight_init_min/max``), so the
curves are close, not equal.

Run::

    python examples/two_tower_swap.py            # about a minute on 2 CPU cores
    python examples/two_tower_swap.py --quick    # seconds-long smoke run

Writes ``<out-dir>/two_tower_swap.json`` (per-step losses of the four runs, their held-out
recall@10, the wall times) and ``<out-dir>/two_tower_swap.png`` (the loss curves, TorchRec
next to dynemb, single-process and sharded); ``main()`` returns the metrics.
"""
from __future__ import annotations

import os

# The CPU ranks share the cores: idle OpenMP threads must sleep, not spin. Read when torch
# loads, so set before importing it (spawned ranks get it from spawn.run_on_ranks).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Dict, Iterator, List, Optional  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402
from torchrec.streamable import Pipelineable  # noqa: E402

from dynemb import DynamicEmbBagCollection  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rank_setup import quiet_torchrec  # noqa: E402
from spawn import add_timeout_argument, require_positive, run_on_ranks  # noqa: E402

OUT_DIR = Path(__file__).resolve().parent / "output"
LIBRARIES = {"torchrec": EmbeddingBagCollection, "dynemb": DynamicEmbBagCollection}
USER_FEATURES = ["user_id", "user_history"]
ITEM_FEATURES = ["item_id", "item_category"]
FEATURES = USER_FEATURES + ITEM_FEATURES
TOP_K = 10
EMBEDDING_LR = 0.05
EPS = 1e-8
#: The tables' optimizer, the TorchRec way: fused row-wise AdaGrad inside backward.
FUSED_PARAMS = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                "learning_rate": EMBEDDING_LR, "eps": EPS}
DENSE_LR = 3e-3
INIT_RANGE = 0.05   # weight_init_min/max of every table


@dataclass(frozen=True)
class Config:
    """Sizes of one run: the full default and ``--quick``."""

    steps: int
    batch: int           # examples per step (per rank when sharded)
    items: int
    clusters: int
    users: int
    eval_examples: int
    dim: int = 16
    hidden: int = 64
    max_history: int = 6


FULL = Config(steps=1000, batch=128, items=2000, clusters=40, users=4000, eval_examples=2000)
QUICK = Config(steps=300, batch=64, items=400, clusters=10, users=500, eval_examples=2000)


# -- data --------------------------------------------------------------------------------------
class ClickWorld:
    """Users who click items mostly in their two favourite clusters; items with Zipf
    popularity within their cluster. Every id is in ``[0, num_embeddings)``."""

    FAVOURITE_SHARE = 0.85   # clicks inside a favourite cluster; the rest anywhere

    def __init__(self, cfg: Config, seed: int):
        rng = np.random.default_rng([seed, 7])
        self.cfg = cfg
        self.item_cluster = rng.integers(0, cfg.clusters, cfg.items)
        self.members = [np.flatnonzero(self.item_cluster == c) for c in range(cfg.clusters)]
        self.members = [m if len(m) else np.array([c % cfg.items]) for c, m in
                        enumerate(self.members)]
        self.member_weights = [self._zipf(len(m), rng) for m in self.members]
        self.favourites = np.stack([rng.choice(cfg.clusters, 2, replace=False)
                                    for _ in range(cfg.users)])

    @staticmethod
    def _zipf(n: int, rng: np.random.Generator) -> np.ndarray:
        weights = 1.0 / np.arange(1, n + 1)
        return rng.permutation(weights / weights.sum())

    def clicks(self, users: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One clicked item per user."""
        inside = rng.random(len(users)) < self.FAVOURITE_SHARE
        clusters = np.where(inside, self.favourites[users, rng.integers(0, 2, len(users))],
                            rng.integers(0, self.cfg.clusters, len(users)))
        return np.array([rng.choice(self.members[c], p=self.member_weights[c])
                         for c in clusters])

    def sample(self, n: int, rng: np.random.Generator) -> Dict[str, np.ndarray]:
        """``n`` examples: user, a bag of recent clicks, the clicked item and its cluster."""
        users = rng.integers(0, self.cfg.users, n)
        lengths = rng.integers(1, self.cfg.max_history + 1, n)
        history = self.clicks(np.repeat(users, lengths), rng)
        items = self.clicks(users, rng)
        return {"user": users, "history": history, "history_lengths": lengths,
                "item": items, "category": self.item_cluster[items]}


def to_kjt(part: Dict[str, np.ndarray]) -> KeyedJaggedTensor:
    """The shared KJT of both towers. A part without one tower's columns (the catalog, the
    held-out users) gets empty bags there: TorchRec's sharded collection fixes the order of
    the KJT's features at its first batch, so every KJT carries the same four."""
    n = len(part["user"] if "user" in part else part["item"])
    ones, empty = np.ones(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    columns = {"user_id": ("user", ones), "user_history": ("history", part.get("history_lengths")),
               "item_id": ("item", ones), "item_category": ("category", ones)}
    values, lengths = [], []
    for column, column_lengths in columns.values():
        present = column in part
        values.append(part[column] if present else empty[:0])
        lengths.append(column_lengths if present else empty)
    return KeyedJaggedTensor.from_lengths_sync(
        FEATURES, torch.from_numpy(np.concatenate(values)).long(),
        torch.from_numpy(np.concatenate(lengths)).long())


@dataclass
class Batch(Pipelineable):
    """One training batch: the shared KJT (each row's clicked item is its positive)."""

    features: KeyedJaggedTensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        return Batch(self.features.to(device=device, non_blocking=non_blocking))

    def record_stream(self, stream) -> None:
        self.features.record_stream(stream)

    def pin_memory(self) -> "Batch":
        return Batch(self.features.pin_memory())


def batches(world: ClickWorld, cfg: Config, rng: np.random.Generator,
            count: int) -> Iterator[Batch]:
    for _ in range(count):
        yield Batch(to_kjt(world.sample(cfg.batch, rng)))


# -- model -------------------------------------------------------------------------------------
def tables(cfg: Config) -> Dict[str, List[EmbeddingBagConfig]]:
    """The ``EmbeddingBagConfig``s of each tower, as a TorchRec model would declare them."""
    def config(name, rows, feature, pooling=PoolingType.SUM):
        return EmbeddingBagConfig(name=name, embedding_dim=cfg.dim, num_embeddings=rows,
                                  feature_names=[feature], pooling=pooling,
                                  weight_init_min=-INIT_RANGE, weight_init_max=INIT_RANGE)
    return {"user": [config("user_ids", cfg.users, "user_id"),
                     config("history", cfg.items, "user_history", PoolingType.MEAN)],
            "item": [config("item_ids", cfg.items, "item_id"),
                     config("categories", cfg.clusters, "item_category")]}


class Tower(torch.nn.Module):
    """An embedding bag collection, then an MLP over its pooled features."""

    def __init__(self, ebc: torch.nn.Module, mlp: torch.nn.Module):
        super().__init__()
        self.ebc = ebc
        self.mlp = mlp

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.mlp(self.ebc(features).values())


class TwoTower(torch.nn.Module):
    """User and item towers over one shared KJT; ``forward(batch)`` returns
    ``(loss, loss.detach())`` as TorchRec's train pipelines expect."""

    def __init__(self, user: Tower, item: Tower):
        super().__init__()
        self.user = user
        self.item = item

    def forward(self, batch: Batch):
        query = self.user(batch.features)
        candidate = self.item(batch.features)
        loss = in_batch_softmax(query, candidate)
        return loss, loss.detach()


def in_batch_softmax(query: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """Cross entropy of each query against every candidate of the batch, its own positive."""
    logits = query @ candidate.T
    return torch.nn.functional.cross_entropy(logits, torch.arange(logits.shape[0]))


def mlp(cfg: Config) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(2 * cfg.dim, cfg.hidden), torch.nn.ReLU(),
                               torch.nn.Linear(cfg.hidden, cfg.dim))


def build_model(ebc_class: type, cfg: Config, device: torch.device, seed: int,
                **ebc_kwargs: Any) -> TwoTower:
    """The two-tower model on ``ebc_class`` (TorchRec's ``EmbeddingBagCollection`` or
    ``DynamicEmbBagCollection``), its collections on ``device`` (``meta`` for DMP to
    shard), the MLPs on the CPU."""
    torch.manual_seed(seed)
    # the MLPs first: TorchRec's CPU tables draw their rows from torch's generator (dynemb's
    # from a hash), so built after the tables, the MLPs would start differently
    user_mlp, item_mlp = mlp(cfg), mlp(cfg)
    towers = tables(cfg)
    return TwoTower(
        Tower(ebc_class(tables=towers["user"], device=device, **ebc_kwargs), user_mlp),
        Tower(ebc_class(tables=towers["item"], device=device, **ebc_kwargs), item_mlp))


# -- evaluation --------------------------------------------------------------------------------
@torch.no_grad()
def recall_at_k(model: TwoTower, world: ClickWorld, held_out: Dict[str, np.ndarray]) -> float:
    """How often the held-out click's item is in the top ``TOP_K`` of the whole catalog."""
    catalog = np.arange(world.cfg.items)
    candidates = model.item(to_kjt({"item": catalog, "category": world.item_cluster[catalog]}))
    queries = model.user(to_kjt({k: held_out[k] for k in ("user", "history",
                                                          "history_lengths")}))
    scores = queries @ candidates.T
    truth = torch.from_numpy(held_out["item"])
    rank_of_truth = (scores > scores.gather(1, truth[:, None])).sum(1)
    return float((rank_of_truth < TOP_K).float().mean())


def held_out_examples(world: ClickWorld, cfg: Config, seed: int) -> Dict[str, np.ndarray]:
    return world.sample(cfg.eval_examples, np.random.default_rng([seed, 99]))


def curve_summary(losses: List[float], recall: float, seconds: float) -> Dict[str, Any]:
    """A run's record: per-step losses, the mean of the first and last tenth, recall."""
    window = max(5, len(losses) // 10)
    return {"losses": losses, "initial_loss": float(np.mean(losses[:window])),
            "final_loss": float(np.mean(losses[-window:])), "recall10": recall,
            "seconds": seconds}


# -- single process ----------------------------------------------------------------------------
def single_process_model(ebc_class: type, cfg: Config, seed: int) -> TwoTower:
    """The unsharded model with its tables' optimizer: row-wise AdaGrad inside backward,
    given the TorchRec way, ``apply_optimizer_in_backward`` on the tables' parameters
    (dynemb's modules have one parameter handle per table for it to mark). Sharded, both
    read it from the sharder's ``fused_params`` instead.
    """
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    model = build_model(ebc_class, cfg, torch.device("cpu"), seed)
    tables_of_both = [*model.user.ebc.parameters(), *model.item.ebc.parameters()]
    apply_optimizer_in_backward(RowWiseAdagrad, tables_of_both, {"lr": EMBEDDING_LR, "eps": EPS})
    return model


def dense_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Adam over the parameters no optimizer in backward covers (the MLPs)."""
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    dense = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
    return torch.optim.Adam(dense, lr=DENSE_LR)


def train_single_process(ebc_class: type, cfg: Config, seed: int) -> Dict[str, Any]:
    world = ClickWorld(cfg, seed)
    model = single_process_model(ebc_class, cfg, seed)
    optimizer = dense_optimizer(model)
    losses = []
    start = time.perf_counter()
    for batch in batches(world, cfg, np.random.default_rng([seed, 1]), cfg.steps):
        optimizer.zero_grad()
        loss, value = model(batch)
        loss.backward()
        optimizer.step()
        losses.append(float(value))
    seconds = time.perf_counter() - start
    model.eval()
    return curve_summary(losses, recall_at_k(model, world, held_out_examples(world, cfg, seed)),
                         seconds)


# -- sharded -----------------------------------------------------------------------------------
def sharders() -> List[Any]:
    """Both libraries' sharders with the same ``fused_params``; DMP uses the one matching
    each collection's class."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from dynemb.sharding import DynamicEmbBagCollectionSharder
    return [DynamicEmbBagCollectionSharder(fused_params=dict(FUSED_PARAMS)),
            EmbeddingBagCollectionSharder(fused_params=dict(FUSED_PARAMS))]


def train_sharded(ebc_class: type, cfg: Config, seed: int, rank: int,
                  world_size: int) -> Optional[Dict[str, Any]]:
    """DMP without a plan, TorchRec's ``TrainPipelineSparseDist``; each rank draws its own
    batches. Rank 0 returns the run's record (losses averaged over the ranks)."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    device = torch.device("cpu")
    world = ClickWorld(cfg, seed)
    dmp = DistributedModelParallel(build_model(ebc_class, cfg, torch.device("meta"), seed),
                                   device=device, sharders=sharders())
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    optimizer = CombinedOptimizer([dmp.fused_optimizer, KeyedOptimizerWrapper(
        dense, lambda params: torch.optim.Adam(params, lr=DENSE_LR))])
    pipeline = TrainPipelineSparseDist(dmp, optimizer, device)
    it = batches(world, cfg, np.random.default_rng([seed, 1, rank]), cfg.steps)
    losses = []
    start = time.perf_counter()
    while True:
        try:
            losses.append(float(pipeline.progress(it)))
        except StopIteration:
            break
    seconds = time.perf_counter() - start
    pipeline.detach()
    dmp.eval()
    recall = recall_at_k(dmp.module, world, held_out_examples(world, cfg, seed))
    everyone: List[Any] = [None] * world_size
    dist.all_gather_object(everyone, losses)
    plan = {name: {t: f"{p.sharding_type}/{p.compute_kernel}" for t, p in module.items()}
            for name, module in dmp.plan.plan.items()}
    if rank != 0:
        return None
    record = curve_summary(np.mean(np.asarray(everyone), axis=0).tolist(), recall, seconds)
    return {**record, "plan": plan}


def sharded_rank(rank: int, world_size: int, cfg: Config, seed: int) -> Optional[Dict]:
    """Both libraries, one after the other, in this rank's process group."""
    torch.set_num_threads(1)
    quiet_torchrec()
    return {name: train_sharded(cls, cfg, seed, rank, world_size)
            for name, cls in LIBRARIES.items()}


# -- report ------------------------------------------------------------------------------------
def print_summary(m: Dict[str, Any]) -> None:
    print(f"\nrecall@{TOP_K} by chance: {m['chance_recall10']:.3f}")
    for mode, runs in m["runs"].items():
        for name, r in runs.items():
            print(f"{mode:>14} {name:>8}: loss {r['initial_loss']:.3f} -> "
                  f"{r['final_loss']:.3f}, recall@{TOP_K} {r['recall10']:.3f}, "
                  f"{r['seconds']:.1f} s")
            if "plan" in r:
                kinds = sorted({k for module in r["plan"].values() for k in module.values()})
                print(f"{'':>24}sharded as {', '.join(kinds)}")
    print(f"plot: {m['plot']}; metrics: {m['json']}; wall time {m['wall_seconds']:.0f} s")


def plot(m: Dict[str, Any], path: Path) -> Path:
    """The loss curves (running mean), TorchRec next to dynemb, one panel per mode."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(m["runs"]), figsize=(11, 4), sharey=True)
    for ax, (mode, runs) in zip(np.atleast_1d(axes), m["runs"].items()):
        for name, r in runs.items():
            losses = np.asarray(r["losses"])
            window = max(1, len(losses) // 20)
            smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
            ax.plot(np.arange(window, len(losses) + 1), smooth,
                    label=f"{name} (recall@{TOP_K} {r['recall10']:.2f})")
        ax.set(xlabel="step", title=mode)
        ax.legend()
    np.atleast_1d(axes)[0].set_ylabel("in-batch softmax loss (running mean)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, help="training steps (default 1000; quick 300)")
    parser.add_argument("--quick", action="store_true", help="small catalog, seconds-long run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nproc", type=int, default=2, help="CPU ranks to spawn (default 2)")
    add_timeout_argument(parser)
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR,
                        help=f"where the plot and metrics go (default {OUT_DIR})")
    args = parser.parse_args(argv)
    require_positive(parser, args, "steps", "nproc")
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Train the four runs, print the summary, write the metrics and the plot."""
    args = parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    torch.set_num_threads(1)   # tiny dense ops; the ranks share the cores
    quiet_torchrec()
    start = time.perf_counter()
    single = {name: train_single_process(cls, cfg, args.seed)
              for name, cls in LIBRARIES.items()}
    sharded = run_on_ranks(args.nproc, sharded_rank, cfg, args.seed,
                           collective_timeout=args.timeout)[0]
    metrics: Dict[str, Any] = {
        "config": dataclasses.asdict(cfg), "seed": args.seed, "nproc": args.nproc,
        "chance_recall10": TOP_K / cfg.items,
        "runs": {"single process": single, f"DMP, {args.nproc} ranks": sharded},
        "wall_seconds": time.perf_counter() - start}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    metrics["plot"] = str(plot(metrics, args.out_dir / "two_tower_swap.png"))
    metrics["json"] = str(args.out_dir / "two_tower_swap.json")
    Path(metrics["json"]).write_text(json.dumps(metrics, indent=1))
    print_summary(metrics)
    return metrics


if __name__ == "__main__":
    main()
