"""Train TorchRec's DLRM on click logs in the Criteo format, its sparse arch on dynamic tables
sharded row-wise over several ranks, under TorchRec's ``TrainPipelineSparseDist``.

The model is ``torchrec.models.dlrm.DLRM`` as it comes: a dense arch over the 13 integer
features, one embedding bag per categorical feature, pairwise dot-product interactions and an
over arch giving one logit. Only its ``EmbeddingBagCollection`` is replaced, by a
:class:`~dynemb.DynamicEmbBagCollection` with one table per categorical feature: the hex
strings of the file become raw 64-bit ids (``dlrm_data.hash_strings``, no modulo, no
vocabulary), and each table keeps a row for every id it has seen, up to ``--table-rows``
rows (then the least recently used rows make room).

The collection is built on the meta device, planned by TorchRec's planner with dynemb's
estimators (:func:`dynemb.planning.make_planner`) and sharded by ``DistributedModelParallel``
with :class:`~dynemb.sharding.DynamicEmbBagCollectionSharder`: every id goes to the rank that
owns it, that rank pools its share of each bag, and TorchRec's pooled reduce-scatter adds the
partial sums, so one vector per sample and feature travels back, not one per id. The rows
train with the fused row-wise AdaGrad inside backward, the dense and over arch with Adam
(data parallel).

Data: without ``--data`` a synthetic Criteo-format file is written first
(``dlrm_data.write_synthetic_criteo``: labels drawn from hidden per-value effects of a few
features, so learning is visible and the best reachable AUC is known); ``--data PATH`` reads
a Criteo-format TSV (``label, I1..I13, C1..C26``; ``.gz`` too) or, with ``--format
movielens``, MovieLens ratings. A fixed hash of the line number holds out a share of the
lines (``--eval-fraction``); each rank reads every ``world``-th training batch of the file,
so the ranks see different examples, and the ranks stop together when the first of them runs
out. Malformed lines stop the run with the file and line named, or are skipped and counted
with ``--skip-malformed``.

Every ``--eval-every`` steps (and before the first) the pipeline drains and the model is
evaluated on the held-out lines (eval mode, which stores nothing): each rank scores its share,
the predictions are gathered, and AUC (torchmetrics) and log loss are reported next to the log
loss of a constant predictor (the training positive rate).

Run (one command; the ranks are spawned here, CPU and gloo)::

    python examples/train_dlrm.py                        # 2 ranks, synthetic data, ~2 minutes
    python examples/train_dlrm.py --quick                # seconds-long smoke run
    python examples/train_dlrm.py --data day_0.gz --steps 20000 --nproc 2
    python examples/train_dlrm.py --data ratings.dat --format movielens --epochs 3

On GPUs, launch it with torchrun (one process per GPU; NCCL and CUDA are picked up from the
environment torchrun sets; the synthetic file is written by each machine's first rank)::

    torchrun --nproc_per_node 8 examples/train_dlrm.py --data day_0.gz

Writes ``<out-dir>/train_dlrm.png`` (training loss, held-out AUC and log loss over the steps)
and ``<out-dir>/train_dlrm.json`` (the metrics and the table counters summed over ranks);
``main()`` returns the metrics on rank 0.
"""
from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning: the CPU ranks of one machine share its cores,
# and spinning threads of one rank slow the others several times over. Read when the OpenMP
# runtime loads (with torch), so set before importing it; spawned ranks get it from
# spawn.run_on_ranks, ranks started by torchrun from here.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dlrm_data import (Batch, BatchReader, DataFormat, held_out_mask,  # noqa: E402
                       write_synthetic_criteo)
from rank_setup import jsonable, prepare_rank  # noqa: E402
from spawn import (add_device_argument, add_timeout_argument, rank_device,  # noqa: E402
                   require_positive, run_in_process_group, run_on_ranks)

OUT_DIR = Path(__file__).resolve().parent / "output"
DEFAULT_NPROC = 2


