"""2-rank CPU training throughput of pooled tables: the row-wise sharded
``DynamicEmbBagCollection`` against TorchRec's row-wise sharded ``EmbeddingBagCollection``
(fbgemm's fused CPU TBE), both under TorchRec's ``TrainPipelineSparseDist``, in the same run
on the same DLRM-like batches.

Run from the repository root::

    .venv/bin/python -m benchmarks.bench_pooled            # full run (a few minutes on 2 cores)
    .venv/bin/python -m benchmarks.bench_pooled --quick    # smoke run, well under a minute

Two ranks are spawned (gloo, ``torch.multiprocessing``); each holds both models and steps
their pipelines in turn (the order alternates every step). Writes ``<out-dir>/pooled_cpu.json``
and ``.png`` (``pooled_cpu_quick.*`` with ``--quick``), and prints the step times, the ratio
against the target (reported, never asserted) and where each model's step goes. Both models
start from the same rows and must train alike (same loss and the same pooled probe rows at
every step); a mismatch aborts the run (nothing written).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from benchmarks.bench_sharded import PIPELINE_PHASES, Batch, combined_optimizer
from benchmarks.common import (BenchmarkError, add_run_options, config_of,
                               fill_defaults, git_state, load_before_run, machine_info,
                               new_parser, peak_rss_gib, report_stem, run_command,
                               set_numba_threads, verdict, write_report, zipf_ranks)
from benchmarks.side_by_side import (LOSS_RTOL, METHODS, compare,  # noqa: F401
                                     plot_steps_and_ratios, profile_steps, summarize_ranks)
from examples.spawn import RankError, run_on_ranks

FILE_STEM = "pooled_cpu"
WORLD_SIZE = 2
LABELS = {"dynemb": "ShardedDynamicEmbBagCollection (HBM_DIRECT, HASH owners)",
          "torchrec": "TorchRec EBC row-wise, fbgemm fused TBE"}
TARGET = 1.0           # dynemb step time / TorchRec step time, at most
WHAT = "pooled rows"   # the probe rows both models must agree on
LEARNING_RATE = 0.05
DENSE_LR = 0.01
PROBES = 16
#: The dynamic tables' global max_capacity per row of the static table: at most this load.
CAPACITY_PER_ID = 2
#: Distinct values of the 26 categorical features of Criteo's Kaggle (Display Advertising
#: Challenge) data set; each table gets min(this, --max-rows) rows.
CRITEO_CARDINALITIES = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683,
                        8351593, 3194, 27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15,
                        286181, 105, 142572]
FEATURES = [f"cat_{i}" for i in range(len(CRITEO_CARDINALITIES))]


# -- workload --------------------------------------------------------------------------------
def table_rows(cfg: Dict[str, Any]) -> List[int]:
    """Rows of each feature's table (its id space)."""
    return [min(c, cfg["max_rows"]) for c in CRITEO_CARDINALITIES[:cfg["features"]]]


