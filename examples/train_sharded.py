"""Train the next-item recommender of ``train_next_item.py`` with its tables sharded row-wise
over several ranks, under TorchRec's ``TrainPipelineSparseDist``.

The data, the tables and the model are ``train_next_item.py``'s (imported from it): raw
random 64-bit item ids with Zipf popularity and hidden clusters; an ``items`` table in CACHE
mode (each rank caches a few thousand rows of its share over a host backing store) read by the
history and target features, and a ``users`` table with frequency admission; an MLP over the
pooled history and the user scores the target against in-batch negatives.

What changes is the distribution: the ``DynamicEmbCollection`` is built on the meta device,
TorchRec's planner (with dynemb's estimators, :func:`dynemb.planning.make_planner`) plans it,
``DistributedModelParallel`` shards it with :class:`~dynemb.sharding.DynamicEmbCollectionSharder`
(every rank owns the ids that hash to it), and ``TrainPipelineSparseDist`` overlaps the next
batch's id all-to-all with the current step. Each rank draws its own batches from the same
stream; the embedding rows train with the fused row-wise AdaGrad inside backward, the MLP with
Adam (data parallel).

Every few hundred steps the pipeline drains and the model is evaluated on a held-out stream
(eval mode, which stores nothing): each rank reads the item rows it owns, the ranks sum them
into the whole catalog, and each scores its half of the held-out examples; HR@10 is reported
next to a popularity baseline and a "cluster oracle" ceiling.

Run (one command; the ranks are spawned here, CPU and gloo)::

    python examples/train_sharded.py                 # 2 ranks, about a minute on 2 cores
    python examples/train_sharded.py --quick         # seconds-long smoke run
    python examples/train_sharded.py --nproc 4 --pipeline prefetch
    python examples/train_sharded.py --resume --nproc 3   # continue the last run on 3 ranks
    python examples/train_sharded.py --disk /nvme/emb --host-cache-mb 64   # items on disk

On GPUs, launch it with torchrun (one process per GPU; NCCL and CUDA are picked up from the
environment torchrun sets)::

    torchrun --nproc_per_node 8 examples/train_sharded.py

Every ``--metrics-every`` steps the tables' metrics over the interval
(:class:`dynemb.metrics.DynamicTableMetrics`, summed over the ranks: hit rate, load factor,
inserts, evictions, write-backs, loads, admission rejects) are logged to the JSON and, with
``--tensorboard DIR``, written as TensorBoard scalars (``pip install 'dynemb[metrics]'``)::

    python examples/train_sharded.py --tensorboard runs/sharded   # then: tensorboard --logdir runs

Writes ``<out-dir>/train_sharded.png`` (loss and HR@10 curves, the tables' hit rate and load
factor over the steps), ``train_sharded.json`` (the metrics, the table counters summed over
ranks and per rank, the tables' metrics per interval) and ``<out-dir>/checkpoint``
(``torch.distributed.checkpoint`` of the whole model and optimizer: ``--resume`` continues
from it, on any number of ranks); ``main()`` returns the metrics on rank 0.
"""
from __future__ import annotations

import os

# On CPU the ranks share the cores: torch's and numba's OpenMP threads must sleep, not spin,
# when idle (spinning made a torchrun --quick run 9x slower on 2 cores). The runtime reads
# this once, when torch loads it, so it is set before the import; spawned ranks have it from
# spawn.run_on_ranks.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Dict, Iterator, List, Optional  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist
from torchrec.distributed.types import LazyAwaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rank_setup import jsonable, prepare_rank  # noqa: E402
from spawn import (add_device_argument, add_timeout_argument, rank_device,  # noqa: E402
                   require_positive, run_in_process_group, run_on_ranks)
from dynemb.metrics import DynamicTableMetrics, TensorBoardWriter  # noqa: E402
from dynemb.metrics.tensorboard import summary_writer  # noqa: E402
from train_next_item import (DENSE_LR, OUT_DIR, TOP_K, Config, CountSketch,  # noqa: E402
                             NextItemModel, SessionWorld, build_collection, evaluation_steps,
                             in_batch_loss, plot, print_summary, run_metrics, to_kjt)

