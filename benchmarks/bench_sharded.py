"""2-rank CPU training throughput: the row-wise sharded ``DynamicEmbCollection`` against
TorchRec's row-wise sharded ``EmbeddingCollection`` (fbgemm's fused CPU TBE), both under
TorchRec's ``TrainPipelineSparseDist``, in the same run on the same batches.

Run from the repository root::

    .venv/bin/python -m benchmarks.bench_sharded            # full run (~75 s on 2 idle cores)
    .venv/bin/python -m benchmarks.bench_sharded --quick    # smoke run, well under a minute

Two ranks are spawned (gloo, ``torch.multiprocessing``); each holds both models and steps
their pipelines in turn (the order alternates every step). Writes
``<out-dir>/sharded_cpu.json`` and ``.png`` (``sharded_cpu_quick.*`` with ``--quick``), and
prints the step times, the ratio against the target (reported, never asserted) and where each
model's step goes. Both models start from the same rows and must train alike (same loss and
the same probe embeddings at every step); a mismatch aborts the run (nothing written).
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from torchrec.streamable import Pipelineable

from benchmarks.common import (BenchmarkError, add_run_options, config_of,
                               fill_defaults, git_state, load_before_run, machine_info,
                               new_parser, peak_rss_gib, report_stem, run_command,
                               set_numba_threads, verdict, write_report, zipf_ranks)
from benchmarks.side_by_side import (LOSS_RTOL, METHODS, compare,  # noqa: F401
                                     plot_steps_and_ratios, profile_steps, summarize_ranks)
from examples.spawn import RankError, run_on_ranks

FILE_STEM = "sharded_cpu"
WORLD_SIZE = 2
LABELS = {"dynemb": "ShardedDynamicEmbCollection (HBM_DIRECT, HASH owners)",
          "torchrec": "TorchRec EC row-wise, fbgemm fused TBE"}
TARGET = 1.25          # dynemb step time / TorchRec step time, at most
WHAT = "target embeddings"  # the probe rows both models must agree on
LEARNING_RATE = 0.05
DENSE_LR = 0.01
PROBES = 64
#: The dynamic tables' global max_capacity per id of the id space: at most this load.
CAPACITY_PER_ID = 2

#: Phase timers of the profile steps: (owner, attribute, label). Owners are resolved per
#: method by ``_timed_parts``; the labels nest by their dotted prefix.
PIPELINE_PHASES = [
    ("_wait_for_batch", "wait for batch"),
    ("start_sparse_data_dist", "input dist: start (next batch)"),
    ("wait_sparse_data_dist", "input dist: wait ids all-to-all (next batch)"),
    ("enqueue_batch", "load batch"),
    ("_model_fwd", "forward"),
    ("_backward", "backward"),
    ("_optimizer_step", "dense optimizer step"),
]


# -- workload --------------------------------------------------------------------------------
FEATURES = ["user", "history", "target"]


def zipf_ids(rng: np.random.Generator, n: int, a: float, space: int,
             perm: np.ndarray) -> np.ndarray:
    """``n`` ids in ``[0, space)``: Zipf(``a``) ranks truncated to ``space`` (by rejection),
    scattered over the id range by the fixed permutation ``perm`` (hot ids are not
    contiguous, so TorchRec's row blocks and our hash owners both see a mix)."""
    return perm[zipf_ranks(rng, n, a, space) - 1]


def make_batches(cfg: Dict[str, Any], rank: int, count: int) -> List[Dict[str, np.ndarray]]:
    """``count`` batches of this rank: ``user`` [B], ``history`` (``lengths`` [B] ids per
    sample, mean ``history``), ``target`` [B] and a 0/1 ``label`` [B]."""
    perms = np.random.default_rng(cfg["seed"])
    item_perm = perms.permutation(cfg["items"])
    user_perm = perms.permutation(cfg["users"])
    rng = np.random.default_rng([cfg["seed"], rank])
    b, mean = cfg["batch"], cfg["history"]
    out = []
    for _ in range(count):
        lengths = rng.integers(1, 2 * mean, b)
        out.append({
            "user": zipf_ids(rng, b, cfg["zipf"], cfg["users"], user_perm),
            "lengths": lengths,
            "history": zipf_ids(rng, int(lengths.sum()), cfg["zipf"], cfg["items"], item_perm),
            "target": zipf_ids(rng, b, cfg["zipf"], cfg["items"], item_perm),
            "label": (rng.random(b) < 0.5).astype(np.float32),
        })
    return out


def to_batch(part: Dict[str, np.ndarray]):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    b = len(part["user"])
    ones = np.ones(b, dtype=np.int64)
    values = np.concatenate([part["user"], part["history"], part["target"]])
    lengths = np.concatenate([ones, part["lengths"], ones])
    kjt = KeyedJaggedTensor.from_lengths_sync(FEATURES, torch.from_numpy(values),
                                              torch.from_numpy(lengths))
    return Batch(kjt, torch.from_numpy(part["label"]))


@dataclass
class Batch(Pipelineable):
    """One rank's batch: the sparse features and the labels."""

    features: Any
    labels: torch.Tensor

    def to(self, device, non_blocking=False):
        return Batch(self.features.to(device=device, non_blocking=non_blocking),
                     self.labels.to(device=device, non_blocking=non_blocking))

    def record_stream(self, stream):
        self.features.record_stream(stream)
        self.labels.record_stream(stream)

    def pin_memory(self):
        return Batch(self.features.pin_memory(), self.labels.pin_memory())


# -- models ----------------------------------------------------------------------------------
def table_configs(cfg: Dict[str, Any]):
    from torchrec import EmbeddingConfig
    dim = cfg["dim"]
    return [EmbeddingConfig(name="item_ids", embedding_dim=dim, num_embeddings=cfg["items"],
                            feature_names=["history", "target"]),
            EmbeddingConfig(name="user_ids", embedding_dim=dim, num_embeddings=cfg["users"],
                            feature_names=["user"])]


@torch.fx.wrap
def mean_pool(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B, dim] means of the ``lengths`` rows of each sample (a leaf of TorchRec's trace of
    the model: tensor shapes are not traceable)."""
    n = lengths.numel()
    segment = torch.repeat_interleave(torch.arange(n), lengths)
    pooled = torch.zeros(n, values.shape[1]).index_add(0, segment, values)
    return pooled / lengths.clamp(min=1)[:, None]


class RecModel(torch.nn.Module):
    """The same model around either embedding module: query = Linear(mean of the history,
    user), logit = query . target, binary cross-entropy against the batch's labels."""

    def __init__(self, ec: torch.nn.Module, dim: int):
        super().__init__()
        self.ec = ec
        self.tower = torch.nn.Linear(2 * dim, dim)

    def forward(self, batch):
        emb = self.ec(batch.features)
        pooled = mean_pool(emb["history"].values(), emb["history"].lengths())
        query = self.tower(torch.cat([pooled, emb["user"].values()], dim=1))
        target = emb["target"].values()
        logit = (query * target).sum(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, batch.labels)
        return loss, (loss.detach(), target[:PROBES].detach().clone())


def optimizer_configs(name: str):
    """(dynemb OptimizerConfig, TorchRec fused_params) of one optimizer."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from dynemb import OptimizerConfig, OptimizerType
    if name == "sgd":
        return (OptimizerConfig(OptimizerType.SGD, learning_rate=LEARNING_RATE),
                {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LEARNING_RATE})
    return (OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD, learning_rate=LEARNING_RATE,
                            eps=1e-8),
            {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LEARNING_RATE,
             "eps": 1e-8})


def build_dynemb(cfg: Dict[str, Any], opt_name: str, world_size: int, tower: dict):
    import torch.distributed as dist
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from dynemb import DynamicEmbCollection, DynamicEmbTableOptions
    from dynemb.sharding import DynamicEmbCollectionSharder
    opt, _ = optimizer_configs(opt_name)
    configs = table_configs(cfg)
    options = {c.name: DynamicEmbTableOptions(max_capacity=CAPACITY_PER_ID * c.num_embeddings)
               for c in configs}
    model = RecModel(DynamicEmbCollection(configs, device="meta", table_options=options,
                                          optimizer=opt), cfg["dim"])
    model.tower.load_state_dict(tower)
    sharder = DynamicEmbCollectionSharder()
    plan = ShardingPlan({"ec": construct_module_sharding_plan(
        model.ec, {c.name: row_wise(compute_kernel="customized_kernel") for c in configs},
        sharder=sharder, local_size=world_size, world_size=world_size, device_type="cpu")})
    return DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
        device=torch.device("cpu"), plan=plan, sharders=[sharder])


def build_torchrec(cfg: Dict[str, Any], opt_name: str, world_size: int, tower: dict,
                   initial: Dict[str, Callable[[torch.Tensor], torch.Tensor]]):
    import torch.distributed as dist
    from torchrec import EmbeddingCollection
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    _, fused_params = optimizer_configs(opt_name)
    configs = table_configs(cfg)
    model = RecModel(EmbeddingCollection(tables=configs, device=torch.device("meta")),
                     cfg["dim"])
    model.tower.load_state_dict(tower)
    sharder = EmbeddingCollectionSharder(fused_params=fused_params)
    plan = ShardingPlan({"ec": construct_module_sharding_plan(
        model.ec, {c.name: row_wise(compute_kernel="fused") for c in configs},
        sharder=sharder, local_size=world_size, world_size=world_size, device_type="cpu")})
    dmp = DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
        device=torch.device("cpu"), plan=plan, sharders=[sharder])
    for key, value in dmp.state_dict().items():
        if key.endswith(".weight") and hasattr(value, "local_shards"):
            shard = value.local_shards()[0]
            name, offset = key.split(".")[-2], shard.metadata.shard_offsets[0]
            ids = torch.arange(offset, offset + shard.tensor.shape[0])
            shard.tensor.detach().copy_(initial[name](ids))
    return dmp


def initial_rows(dmp) -> Dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The rows the dynamic tables give each id on first sight, per table."""
    out = {}
    for name, table in dmp.module.ec.local.tables.items():
        init, seed, tid, dim = (table.options.initializer, table.options.seed, table.table_id,
                                table.dim)
        out[name] = (lambda ids, i=init, s=seed, t=tid, d=dim:
                     i.rows(ids, d, seed=s, table_id=t))
    return out


def combined_optimizer(dmp):
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    parts = [dmp.fused_optimizer]
    if dense:
        parts.append(KeyedOptimizerWrapper(dense, lambda ps: torch.optim.SGD(ps, lr=DENSE_LR)))
    return CombinedOptimizer(parts)


# -- timing on one rank ----------------------------------------------------------------------
def _timed_parts(method: str, dmp, pipeline) -> List[Tuple[Any, str, str]]:
    """What to time inside one step of ``method`` (owner, attribute, label). The sharded
    modules' parts are reached through their private attributes: a benchmark's liberty."""
    parts = [(pipeline, attr, label) for attr, label in PIPELINE_PHASES]
    sharded = dmp.module.ec
    if method == "dynemb":
        from dynemb.sharding.sharded_collection import DynamicEmbOutputAwaitable
        send = "input dist: start (next batch).dedup+route+send"
        lookup = "forward.lookup (hash resolve + gather)"
        parts += [(sharded, "input_dist", send),
                  (sharded, "compute", lookup),
                  (sharded, "output_dist", "forward.rows all-to-all: start"),
                  (DynamicEmbOutputAwaitable, "_wait_impl", "forward.rows all-to-all: wait")]
        parts += [(d, "route", f"{send}.dedup+route") for d in sharded._input_dists]
        from dynemb.tables import group_batch
        from dynemb.tables.group_batch import GroupBatch
        from dynemb.tables.groups import TableGroup
        parts += [(TableGroup, "claim_batch", f"{lookup}.resolve ids"),
                  (TableGroup, "finish_batch", f"{lookup}.resolve ids"),
                  (GroupBatch, "lookup_occurrences", f"{lookup}.gather rows"),
                  (group_batch, "fused_update",
                   "backward.fused optimizer update")]
    else:
        from torchrec.distributed.embedding import EmbeddingCollectionAwaitable
        parts += [(sharded, "input_dist", "input dist: start (next batch).bucketize+send"),
                  (EmbeddingCollectionAwaitable, "_wait_impl", "forward.rows all-to-all: wait")]
        for lookup in sharded._lookups:
            parts.append((lookup, "forward", "forward.lookup (TBE forward)"))
        for odist in sharded._output_dists:
            parts.append((odist, "forward", "forward.rows all-to-all: start"))
    return parts


def rank_main(rank: int, world_size: int, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Every configuration on this rank: both models, pipelines stepped in turn."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from tqdm import tqdm
    if cfg["numba_threads"]:
        set_numba_threads(cfg["numba_threads"])
    configs = [(d, o) for d in cfg["dims"] for o in cfg["optimizers"]]
    # profiled steps: once with phase timers (both models), once under cProfile (dynemb)
    per_config = cfg["warmup"] + cfg["steps"] + 2 * cfg["profile"]
    bar = tqdm(total=len(configs) * per_config, desc="sharded bench", unit="step",
               disable=rank != 0, mininterval=0.5)
    results = []
    for dim, opt_name in configs:
        run_cfg = dict(cfg, dim=dim)
        # two more batches than steps: the pipeline's last step still has a next batch to
        # send, as in a long run
        parts = make_batches(run_cfg, rank, per_config + 2)
        batches = [to_batch(p) for p in parts]
        torch.manual_seed(cfg["seed"])
        tower = torch.nn.Linear(2 * dim, dim).state_dict()
        dyn = build_dynemb(run_cfg, opt_name, world_size, tower)
        rec = build_torchrec(run_cfg, opt_name, world_size, tower, initial_rows(dyn))
        dmps = {"dynemb": dyn, "torchrec": rec}
        pipes = {m: TrainPipelineSparseDist(d, combined_optimizer(d), torch.device("cpu"))
                 for m, d in dmps.items()}
        iters = {m: iter(batches) for m in METHODS}
        step_s: Dict[str, List[float]] = {m: [] for m in METHODS}
        worst = {"loss": 0.0, "probe": 0.0}
        before = None
        bar.set_postfix_str(f"dim {dim} {opt_name}")
        for i in range(cfg["warmup"] + cfg["steps"]):
            if i == cfg["warmup"]:
                before = dyn.module.ec.stats()
            order = METHODS if i % 2 == 0 else METHODS[::-1]
            outs = {}
            for m in order:
                t0 = time.perf_counter()
                outs[m] = pipes[m].progress(iters[m])
                t1 = time.perf_counter()
                if i >= cfg["warmup"]:
                    step_s[m].append(t1 - t0)
            compare(outs, worst, f"rank {rank}, dim {dim} {opt_name}, step {i}", WHAT)
            bar.update()
        after = dyn.module.ec.stats()
        profile = {}
        if cfg["profile"]:
            profile = profile_steps(
                cfg["profile"], pipes, iters, {m: _timed_parts(m, dmps[m], pipes[m])
                                               for m in METHODS},
                lambda outs, where: compare(outs, worst, where, WHAT),
                f"rank {rank}, dim {dim} {opt_name}", bar)
        results.append({
            "dim": dim, "optimizer": opt_name, "step_s": step_s, "worst_diff": worst,
            "ids_per_step": int(np.mean([p["history"].size + 2 * len(p["user"])
                                         for p in parts])),
            "unique_per_step": {t: int(np.mean([_unique(p, t) for p in parts]))
                                for t in ("item_ids", "user_ids")},
            "dynemb_timed_counters": {t: {k: after[t][k] - before[t][k]
                                          for k in ("lookups", "unique_keys", "hits", "inserts")}
                                      for t in after},
            "dynemb_rows": {t: after[t]["rows_device"] for t in after},
            "profile": profile,
        })
        del pipes, dmps, dyn, rec
    bar.close()
    return {"rank": rank, "results": results, "numba_threads": _numba_threads(),
            "torch_threads": torch.get_num_threads(),
            "machine": machine_info(None) if rank == 0 else None}


def _unique(part, table: str) -> int:
    ids = (np.concatenate([part["history"], part["target"]]) if table == "item_ids"
           else part["user"])
    return int(np.unique(ids).size)


def _numba_threads() -> int:
    import numba
    return numba.get_num_threads()


def summarize(per_rank: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per configuration, both models' step times over the ranks (see
    :func:`~benchmarks.side_by_side.summarize_ranks`)."""
    return summarize_ranks(per_rank, config_keys=("dim", "optimizer"),
                           rank_fields=("unique_per_step", "dynemb_timed_counters", "dynemb_rows"), target=TARGET)


def format_rows(rows: List[Dict[str, Any]]) -> str:
    head = (f"{'dim':>4} {'optimizer':<16} {'dynemb ms':>9} {'TorchRec ms':>11} {'ratio':>6} "
            f"{'paired p10-p90':>15} {'dynemb Mids/s':>13} {'TorchRec Mids/s':>15}  target")
    lines = [head, "-" * len(head)]
    for r in rows:
        p = r["ratio_paired"]
        lines.append(
            f"{r['dim']:>4} {r['optimizer']:<16} {r['median_ms']['dynemb']:>9.1f} "
            f"{r['median_ms']['torchrec']:>11.1f} {r['ratio']:>6.2f} "
            f"{p['p10']:>7.2f}-{p['p90']:<7.2f} {r['m_ids_per_s']['dynemb']:>13.2f} "
            f"{r['m_ids_per_s']['torchrec']:>15.2f}  "
            f"{verdict(r['passed'])} (<= {TARGET})")
    return "\n".join(lines)


def format_profile(row: Dict[str, Any]) -> str:
    """Rank 0's phase times (ms per step, inclusive; nested phases indented)."""
    if not row["profile"]:
        return ""
    prof = row["profile"][0]
    lines = [f"profile, rank 0, dim {row['dim']} {row['optimizer']} (ms per step, "
             f"inclusive; under the timers and cProfile):"]
    for m in METHODS:
        lines.append(f"  {m}: step {prof[m]['step_ms']:.1f}")
        for label, ms in sorted(prof[m]["phases_ms"].items()):
            depth = label.count(".")
            lines.append(f"    {'  ' * depth}{label.split('.')[-1]:<50} {ms:8.2f}")
    funcs = prof["dynemb"].get("functions", [])
    if funcs:
        lines.append("  dynemb functions (cumulative ms per step):")
        lines += [f"    {f['cum_ms']:8.2f}  {f['function']}" for f in funcs[:15]]
    return "\n".join(lines)


NOTES = [
    "Two ranks spawned on this machine (gloo), each with torch.set_num_threads(1) and "
    "OMP_WAIT_POLICY=PASSIVE; each rank holds both models and steps their "
    "TrainPipelineSparseDist in turn, the order alternating per step, on the same batches.",
    "A step is one pipeline.progress() call: zero_grad, input dist of the next batch "
    "(overlapped with nothing on CPU), forward (lookup, rows all-to-all, dense), backward "
    "(fused embedding update inside), dense optimizer step. Its time is the slower rank's.",
    "Workload per rank and step: batch samples with a user id, a history of 1..2h-1 item ids "
    "(mean h) and a target item id; Zipf ids over the id space of each table, scattered by a "
    "fixed permutation. Tables 'item_ids' (history, target) and 'user_ids' (user).",
    "dynemb: DynamicEmbCollection on meta, HBM_DIRECT, max_capacity = 2 x the id space "
    "(global, split over ranks), HASH owners, sharded by DynamicEmbCollectionSharder. "
    "TorchRec: EmbeddingCollection with num_embeddings = the id space, row-wise, kernel "
    "'fused' (fbgemm CPU TBE, fused optimizer). Both start from the same rows and must agree "
    "every step (loss rel 1e-3; 64 target embeddings rtol 1e-3, atol 1e-4).",
    "The profile steps run after the timed ones with wrappers around the pipeline's phases "
    "and the modules' parts (inclusive wall time; 'forward' includes the lookup and the rows "
    "all-to-all, 'backward' the gradient all-to-all and the fused update).",
]


def plot(report: Dict[str, Any], path: Path) -> None:
    """Left: median step ms per configuration (p10-p90 whiskers). Right: the ratio against
    the target."""
    rows = report["rows"]
    plot_steps_and_ratios(
        rows, path, names=[f"dim {r['dim']}\n{r['optimizer']}" for r in rows], labels=LABELS,
        target=TARGET, figsize=(12, 4.6), parity_line=True,
        title=f"{WORLD_SIZE} CPU ranks, TrainPipelineSparseDist")


# -- command line ----------------------------------------------------------------------------
def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = new_parser(__doc__)
    parser.add_argument("--dims", type=int, nargs="+", help="embedding dims (default 64 128)")
    parser.add_argument("--optimizers", nargs="+", choices=["sgd", "rowwise_adagrad"],
                        default=["sgd", "rowwise_adagrad"])
    parser.add_argument("--batch", type=int, help="samples per rank and step (default 2048)")
    parser.add_argument("--history", type=int, help="mean history length (default 20)")
    parser.add_argument("--items", type=int, help="item id space (default 500000)")
    parser.add_argument("--users", type=int, help="user id space (default 200000)")
    parser.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent (default 1.05)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 6)")
    parser.add_argument("--steps", type=int, help="timed steps per model (default 30)")
    parser.add_argument("--profile", type=int, metavar="STEPS",
                        help="profiled steps after the timed ones (default 6; 0: none)")
    parser.add_argument("--numba-threads", type=int, default=1,
                        help="numba threads per rank (default 1: two ranks on two cores; 0 "
                             "leaves numba's default)")
    add_run_options(parser, f"tiny smoke run; writes {FILE_STEM}_quick.*")
    args = parser.parse_args(argv)
    quick = {"dims": [16], "batch": 64, "history": 5, "items": 5000, "users": 2000,
             "warmup": 2, "steps": 3, "profile": 1}
    full = {"dims": [64, 128], "batch": 2048, "history": 20, "items": 500_000,
            "users": 200_000, "warmup": 6, "steps": 30, "profile": 6}
    fill_defaults(args, quick, full)
    if args.quick:
        args.optimizers = args.optimizers[:1] if args.optimizers else ["sgd"]
    if min(args.batch, args.history, args.items, args.users, args.steps, *args.dims) < 1:
        parser.error("--batch, --history, --items, --users, --steps, --dims must be positive")
    if args.warmup < 0 or args.profile < 0 or args.numba_threads < 0:
        parser.error("--warmup, --profile and --numba-threads must be >= 0")
    if args.zipf <= 1.0:
        parser.error("--zipf must be > 1 (numpy's Zipf sampler)")
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Run the benchmark on spawned ranks, print, write JSON and PNG; returns the report."""
    args = parse_args(argv)
    start, load_start, git = time.perf_counter(), load_before_run(), git_state()
    cfg = config_of(args)
    try:
        per_rank = run_on_ranks(WORLD_SIZE, rank_main, cfg, timeout=1800)
    except RankError as err:
        raise BenchmarkError(str(err)) from None
    rows = summarize(per_rank)
    machine = dict(per_rank[0]["machine"], git=git)
    machine.update({"loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                    "world_size": WORLD_SIZE, "torch_threads_per_rank":
                    per_rank[0]["torch_threads"], "numba_threads_per_rank":
                    per_rank[0]["numba_threads"]})
    report = {"machine": machine, "config": cfg, "notes": NOTES, "labels": LABELS,
              "rows": rows, "runtime_s": time.perf_counter() - start,
              "peak_rss_gib_parent": peak_rss_gib()}
    print(format_rows(rows))
    for r in rows:
        text = format_profile(r)
        if text:
            print("\n" + text)
    write_report(report, args.out_dir, report_stem(FILE_STEM, args.quick), plot)
    print(f"run time {report['runtime_s']:.0f} s")
    return report


if __name__ == "__main__":
    run_command(main)