def id_maps(cfg: Dict[str, Any]) -> List[Tuple[np.ndarray, np.ndarray]]:
    """Per table of ``n`` rows: a permutation of the rows (Zipf rank -> row, so hot ids are
    scattered over TorchRec's row blocks) and a random high part per row. Row ``i``'s raw id
    is ``i + n * high[i]``: a 63-bit value, and ``raw % n == i``, so the static tables' modulo
    maps the raw ids onto their rows without a collision and both models train alike."""
    rng = np.random.default_rng([cfg["seed"], 1])
    out = []
    for n in table_rows(cfg):
        out.append((rng.permutation(n), rng.integers(0, (2**63 - 1) // n, n, dtype=np.int64)))
    return out


def raw_ids(rows: np.ndarray, n: int, high: np.ndarray) -> np.ndarray:
    return rows + n * high[rows]


def make_batches(cfg: Dict[str, Any], rank: int, count: int) -> List[Dict[str, Any]]:
    """``count`` batches of this rank: per feature ``lengths`` [B] (all 1 for one-hot) and
    the rows of its ids (Zipf over the table's rows), and 0/1 ``label`` [B]."""
    maps = id_maps(cfg)
    sizes = table_rows(cfg)
    rng = np.random.default_rng([cfg["seed"], 2, rank])
    b, hot = cfg["batch"], cfg["hot"]
    out = []
    for _ in range(count):
        lengths = (np.ones((len(sizes), b), dtype=np.int64) if hot == 1 else
                   rng.integers(1, 2 * hot, (len(sizes), b)))
        rows = [perm[zipf_ranks(rng, int(lengths[f].sum()), cfg["zipf"], n) - 1]
                for f, (n, (perm, _)) in enumerate(zip(sizes, maps))]
        out.append({"lengths": lengths, "rows": rows,
                    "label": (rng.random(b) < 0.5).astype(np.float32)})
    return out


def to_batches(part: Dict[str, Any], cfg: Dict[str, Any],
               maps: List[Tuple[np.ndarray, np.ndarray]]) -> Tuple[Batch, Batch]:
    """The same samples for both models: raw 63-bit ids for dynemb, their rows (raw id modulo
    the table's rows, as a static vocabulary would take them) for TorchRec."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    sizes = table_rows(cfg)
    raw = np.concatenate([raw_ids(r, n, high) for r, n, (_, high)
                          in zip(part["rows"], sizes, maps)])
    static = np.concatenate([raw_ids(r, n, high) % n for r, n, (_, high)
                             in zip(part["rows"], sizes, maps)])
    lengths = torch.from_numpy(part["lengths"].reshape(-1))
    label = torch.from_numpy(part["label"])
    names = FEATURES[:len(sizes)]
    return tuple(Batch(KeyedJaggedTensor.from_lengths_sync(names, torch.from_numpy(v), lengths),
                       label) for v in (raw, static))


# -- models ----------------------------------------------------------------------------------
def table_configs(cfg: Dict[str, Any]):
    from torchrec import EmbeddingBagConfig, PoolingType
    pooling = PoolingType.SUM if cfg["hot"] == 1 else PoolingType.MEAN
    return [EmbeddingBagConfig(name=f"t_{i}", embedding_dim=cfg["dim"], num_embeddings=n,
                               feature_names=[FEATURES[i]], pooling=pooling)
            for i, n in enumerate(table_rows(cfg))]


class PooledModel(torch.nn.Module):
    """The same model around either pooled module: logit = Linear(every feature's pooled
    row, concatenated), binary cross-entropy against the batch's labels."""

    def __init__(self, ebc: torch.nn.Module, features: int, dim: int):
        super().__init__()
        self.ebc = ebc
        self.over = torch.nn.Linear(features * dim, 1)

    def forward(self, batch):
        pooled = self.ebc(batch.features).values()
        logit = self.over(pooled).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, batch.labels)
        return loss, (loss.detach(), pooled[:PROBES].detach().clone())


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


def _dmp(model, module, sharder, kernel: str, world_size: int):
    import torch.distributed as dist
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(
        module, {c.name: row_wise(compute_kernel=kernel) for c in module.embedding_bag_configs()},
        sharder=sharder, local_size=world_size, world_size=world_size, device_type="cpu")})
    return DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
        device=torch.device("cpu"), plan=plan, sharders=[sharder])


def build_dynemb(cfg: Dict[str, Any], opt_name: str, world_size: int, over: dict):
    from dynemb import DynamicEmbBagCollection, DynamicEmbTableOptions
    from dynemb.sharding import DynamicEmbBagCollectionSharder
    opt, _ = optimizer_configs(opt_name)
    configs = table_configs(cfg)
    options = {c.name: DynamicEmbTableOptions(max_capacity=CAPACITY_PER_ID * c.num_embeddings)
               for c in configs}
    ebc = DynamicEmbBagCollection(configs, device="meta", table_options=options, optimizer=opt)
    model = PooledModel(ebc, len(configs), cfg["dim"])
    model.over.load_state_dict(over)
    return _dmp(model, ebc, DynamicEmbBagCollectionSharder(), "customized_kernel", world_size)