#: Each rank takes the single-process run's batch (256), so a step sees twice the examples
#: and 2000 steps reach the HR@10 its 3000 do.
FULL = Config(steps=2000, batch=256, eval_every=250, eval_examples=2000, items=20_000,
              clusters=200, users=50_000, cache_rows=4096)
QUICK = Config(steps=120, batch=128, eval_every=40, eval_examples=500, items=2000,
               clusters=40, users=5000, cache_rows=1024)
DEFAULT_NPROC = 2
PIPELINES = ("sparse_dist", "prefetch")


# -- batches -----------------------------------------------------------------------------------
@dataclass
class Batch(Pipelineable):
    """One rank's training batch: the features, the target ids and their log-Q correction."""

    features: KeyedJaggedTensor
    target_ids: torch.Tensor
    log_q: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        return Batch(self.features.to(device=device, non_blocking=non_blocking),
                     self.target_ids.to(device=device, non_blocking=non_blocking),
                     self.log_q.to(device=device, non_blocking=non_blocking))

    def record_stream(self, stream) -> None:
        self.features.record_stream(stream)
        self.target_ids.record_stream(stream)
        self.log_q.record_stream(stream)

    def pin_memory(self) -> "Batch":
        return Batch(self.features.pin_memory(), self.target_ids.pin_memory(),
                     self.log_q.pin_memory())


def batches(world: SessionWorld, cfg: Config, rng: np.random.Generator, sketch: CountSketch,
            count: int) -> Iterator[Batch]:
    """``count`` training batches of this rank (on the host; the pipeline moves them). The
    sketch counts every target as its batch is drawn, and the log-Q of a batch's targets is
    read right after."""
    for _ in range(count):
        part = world.sample(cfg.batch, cfg.max_history, rng)
        target_ids = torch.from_numpy(part["target"])
        sketch.add(target_ids.to(sketch.counts.device))
        log_q = torch.log(sketch[target_ids.to(sketch.counts.device)] / sketch.total).cpu()
        yield Batch(to_kjt(part, torch.device("cpu")), target_ids, log_q)


# -- model -------------------------------------------------------------------------------------
class LookedUp(torch.nn.Module):
    """Stands where ``NextItemModel`` keeps its collection: the embeddings reach the tower
    already looked up (by the sharded collection, outside). A sharded collection returns a
    lazy awaitable of its dict, which is resolved here (the tower indexes the dict)."""

    def forward(self, emb):
        return emb.wait() if isinstance(emb, LazyAwaitable) else emb