@dataclass(frozen=True)
class Config:
    """A run's sizes. ``rows``: lines of the synthetic file (ignored with ``--data``);
    ``steps``: at most this many steps per rank (None: as many as the epochs give)."""

    rows: int
    batch: int                    # examples per rank and step
    eval_every: int
    eval_rows: int                # held-out examples scored at each evaluation (at most)
    steps: Optional[int] = None
    epochs: int = 1
    dim: int = 16
    dense_arch: Tuple[int, ...] = (64, 16)     # the last size is ``dim``
    over_arch: Tuple[int, ...] = (128, 64, 1)
    table_rows: int = 1 << 16     # most rows of each table, over all ranks
    embedding_lr: float = 0.05
    dense_lr: float = 1e-3
    eval_fraction: float = 0.1


#: The synthetic file's largest features have more ids than ``table_rows``, so their tables
#: fill up and evict (the rarest ids, which carry little signal, at no loss of held-out AUC)
FULL = Config(rows=600_000, batch=512, eval_every=75, eval_rows=40_000)
QUICK = Config(rows=40_000, batch=256, eval_every=20, eval_rows=4_000)
#: Rows per table with ``--data``: enough for a day of Criteo's most frequent ids (memory
#: grows only as ids arrive; the tables start at a few thousand rows)
DATA_TABLE_ROWS = 1 << 20


# -- model -------------------------------------------------------------------------------------
def build_collection(features: Iterable[str], cfg: Config, seed: int):
    """One dynamic table per categorical feature, on the meta device (sharding builds the
    real tables on each rank): rows appear on first sight, the least recently used make room
    once a table holds ``cfg.table_rows``."""
    from torchrec import EmbeddingBagConfig, PoolingType

    from dynemb import (DynamicEmbBagCollection, DynamicEmbTableOptions, Initializer,
                        InitializerKind, OptimizerConfig, OptimizerType)
    tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=cfg.dim,
                                 num_embeddings=cfg.table_rows, feature_names=[f],
                                 pooling=PoolingType.SUM) for f in features]
    # start small and grow (doubling) as ids arrive: most features have far fewer ids than
    # the limit; rows start near zero, as in DLRM's uniform(+-1/sqrt(rows)) init at scale
    start = Initializer(InitializerKind.UNIFORM, low=-0.01, high=0.01)
    options = DynamicEmbTableOptions(init_capacity=4096, initializer=start, seed=seed)
    optimizer = OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD, learning_rate=cfg.embedding_lr)
    return DynamicEmbBagCollection(tables, device=torch.device("meta"),
                                   table_options={t.name: options for t in tables},
                                   optimizer=optimizer)


class DLRMTrain(torch.nn.Module):
    """DLRM plus its loss. The forward takes a ``dlrm_data.Batch`` and returns
    ``(loss, (loss, logits, labels))`` (detached), as TorchRec's pipelines expect; the sparse
    arch reads ``batch.sparse`` only, so the pipeline can run its input distribution a batch
    ahead."""

    def __init__(self, dense_features: int, ebc, cfg: Config, device: torch.device):
        super().__init__()
        from torchrec.models.dlrm import DLRM
        self.model = DLRM(embedding_bag_collection=ebc, dense_in_features=dense_features,
                          dense_arch_layer_sizes=list(cfg.dense_arch),
                          over_arch_layer_sizes=list(cfg.over_arch), dense_device=device)

    def forward(self, batch: Batch):
        logits = self.model(batch.dense, batch.sparse).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)

    @property
    def ebc(self):
        return self.model.sparse_arch.embedding_bag_collection


def shard(model: DLRMTrain, cfg: Config, device: torch.device, mean_ids: float):
    """Plan with TorchRec's planner and dynemb's estimators, then shard with
    ``DistributedModelParallel`` (the dense and over arch become data parallel)."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import ParameterConstraints, Topology
    from torchrec.distributed.types import PipelineType, ShardingEnv

    from dynemb.planning import dynemb_constraints, make_planner
    from dynemb.sharding import DynamicEmbBagCollectionSharder
    world_size = dist.get_world_size()
    sharders = [DynamicEmbBagCollectionSharder()]
    topology = Topology(world_size=world_size, compute_device=device.type,
                        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    constraints = dynemb_constraints(model, {
        t.name: ParameterConstraints(pooling_factors=[mean_ids])
        for t in model.ebc.embedding_bag_configs()})
    planner = make_planner(topology, constraints, batch_size=cfg.batch,
                           pipeline_type=PipelineType.TRAIN_SPARSE_DIST, log_footprint=False)
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    if dist.get_rank() == 0:
        shardings = plan.plan["model.sparse_arch.embedding_bag_collection"]
        kinds = {(ps.sharding_type, ps.compute_kernel, tuple(ps.ranks or ()))
                 for ps in shardings.values()}
        for sharding_type, kernel, ranks in sorted(kinds):
            print(f"plan: {len(shardings)} tables {sharding_type} over ranks {list(ranks)}, "
                  f"kernel {kernel}", flush=True)
    return DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD), device=device,
        plan=plan, sharders=sharders)


def combined_optimizer(dmp, lr: float):
    """The tables' fused optimizer (applied inside backward; ``step`` does nothing) next to
    Adam for the dense parameters."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    return CombinedOptimizer([
        dmp.fused_optimizer,
        KeyedOptimizerWrapper(dense, lambda ps: torch.optim.Adam(ps, lr=lr))])