def build_torchrec(cfg: Dict[str, Any], opt_name: str, world_size: int, over: dict, dyn):
    """TorchRec's EBC, each row set to the row the dynamic table gives its raw id."""
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    _, fused_params = optimizer_configs(opt_name)
    configs = table_configs(cfg)
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    model = PooledModel(ebc, len(configs), cfg["dim"])
    model.over.load_state_dict(over)
    dmp = _dmp(model, ebc, EmbeddingBagCollectionSharder(fused_params=fused_params), "fused",
               world_size)
    tables = dyn.module.ebc.local.tables
    maps = dict(zip((c.name for c in configs), id_maps(cfg)))
    for key, value in dmp.state_dict().items():
        if key.endswith(".weight") and hasattr(value, "local_shards"):
            shard = value.local_shards()[0]
            name, offset = key.split(".")[-2], shard.metadata.shard_offsets[0]
            n = value.size()[0]
            rows = np.arange(offset, offset + shard.tensor.shape[0])
            ids = torch.from_numpy(raw_ids(rows, n, maps[name][1]))
            t = tables[name]
            init = t.options.initializer.rows(ids, t.dim, seed=t.options.seed,
                                              table_id=t.table_id)
            shard.tensor.detach().copy_(init)
    return dmp


# -- timing on one rank ----------------------------------------------------------------------
def _timed_parts(method: str, dmp, pipeline) -> List[Tuple[Any, str, str]]:
    """What to time inside one step of ``method`` (owner, attribute, label). The sharded
    modules' parts are reached through their private attributes: a benchmark's liberty."""
    parts = [(pipeline, attr, label) for attr, label in PIPELINE_PHASES]
    sharded = dmp.module.ebc
    send = "input dist: start (next batch)"
    if method == "dynemb":
        from dynemb.modules import dynamic_core
        from dynemb.sharding import bag_input_dist
        from dynemb.sharding.sharded_bag_collection import _PooledOutputAwaitable
        local = sharded.local
        compute = "forward.compute (lookup + pooling)"
        parts += [(sharded, "input_dist", f"{send}.select+bucketize+send"),
                  (bag_input_dist, "bucketize_by_owner",
                   f"{send}.select+bucketize+send.bucketize_by_owner"),
                  (sharded, "compute", compute),
                  (dynamic_core, "split_by_table", f"{compute}.split by table"),
                  (local, "_table_bags", f"{compute}.bag offsets per table"),
                  (local, "_pool",
                   f"{compute}.pool every table into the [B, sum of dims] output"),
                  (sharded, "output_dist", "forward.reduce-scatter: start"),
                  (_PooledOutputAwaitable, "_wait_impl",
                   "forward.reduce-scatter: wait (+ MEAN divide)")]
        from dynemb.tables.group_batch import GroupBatch
        from dynemb.tables.groups import TableGroup
        from dynemb.tables import group_batch
        parts += [(TableGroup, "claim_batch", f"{compute}.resolve ids (group prefetch)"),
                  (TableGroup, "finish_batch", f"{compute}.resolve ids (group prefetch)"),
                  (GroupBatch, "pooling_rows", f"{compute}.gather rows (group lookup)"),
                  (group_batch, "fused_update",
                   "backward.fused optimizer update")]
    else:
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionAwaitable
        parts += [(sharded, "input_dist", f"{send}.bucketize+send"),
                  (EmbeddingBagCollectionAwaitable, "_wait_impl",
                   "forward.reduce-scatter: wait")]
        for lookup in sharded._lookups:
            parts.append((lookup, "forward", "forward.compute (TBE lookup + pooling)"))
        for odist in sharded._output_dists:
            parts.append((odist, "forward", "forward.reduce-scatter: start"))
    return parts