class NextItemLoss(torch.nn.Module):
    """``train_next_item``'s tower and loss over embeddings looked up elsewhere. It holds no
    sharded module, so TorchRec's pipeline treats it as one opaque call when it traces the
    model (the tower's shape arithmetic is not traceable)."""

    def __init__(self, dim: int):
        super().__init__()
        self.model = NextItemModel(LookedUp(), dim)

    def forward(self, emb, target_ids: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        out = self.model(emb)
        return in_batch_loss(out["query"], out["target"], target_ids, log_q)


class ShardedNextItem(torch.nn.Module):
    """Top-level model: the (to be sharded) collection, then the tower and loss. Its forward
    takes a :class:`Batch` and returns ``(loss, loss.detach())``, as TorchRec's pipelines
    expect; the collection reads ``batch.features`` only, so the pipeline can run its input
    distribution a batch ahead."""

    def __init__(self, ec: torch.nn.Module, dim: int):
        super().__init__()
        self.ec = ec
        self.head = NextItemLoss(dim)

    def forward(self, batch: Batch):
        loss = self.head(self.ec(batch.features), batch.target_ids, batch.log_q)
        return loss, loss.detach()

    def query(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """[B, dim] queries of a KJT whose ``user`` and ``history`` have ids (eval)."""
        return self.head.model(self.ec(kjt))["query"]


def shard(model: ShardedNextItem, cfg: Config, device: torch.device):
    """Plan with TorchRec's planner and dynemb's estimators, then shard with
    ``DistributedModelParallel``."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import ParameterConstraints, Topology
    from torchrec.distributed.types import PipelineType, ShardingEnv

    from dynemb.planning import dynemb_constraints, make_planner
    from dynemb.sharding import DynamicEmbCollectionSharder
    world_size = dist.get_world_size()
    sharders = [DynamicEmbCollectionSharder()]
    topology = Topology(world_size=world_size, compute_device=device.type,
                        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    # ids per example: a history of 2..max_history items and one target; one user
    history = (2 + cfg.max_history) / 2
    constraints = dynemb_constraints(model, {
        "items": ParameterConstraints(pooling_factors=[history, 1.0]),
        "users": ParameterConstraints(pooling_factors=[1.0])})
    planner = make_planner(topology, constraints, batch_size=cfg.batch,
                           pipeline_type=PipelineType.TRAIN_SPARSE_DIST, log_footprint=False)
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    if dist.get_rank() == 0:
        for name, ps in plan.plan["ec"].items():
            print(f"plan: table {name!r} {ps.sharding_type} over ranks {ps.ranks}, kernel "
                  f"{ps.compute_kernel}", flush=True)
    return DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD), device=device,
        plan=plan, sharders=sharders)


def combined_optimizer(dmp):
    """The tables' fused optimizer (applied inside backward; ``step`` does nothing) next to
    Adam for the dense parameters."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    parts = [dmp.fused_optimizer]
    if dense:
        parts.append(KeyedOptimizerWrapper(dense, lambda ps: torch.optim.Adam(ps, lr=DENSE_LR)))
    return CombinedOptimizer(parts)


def make_pipeline(kind: str, dmp, optimizer, device: torch.device):
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from dynemb.pipelines import PrefetchTrainPipelineSparseDist
    cls = TrainPipelineSparseDist if kind == "sparse_dist" else PrefetchTrainPipelineSparseDist
    return cls(dmp, optimizer, device)


# -- evaluation --------------------------------------------------------------------------------
@torch.no_grad()
def catalog_rows(model: ShardedNextItem, catalog: torch.Tensor):
    """``(rows [N, dim], stored [N])`` of every catalog item, wherever its owner keeps it:
    each rank reads the rows it owns (others come back not found, as zeros), and the ranks
    sum them (each id has one owner)."""
    rows, stored = model.ec.read_rows("items", catalog)
    rows = torch.where(stored[:, None], rows.float(), 0.0)
    stored = stored.to(torch.int32)
    dist.all_reduce(rows)
    dist.all_reduce(stored)
    return rows, stored > 0


@torch.no_grad()
def sharded_hit_rate(dmp, examples: Dict[str, np.ndarray], catalog: torch.Tensor,
                     device: torch.device, chunks: int = 2) -> float:
    """HR@10 over the whole catalog (as ``train_next_item.hit_rate``): every rank scores its
    share of the held-out examples in the same number of eval forwards (they are
    collectives), and the hits are summed over the ranks."""
    model: ShardedNextItem = dmp.module
    was_training = dmp.training
    dmp.eval()
    rows, stored = catalog_rows(model, catalog)
    unstored = torch.where(stored, 0.0, float("-inf"))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine = np.array_split(np.arange(len(examples["user"])), world_size)[rank]
    hits = torch.zeros((), dtype=torch.int64, device=device)
    for index in np.array_split(mine, chunks):
        part = {k: v[index] for k, v in examples.items()}
        query = model.query(to_kjt(part, device, with_ids=["user", "history"]))
        scores = query @ rows.T + unstored                                   # [n, N]
        truth = torch.from_numpy(part["target_index"]).to(device)
        rank_of_truth = (scores > scores.gather(1, truth[:, None])).sum(1)
        hits += ((rank_of_truth < TOP_K) & stored[truth]).sum()
    dist.all_reduce(hits)
    dmp.train(was_training)
    return int(hits) / len(examples["user"])


def summed_stats(dmp) -> Dict[str, Any]:
    """Each table's counters summed over the ranks (one gather; its load factor: the device rows
    over the device capacity of all ranks), and each rank's own."""
    mine = dmp.module.ec.stats()
    everyone: List[Dict[str, Any]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)
    total: Dict[str, Any] = {}
    for name in mine:
        merged: Dict[str, Any] = {}
        for key, value in mine[name].items():
            if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
                merged[key] = sum(int(r[name][key]) for r in everyone)
            elif key == "load_factor":  # rows over capacity, all ranks (below)
                merged[key] = float(np.mean([r[name][key] for r in everyone]))
            else:
                merged[key] = value
        if merged.get("device_capacity"):  # (HOST_ONLY: no device rows, the ranks' mean)
            merged["load_factor"] = merged["rows_device"] / merged["device_capacity"]
        total[name] = merged
    return {"total": total, "per_rank": everyone}


# -- checkpoints -------------------------------------------------------------------------------
def save_checkpoint(dmp, optimizer, path: Path, step: int,
                    tables_on_disk: bool = False) -> Dict[str, Any]:
    """The whole model (MLP, dynamic tables with their optimizer state, scores and counters)
    and the optimizers (the dense Adam's state; the tables' learning rate, which their fused
    optimizer's ``state_dict`` holds), with ``torch.distributed.checkpoint``: each rank
    writes its own share. ``tables_on_disk``: the tables, which may not fit in memory, are
    streamed to ``path / "tables"`` by ``dynemb.checkpoint.dump`` instead (a table on disk
    has no ``state_dict``), and DCP saves the rest."""
    import torch.distributed.checkpoint as dcp
    start = time.perf_counter()
    state = {"model": dmp.state_dict()} if not tables_on_disk else {
        "head": dmp.module.head.state_dict()}
    if tables_on_disk:
        from dynemb.checkpoint import dump
        dump(dmp, path / "tables")
    dcp.save({**state, "optim": optimizer.state_dict(),
              "progress": {"step": step, "world_size": dist.get_world_size()}},
             checkpoint_id=str(path))
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return {"path": str(path), "step": step, "mb": size / 2 ** 20,
            "seconds": time.perf_counter() - start, "lr": embedding_lr(dmp)}


def embedding_lr(dmp) -> float:
    """The learning rate the tables' next backward uses."""
    return dmp.module.ec.fused_optimizer.lr


def load_checkpoint(dmp, optimizer, path: Path, tables_on_disk: bool = False) -> Dict[str, Any]:
    """Load a checkpoint of :func:`save_checkpoint`, saved by any number of ranks (each
    dynamic row goes to its owner in this world; training goes on at the saved learning
    rate); returns its progress. Tables on disk come back from their file dump, which loads
    on as many ranks as saved it."""
    import torch.distributed.checkpoint as dcp

    from dynemb.checkpoint import DynamicEmbLoadPlanner, load
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"no checkpoint at {path} (run without --resume first)")
    if tables_on_disk:
        load(dmp, path / "tables")
        model = {"head": dmp.module.head.state_dict()}
    else:
        model = {"model": dmp.state_dict()}
    state = {**model, "optim": optimizer.state_dict(), "progress": {"step": 0, "world_size": 0}}
    dcp.load(state, checkpoint_id=str(path), planner=DynamicEmbLoadPlanner())
    if tables_on_disk:
        dmp.module.head.load_state_dict(state["head"])
    else:
        dmp.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    return state["progress"]


# -- training ----------------------------------------------------------------------------------
class TableLog:
    """The tables' metrics per interval (every rank updates and computes them together:
    the values are summed over the ranks), kept for the JSON and the plot and, on rank 0,
    written to TensorBoard."""

    def __init__(self, dmp, rank: int, tensorboard: Optional[Path]):
        self.metrics = DynamicTableMetrics(dmp)
        self.dmp, self.series = dmp, []
        self.board = (TensorBoardWriter(writer=summary_writer(tensorboard))
                      if tensorboard is not None and rank == 0 else None)
        self.logged_at = None

    def log(self, step: int) -> Dict[str, float]:
        """The interval since the last log (or :meth:`skip`), ending at ``step``."""
        self.metrics.update(self.dmp)
        values = {k: float(v) for k, v in self.metrics.compute().items()}
        self.metrics.reset()
        self.series.append({"step": step, **values})
        if self.board is not None:
            self.board.write(values, step)
        self.logged_at = step
        return values

    def skip(self) -> None:
        """Leave out what the tables counted since the last log (the evaluation's lookups)."""
        self.metrics.update(self.dmp)
        self.metrics.reset()

    def close(self) -> None:
        if self.board is not None:
            self.board.close()


def train(rank: int, world_size: int, cfg: Config, device: torch.device, seed: int,
          out_dir: Path, pipeline_kind: str, resume: Optional[Path] = None,
          disk: Optional[Path] = None, host_cache_mb: int = 0, metrics_every: int = 0,
          tensorboard: Optional[Path] = None) -> Optional[Dict[str, Any]]:
    from tqdm import tqdm
    entered = time.perf_counter()    # a fresh machine's first step includes compiling kernels
    to_first_step = float("nan")
    torch.manual_seed(seed)          # the same MLP start on every rank
    world = SessionWorld(cfg.items, cfg.clusters, cfg.users, seed)
    held_out = world.sample(cfg.eval_examples, cfg.max_history, np.random.default_rng(seed + 2))
    catalog = torch.from_numpy(world.item_ids).to(device)
    sketch = CountSketch(device)

    model = ShardedNextItem(build_collection(cfg, torch.device("meta"), seed, disk,
                                             host_cache_mb), cfg.dim)
    dmp = shard(model, cfg, device)
    optimizer = combined_optimizer(dmp)
    pipeline = make_pipeline(pipeline_kind, dmp, optimizer, device)
    ec = dmp.module.ec
    first_step = 0
    if resume is not None:
        progress = load_checkpoint(dmp, optimizer, resume, tables_on_disk=disk is not None)
        first_step = int(progress["step"])
        if rank == 0:
            print(f"resumed from {resume}: step {first_step}, saved by "
                  f"{progress['world_size']} ranks, loaded on {world_size}; embedding lr "
                  f"{embedding_lr(dmp):g}", flush=True)
    first_lr = embedding_lr(dmp)  # the saved one when resumed
    # each rank its own stream; a resumed run draws batches it has not seen
    train_rng = np.random.default_rng([seed + 1, rank] + ([first_step] if first_step else []))
    if rank == 0:
        modes = ", ".join(f"{n} {m.name}" for n, m in ec.storage_modes().items())
        print(f"{world_size} ranks ({device.type}, {dist.get_backend()}), "
              f"{type(pipeline).__name__}; {cfg.items} items in {cfg.clusters} hidden "
              f"clusters, {cfg.users} users; tables: {modes} (items cache: {cfg.cache_rows} rows "
              f"per rank); batch {cfg.batch} per rank, {cfg.steps} steps", flush=True)

    losses: List[float] = []
    curve = [(0, sharded_hit_rate(dmp, held_out, catalog, device))]
    table_log = TableLog(dmp, rank, tensorboard)  # from here: training intervals only
    metrics_every = metrics_every or max(1, cfg.eval_every // 5)
    cache_rates: List[float] = []
    eval_inserts = 0
    window_start = summed_stats(dmp)["total"]["items"]
    eval_at = sorted(evaluation_steps(cfg.steps, cfg.eval_every))
    start = time.perf_counter()
    bar = tqdm(total=cfg.steps, desc="train", mininterval=0.5, dynamic_ncols=True,
               disable=rank != 0)
    done = 0
    for stop in eval_at:
        # one pipeline run per evaluation window: it drains at the window's end, so the eval
        # forwards below run on the plain (detached) model with nothing in flight
        it = batches(world, cfg, train_rng, sketch, stop - done)
        while True:
            try:
                loss = pipeline.progress(it)     # what the model returns second
            except StopIteration:
                break
            losses.append(float(loss))
            if len(losses) == 1:
                to_first_step = time.perf_counter() - entered
            if len(losses) % metrics_every == 0:
                table_log.log(first_step + len(losses))
            bar.update()
            bar.set_postfix(loss=f"{losses[-1]:.3f}", hr10=f"{curve[-1][1]:.3f}")
        done = stop
        pipeline.detach()
        if table_log.logged_at != first_step + done:
            table_log.log(first_step + done)
        interval = table_log.series[-1]
        now = summed_stats(dmp)["total"]["items"]
        hits = now["hits"] - window_start["hits"]
        cache_rates.append(hits / max(1, hits + now["misses"] - window_start["misses"]))
        curve.append((stop, sharded_hit_rate(dmp, held_out, catalog, device)))
        window_start = summed_stats(dmp)["total"]["items"]
        eval_inserts += window_start["inserts"] - now["inserts"]   # eval mode stores nothing
        table_log.skip()     # the evaluation's lookups are no training interval's
        pipeline.attach()    # the next window's first progress() rewrites the model again
        if rank == 0:
            tqdm.write(f"step {stop:5d}  loss {np.mean(losses[-(stop - (curve[-2][0])):]):.3f}  "
                       f"HR@{TOP_K} {curve[-1][1]:.3f}  items cache hit rate "
                       f"{cache_rates[-1]:.3f} (its last metrics interval "
                       f"{interval['ec/items/hit_rate']:.3f}, load factor "
                       f"{interval['ec/items/load_factor']:.2f})")
    bar.close()
    table_log.close()
    seconds = time.perf_counter() - start

    # the loss curve averaged over ranks; popularity from every rank's stream
    all_losses = [None] * world_size
    dist.all_gather_object(all_losses, losses)
    mean_losses = np.mean(np.asarray(all_losses, dtype=np.float64), axis=0).tolist()
    dist.all_reduce(sketch.counts)
    total = torch.tensor(sketch.total, dtype=torch.int64, device=device)
    dist.all_reduce(total)
    sketch.total = int(total)
    stats = summed_stats(dmp)
    checkpoint = save_checkpoint(dmp, optimizer, out_dir / "checkpoint", first_step + cfg.steps,
                                 tables_on_disk=disk is not None)
    if rank != 0:
        return None
    metrics: Dict[str, Any] = {
        "world_size": world_size,
        "backend": dist.get_backend(),
        "device": device.type,
        "pipeline": type(pipeline).__name__,
        "batch_per_rank": cfg.batch,
        **run_metrics(cfg, seconds, mean_losses, curve, sketch, held_out, catalog, world,
                      cache_rates, eval_inserts),
        "stats": stats["total"],
        "stats_per_rank": stats["per_rank"],
        "first_step": first_step,
        "seconds_to_first_step": to_first_step,
        "first_lr": first_lr,
        "checkpoint": checkpoint,
        "metrics_every": metrics_every,
        "table_metrics": table_log.series,
        "tensorboard": None if tensorboard is None else str(tensorboard),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics["plot"] = str(plot(metrics, out_dir / "train_sharded.png"))
    metrics["json"] = str(out_dir / "train_sharded.json")
    Path(metrics["json"]).write_text(json.dumps(metrics, indent=1, default=jsonable))
    print(f"\n{world_size} ranks, {type(pipeline).__name__}, batch {cfg.batch} per rank; "
          f"loss averaged over ranks, table counters summed over ranks; first step done "
          f"{to_first_step:.1f} s after the rank started training")
    print_summary(metrics)
    print_last_interval(metrics)
    print(f"checkpoint of step {checkpoint['step']}: {checkpoint['path']} "
          f"({checkpoint['mb']:.1f} MB, {checkpoint['seconds']:.2f} s); continue with --resume")
    return metrics


def print_last_interval(metrics: Dict[str, Any]) -> None:
    """The tables' metrics over the last interval, summed over the ranks."""
    series = metrics["table_metrics"]
    last = series[-1]
    since = series[-2]["step"] if len(series) > 1 else metrics["first_step"]
    tables = sorted({k.rsplit("/", 1)[0] for k in last if k.endswith("/hit_rate")})
    print(f"tables over steps {since}-{last['step']} (dynemb.metrics, summed over ranks; "
          f"every {metrics['metrics_every']} steps in the JSON and the plot"
          + (f", TensorBoard: {metrics['tensorboard']}" if metrics["tensorboard"] else "")
          + "):")
    for t in tables:
        print(f"  {t}: hit rate {last[f'{t}/hit_rate']:.3f}, load factor "
              f"{last[f'{t}/load_factor']:.2f}, inserts {last[f'{t}/inserts']:.0f}, evictions "
              f"{last[f'{t}/evictions']:.0f}, admission rejects "
              f"{last[f'{t}/admission_rejects']:.0f}, keys refused a slot "
              f"{last[f'{t}/refused']:.0f}")


# -- processes ---------------------------------------------------------------------------------
def train_rank(rank: int, world_size: int, args: argparse.Namespace,
               cfg: Config) -> Optional[Dict[str, Any]]:
    """Train on this rank of a joined process group; rank 0 returns the metrics."""
    device = rank_device(args.device)
    prepare_rank(device)
    resume = (args.out_dir / "checkpoint") if args.resume else None
    disk = None if args.disk is None else args.disk / f"rank{rank}"
    metrics = train(rank, world_size, cfg, device, args.seed, args.out_dir, args.pipeline,
                    resume, disk, args.host_cache_mb, args.metrics_every, args.tensorboard)
    # a spawned rank ends with os._exit, which runs no finalizer: free the model (and with
    # it the directories of its stores on disk) now
    gc.collect()
    return metrics


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, help="training steps (default 2000; quick 120)")
    parser.add_argument("--quick", action="store_true", help="small catalog, seconds-long run")
    parser.add_argument("--nproc", type=int, default=DEFAULT_NPROC,
                        help=f"CPU ranks to spawn (default {DEFAULT_NPROC}); ignored under "
                             f"torchrun")
    parser.add_argument("--pipeline", choices=PIPELINES, default="sparse_dist",
                        help="TorchRec's TrainPipelineSparseDist (default) or dynemb's "
                             "PrefetchTrainPipelineSparseDist")
    add_device_argument(parser)
    parser.add_argument("--seed", type=int, default=0)
    add_timeout_argument(parser)
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR,
                        help=f"where the plot, the metrics and the checkpoint go (default "
                             f"{OUT_DIR})")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the checkpoint in --out-dir (saved by any number "
                             "of ranks; with --disk, by as many as now) for --steps more steps")
    parser.add_argument("--disk", type=Path,
                        help="keep the items table's store on disk in this directory (RocksDB; "
                             "docs/storage.md); the checkpoint then streams the tables with "
                             "dynemb.checkpoint.dump")
    parser.add_argument("--host-cache-mb", type=int, default=0,
                        help="with --disk: a host-memory level of this many MiB per rank in "
                             "front of the disk (default 0: none)")
    parser.add_argument("--metrics-every", type=int,
                        help="steps per interval of the tables' metrics (default: a fifth of "
                             "the evaluation interval, 50; quick 8)")
    parser.add_argument("--tensorboard", type=Path, metavar="DIR",
                        help="write the tables' metrics per interval as TensorBoard scalars "
                             "here (needs pip install 'dynemb[metrics]')")
    args = parser.parse_args(argv)
    require_positive(parser, args, "steps", "nproc", "metrics_every")
    if args.tensorboard is not None:
        try:
            importlib.import_module("torch.utils.tensorboard")  # fails without tensorboard
        except ImportError:
            parser.error("--tensorboard needs the tensorboard package: pip install "
                         "'dynemb[metrics]'")
    if args.host_cache_mb < 0 or (args.host_cache_mb and args.disk is None):
        parser.error("--host-cache-mb is a size in MiB >= 0, and goes with --disk")
    return args


def main(argv: Optional[List[str]] = None) -> Optional[Dict[str, Any]]:
    """Train on the ranks of a torchrun launch, or spawn ``--nproc`` CPU ranks; returns the
    metrics (on rank 0 / in the spawning process)."""
    args = parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:   # launched by torchrun
        return run_in_process_group(train_rank, args, cfg, device=rank_device(args.device),
                                    collective_timeout=args.timeout)
    args.device = "cpu"
    return run_on_ranks(args.nproc, train_rank, args, cfg,
                        collective_timeout=args.timeout)[0]


if __name__ == "__main__":
    main()