# -- data --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DataSource:
    """The file the ranks read, and what is known of it (the synthetic file's summary)."""

    path: str
    format: str
    synthetic: Optional[Dict[str, Any]] = None


def prepare_data(args: argparse.Namespace, cfg: Config, rank: int) -> Tuple[DataSource,
                                                                             Optional[Path]]:
    """The file to read: ``--data``, or a synthetic Criteo-format file
    ``<out-dir>/synthetic_criteo.tsv`` that the first rank of each machine writes (the same
    bytes everywhere); the second value is the file this rank removes at the end, if any."""
    if args.data is not None:
        return DataSource(str(args.data), args.format), None
    path = args.out_dir / "synthetic_criteo.tsv"
    local_first = int(os.environ.get("LOCAL_RANK", rank)) == 0
    summary: List[Any] = [None]
    if local_first:
        if rank == 0:
            print(f"writing {cfg.rows} synthetic Criteo-format lines to {path}", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        summary = [dataclasses.asdict(write_synthetic_criteo(path, cfg.rows, seed=args.seed))]
    dist.broadcast_object_list(summary, src=0)     # also: every file is written
    return (DataSource(str(path), DataFormat.CRITEO.value, summary[0]),
            path if local_first else None)


class TogetherUntilOneRunsOut:
    """Iterate ``batches`` while every rank still has one: before each batch the ranks agree
    (one all-reduce on a side group) whether all of them have it, so they all stop at the
    same step (a rank that stopped early would leave the others waiting in a collective)."""

    def __init__(self, batches: Iterator[Batch], group, device: torch.device):
        self.batches, self.group, self.device = batches, group, device
        self.done = False

    def __iter__(self) -> "TogetherUntilOneRunsOut":
        return self

    def __next__(self) -> Batch:
        if self.done:
            raise StopIteration
        batch = next(self.batches, None)
        flag = torch.tensor([0 if batch is None else 1], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        if int(flag) == 0:
            self.done = True
            raise StopIteration
        return batch


def training_batches(source: DataSource, cfg: Config, args: argparse.Namespace, rank: int,
                     world_size: int, readers: List[BatchReader]) -> Iterator[Batch]:
    """This rank's training batches, epoch after epoch (every ``world_size``-th batch of the
    training split; full batches only). Each epoch's reader is appended to ``readers``."""
    for _ in range(cfg.epochs):
        reader = BatchReader(source.path, cfg.batch, format=source.format, split="train",
                             eval_fraction=cfg.eval_fraction,
                             skip_malformed=args.skip_malformed, drop_last=True, rank=rank,
                             world_size=world_size)
        readers.append(reader)
        yield from reader


def held_out_batches(source: DataSource, cfg: Config, args: argparse.Namespace, rank: int,
                     world_size: int) -> Tuple[List[Batch], int, int]:
    """This rank's share of the held-out examples (at most ``cfg.eval_rows`` in all), in as
    many batches as every other rank's (a rank with fewer repeats its first, whose
    predictions are dropped); returns ``(batches, real batches, skipped lines)``."""
    reader = BatchReader(source.path, cfg.batch, format=source.format, split="eval",
                         eval_fraction=cfg.eval_fraction, skip_malformed=args.skip_malformed)
    everything: List[Batch] = []
    rows = 0
    for batch in reader:
        everything.append(batch)
        rows += len(batch.labels)
        if rows >= cfg.eval_rows:
            break
    if not everything:
        raise ValueError(f"{source.path}: no held-out lines (eval fraction "
                         f"{cfg.eval_fraction}); use a larger file or --eval-fraction")
    mine = everything[rank::world_size]
    count = math.ceil(len(everything) / world_size)
    return mine + [everything[0]] * (count - len(mine)), len(mine), reader.skipped_lines


# -- evaluation --------------------------------------------------------------------------------
def log_loss(probabilities: torch.Tensor, labels: torch.Tensor) -> float:
    """Binary cross-entropy of probabilities (clamped away from 0 and 1, as a log loss must)."""
    p = probabilities.double().clamp(1e-7, 1 - 1e-7)
    return float(torch.nn.functional.binary_cross_entropy(p, labels.double()))


@torch.no_grad()
def evaluate(dmp, held_out: List[Batch], real: int) -> Dict[str, float]:
    """Held-out AUC and log loss: each rank scores its batches in eval mode (the tables store
    nothing; ids never seen score with a zero row), the predictions of all ranks are
    gathered, and the metrics computed over them all."""
    from torchmetrics.classification import BinaryAUROC
    was_training = dmp.training
    dmp.eval()
    model: DLRMTrain = dmp.module
    probs, labels = [], []
    for i, batch in enumerate(held_out):
        logits = model.model(batch.dense, batch.sparse).squeeze(-1)
        if i < real:
            probs.append(torch.sigmoid(logits).float().cpu())
            labels.append(batch.labels.cpu())
    dmp.train(was_training)
    mine = (torch.cat(probs) if probs else torch.zeros(0),
            torch.cat(labels) if labels else torch.zeros(0))
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    p = torch.cat([e[0] for e in everyone])
    y = torch.cat([e[1] for e in everyone])
    auroc = BinaryAUROC()
    auroc.update(p, y.long())
    return {"auc": float(auroc.compute()), "log_loss": log_loss(p, y), "examples": len(y),
            "positive_rate": float(y.mean())}


def summed_stats(ebc) -> Dict[str, Any]:
    """Each table's counters summed over the ranks (one gather), and their totals over the
    tables."""
    mine = ebc.stats()
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    tables: Dict[str, Dict[str, Any]] = {}
    for name in mine:
        merged: Dict[str, Any] = {}
        for key, value in mine[name].items():
            if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
                merged[key] = sum(int(r[name][key]) for r in everyone)
            elif key != "load_factor":
                merged[key] = value
        tables[name] = merged
    counted = [k for k, v in next(iter(tables.values())).items()
               if isinstance(v, int) and k != "device_capacity"]
    total = {k: sum(t[k] for t in tables.values()) for k in counted}
    per_rank_rows = [sum(int(t["rows_device"]) + int(t["rows_backing"]) for t in r.values())
                     for r in everyone]
    return {"tables": tables, "total": total, "rows_per_rank": per_rank_rows}


# -- training ----------------------------------------------------------------------------------
def train(rank: int, world_size: int, cfg: Config, args: argparse.Namespace,
          device: torch.device) -> Optional[Dict[str, Any]]:
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    torch.manual_seed(args.seed)          # the same dense start on every rank
    source, written = prepare_data(args, cfg, rank)
    try:
        probe = BatchReader(source.path, 1, format=source.format)
        held_out, real, eval_skipped = held_out_batches(source, cfg, args, rank, world_size)
        ids = held_out[0].sparse.values().numel() / len(held_out[0].labels)
        model = DLRMTrain(probe.dense_features, build_collection(probe.feature_names, cfg,
                                                                 args.seed), cfg, device)
        dmp = shard(model, cfg, device, mean_ids=ids / len(probe.feature_names))
        optimizer = combined_optimizer(dmp, cfg.dense_lr)
        pipeline = TrainPipelineSparseDist(dmp, optimizer, device)
        if rank == 0:
            print(f"{world_size} ranks ({device.type}, {dist.get_backend()}), "
                  f"{type(pipeline).__name__}; data {source.path} ({source.format}); "
                  f"{len(probe.feature_names)} tables of dim {cfg.dim}, at most "
                  f"{cfg.table_rows} rows each; batch {cfg.batch} per rank", flush=True)
        metrics = run_training(rank, world_size, cfg, args, source, dmp, pipeline, held_out,
                               real)
        metrics["eval_skipped_lines"] = eval_skipped
        stats = summed_stats(dmp.module.ebc)
        dist.barrier()      # every rank is done reading before the synthetic file goes
    finally:
        if written is not None:
            written.unlink(missing_ok=True)
    if rank != 0:
        return None
    metrics.update({"world_size": world_size, "backend": dist.get_backend(),
                    "device": device.type, "pipeline": type(pipeline).__name__,
                    "batch_per_rank": cfg.batch, "config": dataclasses.asdict(cfg),
                    "data": dataclasses.asdict(source), "stats": stats["total"],
                    "rows_per_rank": stats["rows_per_rank"], "tables": stats["tables"]})
    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics["plot"] = str(plot(metrics, out_dir / "train_dlrm.png"))
    metrics["json"] = str(out_dir / "train_dlrm.json")
    Path(metrics["json"]).write_text(json.dumps(metrics, indent=1, default=jsonable))
    print_summary(metrics)
    return metrics


def run_training(rank: int, world_size: int, cfg: Config, args: argparse.Namespace,
                 source: DataSource, dmp, pipeline,
                 held_out: List[Batch], real: int) -> Dict[str, Any]:
    """The training loop: windows of ``cfg.eval_every`` steps under the pipeline, each
    followed by an evaluation; returns the metrics (the same on every rank)."""
    from tqdm import tqdm
    side = dist.new_group(backend="gloo")            # the ranks' "do you have a batch" votes
    readers: List[BatchReader] = []
    batches = TogetherUntilOneRunsOut(
        training_batches(source, cfg, args, rank, world_size, readers), side,
        torch.device("cpu"))
    losses: List[float] = []
    positives = torch.zeros(2, dtype=torch.float64)   # [positive labels, examples] seen
    curve = [dict(step=0, **evaluate(dmp, held_out, real))]
    if rank == 0:
        tqdm.write(f"step     0  held-out AUC {curve[0]['auc']:.4f}  log loss "
                   f"{curve[0]['log_loss']:.4f}")
    total = planned_steps(source, cfg, world_size)
    limit = total if total is not None else float("inf")
    bar = tqdm(total=total, desc="train", unit="step", mininterval=0.5, dynamic_ncols=True,
               disable=rank != 0)
    start = time.perf_counter()
    step = 0
    while step < limit and not batches.done:
        window = int(min(cfg.eval_every, limit - step))
        if limit - step - window < cfg.eval_every // 4:
            window = int(limit - step)          # no evaluation a few steps before the last
        it = (b for _, b in zip(range(window), batches))
        while True:
            try:
                loss, _, labels = pipeline.progress(it)
            except StopIteration:
                break
            losses.append(float(loss))
            positives += torch.tensor([float(labels.sum()), float(labels.numel())],
                                      dtype=torch.float64)
            step += 1
            bar.update()
            bar.set_postfix(loss=f"{losses[-1]:.4f}", auc=f"{curve[-1]['auc']:.4f}")
        pipeline.detach()      # drained: evaluate on the plain model with nothing in flight
        if step > curve[-1]["step"]:
            curve.append(dict(step=step, **evaluate(dmp, held_out, real)))
            if rank == 0:
                recent = np.mean(losses[curve[-2]["step"]:])
                tqdm.write(f"step {step:5d}  train loss {recent:.4f}  held-out AUC "
                           f"{curve[-1]['auc']:.4f}  log loss {curve[-1]['log_loss']:.4f}")
        pipeline.attach()
    bar.close()
    seconds = time.perf_counter() - start

    all_losses: List[Any] = [None] * world_size
    dist.all_gather_object(all_losses, losses)
    mean_losses = np.mean(np.asarray(all_losses, dtype=np.float64), axis=0).tolist()
    dist.all_reduce(positives)
    skipped = torch.tensor([sum(r.skipped_lines for r in readers)], dtype=torch.int64)
    rate = float(positives[0] / positives[1]) if positives[1] > 0 else 0.5
    final = curve[-1]
    # the constant prediction p (the training positive rate) scores
    # -(r log p + (1 - r) log(1 - p)) on held-out labels with positive rate r
    r, p = final["positive_rate"], min(max(rate, 1e-7), 1 - 1e-7)
    constant = -(r * math.log(p) + (1 - r) * math.log(1 - p))
    return {
        "steps": step,
        "examples_per_rank": step * cfg.batch,
        "train_seconds": seconds,
        "steps_per_second": step / seconds if seconds > 0 else float("nan"),
        "train_positive_rate": rate,
        "skipped_lines": int(skipped),      # every rank counts every malformed line
        "losses": mean_losses,
        "curve": curve,
        "initial": curve[0],
        "final": final,
        "constant_log_loss": constant,
        "held_out_examples": final["examples"],
    }


def planned_steps(source: DataSource, cfg: Config, world_size: int) -> Optional[int]:
    """The steps of the run where they are known: ``cfg.steps``, or what the synthetic file
    gives (one step per ``world_size`` full batches of its training lines, each epoch); None
    for a given file, which is read until a rank runs out."""
    if source.synthetic is None:
        return cfg.steps
    rows = source.synthetic["rows"]
    training = rows - int(held_out_mask(np.arange(1, rows + 1), cfg.eval_fraction).sum())
    steps = training // cfg.batch // world_size * cfg.epochs
    return steps if cfg.steps is None else min(cfg.steps, steps)


def print_summary(m: Dict[str, Any]) -> None:
    first, last = m["initial"], m["final"]
    n = max(1, min(50, len(m["losses"]) // 4))
    losses = m["losses"]
    print(f"\n{m['world_size']} ranks, {m['pipeline']}, batch {m['batch_per_rank']} per rank, "
          f"{m['steps']} steps in {m['train_seconds']:.1f} s "
          f"({m['steps_per_second']:.1f} steps/s); loss averaged over ranks")
    if losses:
        print(f"train loss: first {n} steps {np.mean(losses[:n]):.4f}, last {n} steps "
              f"{np.mean(losses[-n:]):.4f}")
    print(f"held-out ({m['held_out_examples']} examples, {last['positive_rate']:.3f} "
          f"positive): AUC {first['auc']:.4f} -> {last['auc']:.4f}, log loss "
          f"{first['log_loss']:.4f} -> {last['log_loss']:.4f} (constant predictor "
          f"{m['constant_log_loss']:.4f})")
    synthetic = m["data"]["synthetic"]
    if synthetic:
        print(f"synthetic data: best reachable (Bayes) AUC {synthetic['bayes_auc']:.4f}, "
              f"log loss {synthetic['bayes_log_loss']:.4f}")
    if m["skipped_lines"] or m["eval_skipped_lines"]:
        print(f"malformed lines skipped: {m['skipped_lines']} training, "
              f"{m['eval_skipped_lines']} held-out")
    s = m["stats"]
    print(f"tables (summed over ranks and tables): {s['rows_device']} rows, "
          f"{s['inserts']} inserts, {s['evictions']} evictions, {s['lookups']} ids looked up; "
          f"rows per rank {m['rows_per_rank']}")
    full = {name: t for name, t in m["tables"].items() if t["evictions"]}
    if full:
        print(f"tables at their {m['config']['table_rows']} rows (least recently used evicted): "
              + ", ".join(f"{name} ({t['evictions']} evictions)" for name, t in full.items()))
    print(f"wrote {m['plot']} and {m['json']}")


def plot(m: Dict[str, Any], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_loss, ax_auc) = plt.subplots(1, 2, figsize=(11, 4))
    losses = np.asarray(m["losses"])
    if len(losses):
        ax_loss.plot(np.arange(1, len(losses) + 1), losses, alpha=0.3, label="train (step)")
        k = max(1, len(losses) // 20)
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax_loss.plot(np.arange(k, len(losses) + 1), smooth, label=f"train ({k}-step mean)")
    steps = [c["step"] for c in m["curve"]]
    ax_loss.plot(steps, [c["log_loss"] for c in m["curve"]], "o-", label="held-out")
    ax_loss.axhline(m["constant_log_loss"], ls="--", color="gray", label="constant predictor")
    synthetic = m["data"]["synthetic"]
    if synthetic:
        ax_loss.axhline(synthetic["bayes_log_loss"], ls=":", color="black", label="Bayes")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("log loss")
    ax_loss.legend()
    ax_auc.plot(steps, [c["auc"] for c in m["curve"]], "o-", label="held-out")
    ax_auc.axhline(0.5, ls="--", color="gray", label="random")
    if synthetic:
        ax_auc.axhline(synthetic["bayes_auc"], ls=":", color="black", label="Bayes")
    ax_auc.set_xlabel("step")
    ax_auc.set_ylabel("AUC")
    ax_auc.legend()
    fig.suptitle(f"DLRM on dynamic tables, {m['world_size']} ranks, batch "
                 f"{m['batch_per_rank']} per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# -- processes ---------------------------------------------------------------------------------
def train_rank(rank: int, world_size: int, args: argparse.Namespace,
               cfg: Config) -> Optional[Dict[str, Any]]:
    """Train on this rank of a joined process group; rank 0 returns the metrics."""
    device = rank_device(args.device)
    prepare_rank(device)
    return train(rank, world_size, cfg, args, device)


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path,
                        help="a Criteo-format TSV (or MovieLens file with --format); default: "
                             "a synthetic Criteo-format file written for the run")
    parser.add_argument("--format", choices=[f.value for f in DataFormat],
                        default=DataFormat.CRITEO.value, help="the format of --data")
    parser.add_argument("--skip-malformed", action="store_true",
                        help="skip and count malformed lines instead of stopping at the first")
    parser.add_argument("--rows", type=int,
                        help=f"lines of the synthetic file (default {FULL.rows}; quick "
                             f"{QUICK.rows})")
    parser.add_argument("--steps", type=int, help="at most this many steps (default: the "
                                                  "epochs)")
    parser.add_argument("--epochs", type=int, help="passes over the training lines "
                                                   "(default 1)")
    parser.add_argument("--batch", type=int, help=f"examples per rank and step (default "
                                                  f"{FULL.batch})")
    parser.add_argument("--eval-every", type=int, help=f"steps between evaluations (default "
                                                       f"{FULL.eval_every})")
    parser.add_argument("--eval-fraction", type=float,
                        help=f"share of the lines held out (default {FULL.eval_fraction})")
    parser.add_argument("--table-rows", type=int,
                        help=f"most rows of each table over all ranks (default "
                             f"{FULL.table_rows}, with --data {DATA_TABLE_ROWS}); the least "
                             f"recently used make room")
    parser.add_argument("--quick", action="store_true", help="small file, seconds-long run")
    parser.add_argument("--nproc", type=int, default=DEFAULT_NPROC,
                        help=f"CPU ranks to spawn (default {DEFAULT_NPROC}); ignored under "
                             f"torchrun")
    add_device_argument(parser)
    parser.add_argument("--seed", type=int, default=0)
    add_timeout_argument(parser)
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR,
                        help=f"where the plot and the metrics go (default {OUT_DIR})")
    args = parser.parse_args(argv)
    require_positive(parser, args, "rows", "steps", "epochs", "batch", "eval_every",
                     "table_rows", "nproc")
    if args.eval_fraction is not None and not 0 < args.eval_fraction < 1:
        parser.error("--eval-fraction must be in (0, 1)")
    if args.data is not None and not args.data.is_file():
        parser.error(f"--data {args.data}: no such file")
    if args.data is None and args.format != DataFormat.CRITEO.value:
        parser.error("--format applies to --data (the synthetic file is Criteo-format)")
    return args


def config(args: argparse.Namespace) -> Config:
    cfg = QUICK if args.quick else FULL
    changes = {name: getattr(args, name) for name in ("rows", "steps", "epochs", "batch",
                                                      "eval_every", "eval_fraction",
                                                      "table_rows")
               if getattr(args, name) is not None}
    if args.data is not None:
        changes.setdefault("table_rows", DATA_TABLE_ROWS)
    return dataclasses.replace(cfg, **changes)


def main(argv: Optional[List[str]] = None) -> Optional[Dict[str, Any]]:
    """Train on the ranks of a torchrun launch, or spawn ``--nproc`` CPU ranks; returns the
    metrics (on rank 0 / in the spawning process)."""
    args = parse_args(argv)
    cfg = config(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:   # launched by torchrun
        return run_in_process_group(train_rank, args, cfg, device=rank_device(args.device),
                                    collective_timeout=args.timeout)
    args.device = "cpu"
    start = time.perf_counter()
    metrics = run_on_ranks(args.nproc, train_rank, args, cfg,
                           collective_timeout=args.timeout)[0]
    metrics["wall_seconds"] = time.perf_counter() - start
    print(f"wall time {metrics['wall_seconds']:.1f} s (start-up, data, training, evaluation)")
    return metrics


if __name__ == "__main__":
    main()