def rank_main(rank: int, world_size: int, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Every configuration on this rank: both models, pipelines stepped in turn."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from tqdm import tqdm
    if cfg["numba_threads"]:
        set_numba_threads(cfg["numba_threads"])
    configs = [(h, d, o) for h in cfg["hots"] for d in cfg["dims"] for o in cfg["optimizers"]]
    # profiled steps: with phase timers (both models), under cProfile (dynemb), under
    # torch.profiler (both models)
    per_config = cfg["warmup"] + cfg["steps"] + 3 * cfg["profile"]
    bar = tqdm(total=len(configs) * per_config, desc="pooled bench", unit="step",
               disable=rank != 0, mininterval=0.5)
    results = []
    for hot, dim, opt_name in configs:
        run_cfg = dict(cfg, dim=dim, hot=hot)
        # two more batches than steps: the pipeline's last step still has a next batch
        parts = make_batches(run_cfg, rank, per_config + 2)
        maps = id_maps(run_cfg)
        pairs = [to_batches(p, run_cfg, maps) for p in parts]
        torch.manual_seed(cfg["seed"])
        over = torch.nn.Linear(cfg["features"] * dim, 1).state_dict()
        dyn = build_dynemb(run_cfg, opt_name, world_size, over)
        rec = build_torchrec(run_cfg, opt_name, world_size, over, dyn)
        dmps = {"dynemb": dyn, "torchrec": rec}
        pipes = {m: TrainPipelineSparseDist(d, combined_optimizer(d), torch.device("cpu"))
                 for m, d in dmps.items()}
        iters = {"dynemb": iter([p[0] for p in pairs]), "torchrec": iter([p[1] for p in pairs])}
        step_s: Dict[str, List[float]] = {m: [] for m in METHODS}
        worst = {"loss": 0.0, "probe": 0.0}
        where = f"rank {rank}, hot {hot}, dim {dim} {opt_name}"
        before = None
        bar.set_postfix_str(f"hot {hot} dim {dim} {opt_name}")
        for i in range(cfg["warmup"] + cfg["steps"]):
            if i == cfg["warmup"]:
                before = dyn.module.ebc.stats()
            order = METHODS if i % 2 == 0 else METHODS[::-1]
            outs = {}
            for m in order:
                t0 = time.perf_counter()
                outs[m] = pipes[m].progress(iters[m])
                t1 = time.perf_counter()
                if i >= cfg["warmup"]:
                    step_s[m].append(t1 - t0)
            compare(outs, worst, f"{where}, step {i}", WHAT)
            bar.update()
        after = dyn.module.ebc.stats()
        profile = {}
        if cfg["profile"]:
            profile = profile_steps(
                cfg["profile"], pipes, iters, {m: _timed_parts(m, dmps[m], pipes[m])
                                               for m in METHODS},
                lambda outs, at: compare(outs, worst, at, WHAT), where, bar, torch_ops=True)
        uniques = [[np.unique(r).size for r in p["rows"]] for p in parts]
        results.append({
            "hot": hot, "dim": dim, "optimizer": opt_name, "step_s": step_s,
            "worst_diff": worst,
            "ids_per_step": int(np.mean([p["lengths"].sum() for p in parts])),
            "unique_per_step": int(np.mean([sum(u) for u in uniques])),
            "dynemb_timed_counters": {k: sum(after[t][k] - before[t][k] for t in after)
                                      for k in ("lookups", "unique_keys", "hits", "inserts")},
            "dynemb_rows": sum(after[t]["rows_device"] for t in after),
            "profile": profile,
        })
        del pipes, dmps, dyn, rec, iters, pairs
    bar.close()
    import numba
    return {"rank": rank, "results": results, "numba_threads": numba.get_num_threads(),
            "torch_threads": torch.get_num_threads(),
            "machine": machine_info(None, packages=["torchrec", "fbgemm_gpu"])
            if rank == 0 else None}


def summarize(per_rank: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per configuration, both models' step times over the ranks (see
    :func:`~benchmarks.side_by_side.summarize_ranks`)."""
    return summarize_ranks(per_rank, config_keys=("hot", "dim", "optimizer"),
                           rank_fields=("ids_per_step", "unique_per_step", "dynemb_timed_counters",
                                        "dynemb_rows"), target=TARGET)


def format_rows(rows: List[Dict[str, Any]]) -> str:
    head = (f"{'hot':>3} {'dim':>4} {'optimizer':<16} {'dynemb ms':>9} {'TorchRec ms':>11} "
            f"{'ratio':>6} {'paired p10-p90':>15} {'dynemb Mids/s':>13} "
            f"{'TorchRec Mids/s':>15}  target")
    lines = [head, "-" * len(head)]
    for r in rows:
        p = r["ratio_paired"]
        lines.append(
            f"{r['hot']:>3} {r['dim']:>4} {r['optimizer']:<16} {r['median_ms']['dynemb']:>9.1f} "
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
    lines = [f"profile, rank 0, hot {row['hot']}, dim {row['dim']} {row['optimizer']} (ms per "
             f"step, inclusive; under the timers and cProfile):"]
    for m in METHODS:
        lines.append(f"  {m}: step {prof[m]['step_ms']:.1f} ms{'wall':>36} {'cpu':>8}")
        for label, ms in sorted(prof[m]["phases_ms"].items()):
            depth = label.count(".")
            cpu = prof[m]["phases_cpu_ms"][label]
            lines.append(f"    {'  ' * depth}{label.split('.')[-1]:<50} {ms:8.2f} {cpu:8.2f}")
    funcs = prof["dynemb"].get("functions", [])
    if funcs:
        lines.append(f"  dynemb alone under cProfile: step "
                     f"{prof['dynemb']['step_ms_under_cprofile']:.1f}; functions "
                     f"(cumulative ms per step):")
        lines += [f"    {f['cum_ms']:8.2f}  {f['calls_per_step']:6.0f} calls  {f['function']}"
                  for f in funcs[:15]]
    for m in METHODS:
        lines.append(f"  {m}: torch ops under torch.profiler (self CPU ms per step, calls):")
        lines += [f"    {o['self_cpu_ms']:8.2f} {o['calls_per_step']:6.0f}  {o['op']}"
                  for o in prof[m]["profiler_ops"][:12]]
    return "\n".join(lines)


NOTES = [
    "Two ranks spawned on this machine (gloo), each with torch.set_num_threads(1) and "
    "OMP_WAIT_POLICY=PASSIVE; each rank holds both models and steps their "
    "TrainPipelineSparseDist in turn, the order alternating per step, on the same samples.",
    "A step is one pipeline.progress() call: zero_grad, input dist of the next batch, forward "
    "(lookup and pooling on the owners, reduce-scatter of the partial sums, dense), backward "
    "(the reduce-scatter's all-gather, fused embedding update), dense optimizer step. Its "
    "time is the slower rank's.",
    "Workload per rank and step: batch samples, each with one id per categorical feature "
    "(hot 1, SUM pooling, as Criteo) or 1..2*hot-1 ids (mean hot, MEAN pooling); one table per "
    "feature, rows min(Criteo Kaggle cardinality, max_rows); ids Zipf over the table's rows, "
    "scattered by a fixed permutation.",
    "Ids: dynemb gets raw 63-bit ids (row + rows * a fixed random high part per row); TorchRec "
    "gets raw id % rows, as a static vocabulary would take them. The high parts are chosen so "
    "that the modulo has no collision: both models see the same distinct ids and must train "
    "alike (loss rel 1e-3; the pooled rows of 16 samples rtol 1e-3, atol 1e-4).",
    "dynemb: DynamicEmbBagCollection on meta, HBM_DIRECT, max_capacity = 2 x the table's rows "
    "(global, split over ranks), HASH owners, sharded by DynamicEmbBagCollectionSharder "
    "(row_wise, customized_kernel). TorchRec: EmbeddingBagCollection with num_embeddings = the "
    "table's rows, row-wise, kernel 'fused' (fbgemm CPU TBE, fused optimizer), plan built by "
    "construct_module_sharding_plan. Dense: Linear(features * dim, 1) under DDP, SGD.",
    "The profile steps run after the timed ones with wrappers around the pipeline's phases "
    "and the modules' parts (inclusive wall time, rank 0); 'backward' includes the "
    "reduce-scatter's all-gather, the pooling backward and the fused update.",
]


def plot(report: Dict[str, Any], path: Path) -> None:
    """Left: median step ms per configuration (p10-p90 whiskers). Right: the ratio against
    the target."""
    rows = report["rows"]
    names = [f"{r['hot']}-hot\nd{r['dim']}\n"
             f"{r['optimizer'].replace('rowwise_adagrad', 'rw-adagrad')}" for r in rows]
    plot_steps_and_ratios(
        rows, path, names=names, labels=LABELS, target=TARGET, figsize=(14, 5), tick_size=8,
        title=f"{WORLD_SIZE} CPU ranks, {report['config']['features']} pooled features, "
              f"batch {report['config']['batch']} per rank")


# -- command line ----------------------------------------------------------------------------
def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = new_parser(__doc__)
    parser.add_argument("--dims", type=int, nargs="+", help="embedding dims (default 64 128)")
    parser.add_argument("--optimizers", nargs="+", choices=["sgd", "rowwise_adagrad"],
                        help="default: sgd rowwise_adagrad")
    parser.add_argument("--hots", type=int, nargs="+",
                        help="ids per feature and sample: 1 (one-hot, SUM), or H > 1 (1..2H-1 "
                             "ids, mean H, MEAN pooling); default 1 4")
    parser.add_argument("--batch", type=int, help="samples per rank and step (default 2048)")
    parser.add_argument("--features", type=int,
                        help=f"categorical features, one table each (default "
                             f"{len(CRITEO_CARDINALITIES)}, at most that)")
    parser.add_argument("--max-rows", type=int,
                        help="rows of the largest tables (default 100000)")
    parser.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent (default 1.05)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 6)")
    parser.add_argument("--steps", type=int, help="timed steps per model (default 30)")
    parser.add_argument("--profile", type=int, metavar="STEPS",
                        help="profiled steps after the timed ones, per profiler (default 4; "
                             "0: none)")
    parser.add_argument("--numba-threads", type=int, default=1,
                        help="numba threads per rank (default 1: two ranks on two cores; 0 "
                             "leaves numba's default)")
    add_run_options(parser, f"tiny smoke run; writes {FILE_STEM}_quick.*")
    args = parser.parse_args(argv)
    quick = {"dims": [16], "optimizers": ["sgd"], "hots": [1], "batch": 64, "features": 8,
             "max_rows": 2000, "warmup": 2, "steps": 3, "profile": 1}
    full = {"dims": [64, 128], "optimizers": ["sgd", "rowwise_adagrad"], "hots": [1, 4],
            "batch": 2048, "features": len(CRITEO_CARDINALITIES), "max_rows": 100_000,
            "warmup": 6, "steps": 30, "profile": 4}
    fill_defaults(args, quick, full)
    if min(args.batch, args.features, args.max_rows, args.steps, *args.dims, *args.hots) < 1:
        parser.error("--batch, --features, --max-rows, --steps, --dims, --hots must be "
                     "positive")
    if args.features > len(CRITEO_CARDINALITIES):
        parser.error(f"--features is at most {len(CRITEO_CARDINALITIES)}")
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
        per_rank = run_on_ranks(WORLD_SIZE, rank_main, cfg, timeout=3600)
    except RankError as err:
        raise BenchmarkError(str(err)) from None
    rows = summarize(per_rank)
    machine = dict(per_rank[0]["machine"], git=git)
    machine.update({"loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                    "world_size": WORLD_SIZE, "torch_threads_per_rank":
                    per_rank[0]["torch_threads"], "numba_threads_per_rank":
                    per_rank[0]["numba_threads"]})
    sizes = table_rows(dict(cfg, dim=0, hot=1))
    workload = {"table_rows": sizes, "static_ids": "raw id % table rows (collision-free by "
                "construction)", "dynemb_max_capacity": [CAPACITY_PER_ID * n for n in sizes]}
    report = {"machine": machine, "config": cfg, "workload": workload, "notes": NOTES,
              "labels": LABELS, "rows": rows, "runtime_s": time.perf_counter() - start,
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
