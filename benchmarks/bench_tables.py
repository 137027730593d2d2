"""Many tables at the cost of one? One training step (forward + backward + optimizer update)
of the same ids spread over T tables, T = 1 ... 256, for ``DynamicEmbCollection`` (HBM_DIRECT
with ids that all fit, HBM_DIRECT that evicts, CACHE that evicts) next to a torch sparse
embedding per table and TorchRec's ``EmbeddingCollection`` (fbgemm's fused CPU TBE), measured
in the same run on the same batches.

Run from the repository root::

    .venv/bin/python -m benchmarks.bench_tables              # full sweep (~3 minutes, 2 busy cores)
    .venv/bin/python -m benchmarks.bench_tables --quick      # seconds-long smoke run
    .venv/bin/python -m benchmarks.bench_tables --tables 1 64 --optimizers sgd
    .venv/bin/python -m benchmarks.bench_tables --profile    # per-phase profile, T = 1 and 128

Writes ``<out-dir>/tables_cpu.json`` and ``.png`` (``--profile``: ``tables_profile.json``;
``--quick`` adds ``_quick`` to the names) and prints the step times, the ratios and PASS/FAIL
lines for the targets (reported, not asserted). The methods that keep every id start from the
same rows and must return the same embeddings at every step; a mismatch aborts the run.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import math
import os
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numba
import numpy as np
import torch
from tqdm import tqdm

import dynemb.modules.collection
import dynemb.modules.dynamic_core
import dynemb.rows.occurrence_grads
import dynemb.tables.group_storage
import dynemb.tables.group_batch
import dynemb.tables.groups
from benchmarks.common import (ROOT, add_run_options, check, config_of, fill_defaults,
                               git_state, load_before_run, machine_info, new_parser,
                               paired_ratios, peak_rss_gib, percentile, profile_tables, pyplot,
                               report_stem, run_command, save_figure, verdict, write_report,
                               zipf_ranks)
from benchmarks.bench_collection import set_numba_threads
from benchmarks.side_by_side import PhaseTimers
from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig,
                    OptimizerType, StorageMode)
from dynemb.foundations.counters import COUNTER_NAMES
from dynemb.tables.group_batch import GroupBatch
from dynemb.tables.group_storage import GroupStorage
from dynemb.tables.groups import TableGroup

FILE_STEM, PROFILE_STEM = "tables_cpu", "tables_profile"
DYNEMB_METHODS = ("hbm_fit", "hbm_evict", "cache")
#: hbm_fit_alone: hbm_fit's tables run one by one (``group_tables=False``), as before groups
BASELINES = ("hbm_fit_alone", "torch_sparse", "torchrec")
#: output_floor: what the T outputs alone cost, before any lookup (no baseline to beat: the
#: part of every method's step that grows with T whatever the embedding does)
FLOOR = "output_floor"
METHODS = DYNEMB_METHODS + BASELINES + (FLOOR,)
LABELS = {
    "hbm_fit": "dynemb HBM_DIRECT, every id fits (no eviction)",
    "hbm_evict": "dynemb HBM_DIRECT, capacity below the ids seen (evicts)",
    "hbm_fit_alone": "hbm_fit with its tables run one by one (group_tables=False)",
    "cache": "dynemb CACHE, device budget below the ids seen (evicts to the host store)",
    "torch_sparse": "nn.Embedding(sparse=True) per table (TorchRec EC, unsharded) + torch "
                    "optimizer",
    "torchrec": "TorchRec EC row-wise sharded on 1 rank, fbgemm fused CPU TBE",
    FLOOR: "no lookup: fixed rows handed out as a JaggedTensor per feature through one "
           "autograd Function with T outputs; backward concatenates the T gradients",
}
#: HBM_DIRECT's capacity when every id fits: the table's vocabulary at this load factor.
FIT_LOAD = 0.5
#: The evicting tables (and the cache) hold this many times one step's distinct ids of the
#: table: they are all pinned at once, and a bucket needs room for them.
HEADROOM = 2.0
LEARNING_RATE, EPS = 1e-3, 1e-8
#: Methods that keep every id must agree this closely at every step (probe rows).
PROBE_ROWS, PROBE_RTOL, PROBE_ATOL = 8, 1e-3, 1e-4
SAME_ROWS = ("hbm_fit", "hbm_fit_alone", "cache", "torch_sparse", "torchrec")
SCALING_TARGET, TORCH_TARGET, TORCH_TARGET_TABLES = 1.3, 1.0, 128
#: step at TORCH_TARGET_TABLES tables <= this many times the step at one table
ONE_TABLE_TARGET = 2.0


# -- workload --------------------------------------------------------------------------------
class Workload:
    """``steps`` batches of ``ids`` ids split evenly over ``tables`` one-feature tables. Table
    ``t`` has a vocabulary of ``rows`` ids; its ids are Zipf ranks over them, scattered by a
    fixed permutation. ``dense[i]``: the batch's row numbers in ``[0, rows)`` per table (for
    the static tables), ``raw[i]``: the same ids as distinct 63-bit ids (for dynemb:
    ``row + rows * high[t, row]``). Values are feature-major, ``lengths`` spread each
    feature's ids over ``batch`` samples."""

    def __init__(self, cfg: argparse.Namespace, tables: int):
        rng = np.random.default_rng(cfg.seed + tables)
        self.tables, self.per_table = tables, cfg.ids // tables
        self.rows = cfg.vocab_factor * self.per_table
        self.features = [f"f{t}" for t in range(tables)]
        num_steps = cfg.warmup + cfg.steps
        ranks = zipf_ranks(rng, num_steps * cfg.ids, cfg.zipf, self.rows).reshape(
            num_steps, tables, self.per_table) - 1
        perm = np.argsort(rng.random((tables, self.rows)), axis=1)
        dense = np.take_along_axis(perm[None], ranks, axis=2)  # [steps, tables, per_table]
        high = rng.integers(0, 2**40, size=(tables, self.rows))
        raw = dense + self.rows * np.take_along_axis(high[None], dense, axis=2)
        self.dense = [torch.from_numpy(d.reshape(-1).copy()) for d in dense]
        self.raw = [torch.from_numpy(r.reshape(-1).copy()) for r in raw]
        self.vocab_raw = torch.from_numpy(np.arange(self.rows)[None] + self.rows * high)
        cuts = np.arange(cfg.batch + 1) * self.per_table // cfg.batch
        self.lengths = torch.from_numpy(np.diff(cuts)).repeat(tables)
        # distinct ids of each table, per step and over the run
        self.unique_per_step = [[int(np.unique(dense[i, t]).size) for t in range(tables)]
                                for i in range(num_steps)]
        self.seen = [int(np.unique(dense[:, t]).size) for t in range(tables)]

    def kjt(self, i: int, dense: bool):
        """A fresh KJT of batch ``i`` (nothing cached from another method's use)."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
        values = self.dense[i] if dense else self.raw[i]
        return KeyedJaggedTensor(keys=self.features, values=values, lengths=self.lengths.clone())

    def gradients(self, seed: int, dim: int) -> List[torch.Tensor]:
        """Fixed N(0, 1) gradients of every feature's [ids, dim] output (what the dense part
        would hand back); every method runs backward from them."""
        gen = torch.Generator().manual_seed(seed + dim)
        return list(torch.randn(self.tables * self.per_table, dim,
                                generator=gen).split(self.per_table))


def whole_buckets(rows: float, bucket: int) -> int:
    """``rows`` rounded up to whole buckets.

    >>> whole_buckets(129, 128)
    256
    """
    return max(1, math.ceil(rows / bucket)) * bucket


def capacities(wl: Workload, bucket: int) -> Tuple[int, int]:
    """(rows per table when every id fits, rows per table of the evicting tables / cache)."""
    fit = whole_buckets(wl.rows / FIT_LOAD, bucket)
    most = max(max(step) for step in wl.unique_per_step)
    small = whole_buckets(HEADROOM * most, bucket)
    check(small < min(wl.seen),
          f"T={wl.tables}: the evicting capacity ({small} rows) holds every id seen "
          f"({min(wl.seen)}): raise --steps or --vocab-factor")
    return fit, small


# -- methods ---------------------------------------------------------------------------------
class Method:
    """One implementation under test: ``forward`` returns every feature's [ids, dim] rows;
    ``backward`` runs autograd from the fixed gradients, optimizer update included."""

    name: str
    dense_ids = True

    def forward(self, kjt, features: Sequence[str]) -> List[torch.Tensor]:
        out = self.module(kjt)
        return [out[f].values() for f in features]

    def backward(self, values: List[torch.Tensor], grads: List[torch.Tensor]) -> None:
        torch.autograd.backward(values, grads)


def table_configs(wl: Workload, dim: int, num_embeddings: int):
    from torchrec import EmbeddingConfig
    return [EmbeddingConfig(name=f"t{t}", embedding_dim=dim, num_embeddings=num_embeddings,
                            feature_names=[f]) for t, f in enumerate(wl.features)]


def optimizer_config(opt_name: str) -> OptimizerConfig:
    kind = {"sgd": OptimizerType.SGD, "rowwise_adagrad": OptimizerType.ROWWISE_ADAGRAD}
    return OptimizerConfig(kind[opt_name], learning_rate=LEARNING_RATE, eps=EPS)


class DynembMethod(Method):
    """``DynamicEmbCollection`` of T tables, one feature each; a step is ``ec(kjt)`` (which
    prefetches inline) and backward (the fused update runs in it)."""

    dense_ids = False

    def __init__(self, name: str, wl: Workload, dim: int, opt_name: str,
                 options: DynamicEmbTableOptions, mode: StorageMode, *,
                 group_tables: bool = True):
        self.name, self.mode = name, mode
        self.module = DynamicEmbCollection(table_configs(wl, dim, options.max_capacity),
                                           table_options=options,
                                           optimizer=optimizer_config(opt_name),
                                           group_tables=group_tables)
        modes = set(self.module.storage_modes().values())
        check(modes == {mode}, f"{name}: expected storage mode {mode.name}, got {modes}")

    def counters(self) -> Dict[str, int]:
        """Every counter summed over the tables."""
        stats = self.module.stats().values()
        return {k: sum(int(s[k]) for s in stats) for k in COUNTER_NAMES}

    def initial_rows(self, wl: Workload, dim: int) -> List[torch.Tensor]:
        """Each table's initializer applied to its whole vocabulary, in row order."""
        out = []
        for t, table in enumerate(self.module.tables.values()):
            init = table.options.initializer
            out.append(init.rows(wl.vocab_raw[t], dim, seed=table.options.seed,
                                 table_id=table.table_id))
        return out


class TorchSparseMethod(Method):
    """TorchRec's unsharded ``EmbeddingCollection`` (one ``nn.Embedding`` per table, switched
    to sparse gradients), ``torch.optim.SGD`` or :class:`RowwiseAdagrad` on every table."""

    name = "torch_sparse"

    def __init__(self, wl: Workload, dim: int, opt_name: str, initial: List[torch.Tensor]):
        from torchrec import EmbeddingCollection
        self.module = EmbeddingCollection(tables=table_configs(wl, dim, wl.rows),
                                          device=torch.device("cpu"))
        weights = []
        for t, emb in enumerate(self.module.embeddings.values()):
            emb.sparse = True
            with torch.no_grad():
                emb.weight.copy_(initial[t])
            weights.append(emb.weight)
        self.opt = (torch.optim.SGD(weights, lr=LEARNING_RATE) if opt_name == "sgd"
                    else RowwiseAdagrad(weights, LEARNING_RATE, EPS))

    def backward(self, values, grads) -> None:
        self.opt.zero_grad(set_to_none=True)
        super().backward(values, grads)
        self.opt.step()


class RowwiseAdagrad:
    """fbgemm's ``EXACT_ROWWISE_ADAGRAD`` on sparse gradients, in torch ops (torch has no
    row-wise AdaGrad): per table, ``acc[r] += mean_j(g[r, j]^2)``,
    ``w[r] -= lr / (sqrt(acc[r]) + eps) * g[r]`` for the rows ``r`` of the coalesced
    gradient.

    >>> w = torch.nn.Parameter(torch.zeros(3, 2))
    >>> w.grad = torch.sparse_coo_tensor([[1, 1]], torch.tensor([[3.0, 4.0], [3.0, 4.0]]),
    ...                                  (3, 2))
    >>> RowwiseAdagrad([w], lr=1.0, eps=0.0).step()   # acc = (36 + 64) / 2 = 50
    >>> [round(v, 4) for v in w[1].tolist()]          # -(6, 8) / sqrt(50)
    [-0.8485, -1.1314]
    """

    def __init__(self, params: List[torch.Tensor], lr: float, eps: float):
        self.params, self.lr, self.eps = params, lr, eps
        self.acc = [torch.zeros(p.shape[0], device=p.device) for p in params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p, acc in zip(self.params, self.acc):
            if p.grad is None:
                continue
            g = p.grad.coalesce()  # unique rows: plain index writes suffice
            rows, values = g.indices()[0], g.values()
            state = acc.index_select(0, rows) + values.square().mean(1)
            acc.index_put_((rows,), state)
            scale = self.lr / (state.sqrt() + self.eps)
            p.index_put_((rows,), p.index_select(0, rows) - values * scale[:, None])


class TorchRecMethod(Method):
    """TorchRec ``EmbeddingCollection`` row-wise sharded by ``DistributedModelParallel`` on a
    1-rank gloo group, kernel ``fused``: fbgemm's CPU TBE (tables of one config in one
    kernel call) with its fused ``EXACT_SGD`` / ``EXACT_ROWWISE_ADAGRAD`` in backward."""

    name = "torchrec"

    def __init__(self, wl: Workload, dim: int, opt_name: str, initial: List[torch.Tensor]):
        import torch.distributed as dist
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec import EmbeddingCollection
        from torchrec.distributed import DistributedModelParallel
        from torchrec.distributed.embedding import EmbeddingCollectionSharder
        from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
        from torchrec.distributed.types import ShardingEnv, ShardingPlan

        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        kind = {"sgd": EmbOptimType.EXACT_SGD,
                "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}[opt_name]
        sharder = EmbeddingCollectionSharder(
            fused_params={"optimizer": kind, "learning_rate": LEARNING_RATE, "eps": EPS})
        configs = table_configs(wl, dim, wl.rows)
        holder = torch.nn.ModuleDict({"ec": EmbeddingCollection(
            tables=configs, device=torch.device("meta"))})
        per_table = {c.name: row_wise(compute_kernel="fused") for c in configs}
        plan = construct_module_sharding_plan(holder["ec"], per_table, sharder=sharder,
                                              local_size=1, world_size=1, device_type="cpu")
        self.dmp = DistributedModelParallel(
            module=holder, device=torch.device("cpu"), plan=ShardingPlan({"ec": plan}),
            env=ShardingEnv.from_process_group(dist.GroupMember.WORLD), sharders=[sharder])
        by_table = {key.split(".")[-2]: value.local_shards()[0].tensor
                    for key, value in self.dmp.state_dict().items()}
        check(len(by_table) == wl.tables, "torchrec: unexpected shard layout")
        for t, config in enumerate(configs):
            by_table[config.name].detach().copy_(initial[t])
        self.module = self.dmp.module["ec"]


class _HandOut(torch.autograd.Function):
    """``rows`` split into parts of ``sizes``, as a group's one gather is; backward only
    concatenates the parts' gradients, as the fused update needs them."""

    @staticmethod
    def forward(ctx, anchor, rows, sizes):
        ctx.set_materialize_grads(False)
        ctx.sizes = sizes
        return rows.split(sizes)

    @staticmethod
    def backward(ctx, *grads):
        if len(grads) > 1:  # one part is handed on as it is
            torch.cat([g if g is not None else torch.zeros(n, grads[0].shape[1])
                       for g, n in zip(grads, ctx.sizes)])
        return None, None, None


class OutputFloorMethod(Method):
    """What T outputs cost in a step with no lookup and no update: the KJT's lengths per
    feature, one autograd Function with T outputs (the parts of fixed rows), a
    ``JaggedTensor`` per feature, and in backward autograd over T gradients and their
    concatenation. Every way of returning TorchRec's ``Dict[str, JaggedTensor]`` with
    gradients to one update pays at least this; its growth from T=1 to T=256 is the part of
    every method's growth that no embedding can remove."""

    name = FLOOR

    def __init__(self, wl: Workload, dim: int):
        self.rows = torch.randn(wl.tables * wl.per_table, dim,
                                generator=torch.Generator().manual_seed(wl.tables))

    def forward(self, kjt, features: Sequence[str]) -> List[torch.Tensor]:
        from torchrec.sparse.jagged_tensor import JaggedTensor
        keys = kjt.keys()
        lengths = dict(zip(keys, kjt.lengths().split(kjt.stride_per_key())))
        anchor = torch.empty(0, requires_grad=True)
        parts = _HandOut.apply(anchor, self.rows, kjt.length_per_key())
        out = {f: JaggedTensor(values=p, lengths=lengths[f]) for f, p in zip(keys, parts)}
        return [out[f].values() for f in features]


def build_methods(wl: Workload, dim: int, opt_name: str) -> List[Method]:
    bucket = DynamicEmbTableOptions().bucket_size
    fit, small = capacities(wl, bucket)
    width = dim + optimizer_config(opt_name).state_dim(dim)
    hbm_fit = DynembMethod("hbm_fit", wl, dim, opt_name, DynamicEmbTableOptions(
        max_capacity=fit, init_capacity=fit), StorageMode.HBM_DIRECT)
    alone = DynembMethod("hbm_fit_alone", wl, dim, opt_name, DynamicEmbTableOptions(
        max_capacity=fit, init_capacity=fit), StorageMode.HBM_DIRECT, group_tables=False)
    evict = DynembMethod("hbm_evict", wl, dim, opt_name, DynamicEmbTableOptions(
        max_capacity=small, init_capacity=small), StorageMode.HBM_DIRECT)
    cache = DynembMethod("cache", wl, dim, opt_name, DynamicEmbTableOptions(
        max_capacity=fit, caching=True, local_hbm_for_values=small * width * 4),
        StorageMode.CACHE)
    device_rows = {int(s["device_capacity"]) for s in cache.module.stats().values()}
    check(device_rows == {small}, f"cache: device rows {device_rows}, expected {small}")
    initial = hbm_fit.initial_rows(wl, dim)
    return [hbm_fit, evict, cache, alone, TorchSparseMethod(wl, dim, opt_name, initial),
            TorchRecMethod(wl, dim, opt_name, initial), OutputFloorMethod(wl, dim)]


# -- timing ----------------------------------------------------------------------------------
def run_table_counts(cfg, desc: str, steps_each: int, run_config, format_rows, plot,
                     file_stem: str, labels: Dict[str, str]) -> dict:
    """A benchmark over table counts: ``run_config(cfg, Workload(cfg, T), bar)`` for each
    ``T`` of ``cfg.tables`` (``steps_each`` steps each, under one progress bar), then the
    report (machine, config, ``labels``, rows, run time, peak memory) printed with
    ``format_rows``, drawn with ``plot`` and written as ``file_stem``."""
    start, git, load_start = time.perf_counter(), git_state(), load_before_run()
    rows = []
    with tqdm(total=len(cfg.tables) * steps_each, desc=desc, unit="step") as bar:
        for tables in cfg.tables:
            rows.append(run_config(cfg, Workload(cfg, tables), bar))
    report = {"machine": machine_record(git, load_start), "config": config_of(cfg),
              "labels": labels, "rows": rows, "runtime_s": time.perf_counter() - start,
              "peak_rss_gib": peak_rss_gib()}
    print(format_rows(rows))
    write_report(report, cfg.out_dir, report_stem(file_stem, cfg.quick), plot)
    print(f"run time {report['runtime_s']:.0f} s", file=sys.stderr)
    return report


def timed_step(method: Method, wl: Workload, i: int, grads: List[torch.Tensor]):
    """(probe rows, forward seconds, backward seconds) of batch ``i``; KJT construction is
    not timed."""
    kjt = wl.kjt(i, method.dense_ids)
    t0 = time.perf_counter()
    values = method.forward(kjt, wl.features)
    t1 = time.perf_counter()
    method.backward(values, grads)
    t2 = time.perf_counter()
    step = max(1, len(values) // 4)
    probe = torch.cat([v.detach()[:PROBE_ROWS] for v in values[::step]])
    return probe, t1 - t0, t2 - t1


def step_all(methods: List[Method], wl: Workload, i: int, grads: List[torch.Tensor],
             where: str) -> Dict[str, Tuple[float, float]]:
    """Every method trains on batch ``i``, in an order drawn from ``i`` (so background load
    and what the method before left in the caches fall on all alike: a rotation would put
    each method after the same one every time); their probe rows are checked. Returns
    each method's (forward, backward) seconds."""
    order = np.random.default_rng(i).permutation(len(methods))
    probes, out = {}, {}
    for m in (methods[j] for j in order):
        probes[m.name], *out[m.name] = timed_step(m, wl, i, grads)
    check_probes(probes, f"{where}, step {i}")
    return {name: tuple(t) for name, t in out.items()}


def check_probes(probes: Dict[str, torch.Tensor], where: str) -> None:
    for name, rows in probes.items():
        check(bool(torch.isfinite(rows).all()), f"{where}: {name} returned non-finite rows")
    ref = probes["hbm_fit"]
    for name in SAME_ROWS[1:]:
        if not torch.allclose(probes[name], ref, rtol=PROBE_RTOL, atol=PROBE_ATOL):
            worst = float((probes[name] - ref).abs().max())
            check(False, f"{where}: {name}'s embeddings differ from hbm_fit's by up to "
                         f"{worst:.3g}; the methods no longer train alike")


def run_config(cfg, wl: Workload, opt_name: str, bar: tqdm) -> dict:
    """Warm up, then time every method on each batch in turn (in a new order each step)."""
    where = f"T={wl.tables} {opt_name}"
    bar.set_postfix_str(f"{where}: building tables")
    t0 = time.perf_counter()
    methods = build_methods(wl, cfg.dim, opt_name)
    build_s = time.perf_counter() - t0
    grads = wl.gradients(cfg.seed, cfg.dim)
    for i in range(cfg.warmup):
        bar.set_postfix_str(f"{where}: warm-up {i + 1}")
        step_all(methods, wl, i, grads, where)
        bar.update()
    before = {m.name: m.counters() for m in methods if isinstance(m, DynembMethod)}
    # Hundreds of tables make thousands of Python objects per step (outputs, autograd
    # nodes) for every method; a full collection then walks the whole interpreter (0.3 s
    # here) and lands on whichever method is running. Freezing what exists after the
    # warm-up keeps those walks out of every method's steps alike.
    gc.collect()
    gc.freeze()
    times: Dict[str, List[Tuple[float, float]]] = {m.name: [] for m in methods}
    for i in range(cfg.warmup, cfg.warmup + cfg.steps):
        bar.set_postfix_str(f"{where}: step {i + 1}")
        for name, fwd_bwd in step_all(methods, wl, i, grads, where).items():
            times[name].append(fwd_bwd)
        bar.update()
    row = {"tables": wl.tables, "optimizer": opt_name, "ids_per_table": wl.per_table,
           "rows_per_table": wl.rows, "build_s": build_s, "methods": {}}
    bucket = DynamicEmbTableOptions().bucket_size
    row["capacity_fit"], row["capacity_small"] = capacities(wl, bucket)
    for m in methods:
        step_ms = [(f + b) * 1e3 for f, b in times[m.name]]
        entry = {"median_ms": statistics.median(step_ms), "p10_ms": percentile(step_ms, 10),
                 "p90_ms": percentile(step_ms, 90),
                 "forward_ms": statistics.median(f * 1e3 for f, _ in times[m.name]),
                 "backward_ms": statistics.median(b * 1e3 for _, b in times[m.name]),
                 "step_ms": step_ms}
        if isinstance(m, DynembMethod):
            entry["timed_counters"] = check_counters(cfg, wl, m, before[m.name])
        row["methods"][m.name] = entry
    row["eval_ms"] = time_eval(cfg, wl, methods)
    for m in DYNEMB_METHODS:
        for base in BASELINES:
            mine, theirs = row["methods"][m], row["methods"][base]
            row[f"{m}_vs_{base}"] = mine["median_ms"] / theirs["median_ms"]
            row[f"{m}_vs_{base}_paired"] = paired_ratios(mine["step_ms"], theirs["step_ms"])
    del methods
    gc.unfreeze()
    gc.collect()
    return row


#: the methods whose eval forward is timed too (after the training steps and their counters)
EVAL_METHODS = ("hbm_fit", "hbm_fit_alone", "torch_sparse")
EVAL_STEPS = 10


def time_eval(cfg, wl: Workload, methods: List[Method]) -> Dict[str, float]:
    """Median ms of an eval forward (``module.eval()``, ``torch.no_grad()``) of the
    EVAL_METHODS on the timed batches, in an order drawn per batch."""
    chosen = [m for m in methods if m.name in EVAL_METHODS]
    times: Dict[str, List[float]] = {m.name: [] for m in chosen}
    for m in chosen:
        m.module.eval()
    with torch.no_grad():
        for i in range(cfg.warmup, cfg.warmup + min(cfg.steps, EVAL_STEPS)):
            for j in np.random.default_rng(i).permutation(len(chosen)):
                m = chosen[j]
                kjt = wl.kjt(i, m.dense_ids)
                t0 = time.perf_counter()
                m.forward(kjt, wl.features)
                times[m.name].append((time.perf_counter() - t0) * 1e3)
    for m in chosen:
        m.module.train()
    return {name: statistics.median(v) for name, v in times.items()}


def check_counters(cfg, wl: Workload, m: DynembMethod, before: Dict[str, int]) -> dict:
    """The timed steps' counters: every lookup counted; the evicting methods evicted, the
    cache wrote back what it evicted, the fitting tables evicted nothing."""
    after = m.counters()
    delta = {k: after[k] - before[k] for k in COUNTER_NAMES}
    check(delta["lookups"] == cfg.steps * wl.tables * wl.per_table,
          f"{m.name}: counted {delta['lookups']} lookups in the timed steps")
    if m.name.startswith("hbm_fit"):
        check(after["evictions"] == 0, f"hbm_fit evicted {after['evictions']} rows")
    else:
        check(delta["evictions"] > 0, f"{m.name}: nothing was evicted in the timed steps")
    if m.mode is StorageMode.CACHE:
        check(delta["write_backs"] == delta["evictions"], "cache: evictions not written back")
        check(after["store_evictions"] == 0, "cache: the host store dropped rows")
    return delta


# -- report ----------------------------------------------------------------------------------
def targets(rows: List[dict]) -> List[dict]:
    """Per dynemb method and optimizer: step at the most tables <= 1.3x step at the fewest;
    dynemb <= 1.0x the torch sparse embeddings at T=128; step at T=128 <= 2x step at T=1
    (SKIP when T=128 or T=1 was not run)."""
    out = []
    for opt in dict.fromkeys(r["optimizer"] for r in rows):
        mine = sorted((r for r in rows if r["optimizer"] == opt), key=lambda r: r["tables"])
        lo, hi = mine[0], mine[-1]
        at = [r for r in mine if r["tables"] == TORCH_TARGET_TABLES]
        for m in DYNEMB_METHODS:
            value = hi["methods"][m]["median_ms"] / lo["methods"][m]["median_ms"]
            out.append({"optimizer": opt, "method": m, "value": value,
                        "target": f"step at T={hi['tables']} <= {SCALING_TARGET}x step at "
                                  f"T={lo['tables']}", "threshold": SCALING_TARGET,
                        "passed": value <= SCALING_TARGET if len(mine) > 1 else None,
                        "without_output_floor": floor_adjusted(lo, hi, m)})
            value = at[0][f"{m}_vs_torch_sparse"] if at else None
            out.append({"optimizer": opt, "method": m, "value": value,
                        "target": f"<= {TORCH_TARGET}x torch sparse at T={TORCH_TARGET_TABLES}",
                        "threshold": TORCH_TARGET,
                        "passed": None if value is None else value <= TORCH_TARGET})
            one = [r for r in mine if r["tables"] == 1]
            value = (at[0]["methods"][m]["median_ms"] / one[0]["methods"][m]["median_ms"]
                     if at and one else None)
            out.append({"optimizer": opt, "method": m, "value": value,
                        "target": f"step at T={TORCH_TARGET_TABLES} <= {ONE_TABLE_TARGET}x "
                                  f"step at T=1", "threshold": ONE_TABLE_TARGET,
                        "passed": None if value is None else value <= ONE_TABLE_TARGET})
    return out


def floor_adjusted(lo: dict, hi: dict, method: str) -> float:
    """``method``'s step at ``hi`` tables less what the output floor grew from ``lo`` to
    ``hi``, over its step at ``lo``: the scaling its own work shows.

    >>> row = lambda t, ms, floor: {"tables": t, "methods": {"m": {"median_ms": ms},
    ...                                                      FLOOR: {"median_ms": floor}}}
    >>> floor_adjusted(row(1, 5.0, 0.2), row(256, 9.0, 1.7), "m")
    1.5
    """
    grown = hi["methods"][FLOOR]["median_ms"] - lo["methods"][FLOOR]["median_ms"]
    return (hi["methods"][method]["median_ms"] - grown) / lo["methods"][method]["median_ms"]


#: The ratios the table on stdout shows: (column, method, baseline).
SHOWN_RATIOS = (("fit/alone", "hbm_fit", "hbm_fit_alone"),
                ("fit/sparse", "hbm_fit", "torch_sparse"), ("fit/torchrec", "hbm_fit", "torchrec"),
                ("evict/sparse", "hbm_evict", "torch_sparse"),
                ("cache/sparse", "cache", "torch_sparse"))


def format_table(rows: List[dict]) -> str:
    """Median ms per step of every method, then the ratios, one line per T and optimizer."""
    head = (f"{'T':>4} {'opt':<16}" + "".join(f"{m:>14}" for m in METHODS)
            + "".join(f"{c:>14}" for c, _, _ in SHOWN_RATIOS))
    lines = [head + "   (ms per step, median)", "-" * len(head)]
    for r in rows:
        cells = [f"{r['methods'][m]['median_ms']:>14.1f}" for m in METHODS]
        cells += [f"{r[f'{m}_vs_{b}']:>14.2f}" for _, m, b in SHOWN_RATIOS]
        lines.append(f"{r['tables']:>4} {r['optimizer']:<16}" + "".join(cells))
    return "\n".join(lines)


def format_eval(rows: List[dict]) -> str:
    """Eval forward ms per T and optimizer (the tables' group against them one by one)."""
    lines = [f"{'T':>4} {'opt':<16}" + "".join(f"{m:>16}" for m in EVAL_METHODS)
             + "   (eval forward, ms, median)"]
    for r in rows:
        lines.append(f"{r['tables']:>4} {r['optimizer']:<16}"
                     + "".join(f"{r['eval_ms'][m]:>16.1f}" for m in EVAL_METHODS))
    return "\n".join(lines)


def format_targets(results: List[dict]) -> str:
    out = []
    for t in results:
        value = "n/a" if t["value"] is None else f"{t['value']:.2f}"
        line = (f"{verdict(t['passed'])}: {t['method']} ({t['optimizer']}) {t['target']}: "
                f"{value}")
        if t.get("without_output_floor") is not None:
            line += f" ({t['without_output_floor']:.2f} less the output floor's growth)"
        out.append(line)
    return "\n".join(out)


NOTES = [
    "One training step = forward (one row per id, every feature) + backward from fixed "
    "N(0, 1) gradients of every feature's output (no loss or dense layer) + the optimizer "
    "update: fused into backward for dynemb and fbgemm, optimizer.step() for torch sparse. "
    "KJT construction is not timed.",
    "Workload: `ids` ids per step split evenly over T one-feature tables (ids / T each, spread "
    "over `batch` samples); table t's ids are Zipf ranks over its vocabulary of vocab_factor x "
    "ids / T rows, scattered by a fixed permutation; dynemb sees them as distinct 63-bit ids, "
    "the static tables as row numbers.",
    "hbm_fit: HBM_DIRECT with max_capacity = init_capacity = vocabulary / 0.5 (never evicts, "
    "never grows). hbm_evict: HBM_DIRECT with 2x the most distinct ids one step gives a table "
    "(whole buckets), below the ids seen: evicts (and loses) rows. cache: CACHE with that many "
    "device rows (local_hbm_for_values) and max_capacity = hbm_fit's: evicts to the host "
    "store every step, keeps every id.",
    "torch_sparse: TorchRec's unsharded EmbeddingCollection with every nn.Embedding switched "
    "to sparse=True, torch.optim.SGD over all tables, or for row-wise AdaGrad (torch has none) "
    "fbgemm's EXACT_ROWWISE_ADAGRAD rule in torch ops per table (RowwiseAdagrad).",
    "torchrec: EmbeddingCollection row-wise sharded by DistributedModelParallel on a 1-rank "
    "gloo group, compute kernel fused: fbgemm's CPU TBE, all T tables in one kernel call, "
    "EXACT_SGD / EXACT_ROWWISE_ADAGRAD fused into backward.",
    "output_floor: no embedding at all, what returning TorchRec's Dict[str, JaggedTensor] "
    "of T features with gradients to one update costs (lengths per feature, one autograd "
    "Function with T outputs, a JaggedTensor each; backward: autograd over T gradients and "
    "their concatenation). A target's 'less the output floor's growth' takes the floor's "
    "growth from the fewest to the most tables out of the method's step at the most.",
    "eval_ms: after the timed steps (and their counters), an eval forward (module.eval(), "
    "torch.no_grad()) of hbm_fit, hbm_fit_alone and torch_sparse on the first 10 timed "
    "batches, in an order drawn per batch; median ms.",
    "Methods take turns on each batch, in an order drawn per step (seeded by the step). hbm_fit, cache, "
    "torch_sparse and torchrec start from the same rows (dynemb's initializer per id) and must "
    "return the same embeddings at every step (probe rows of 4 features, rtol 1e-3, atol "
    "1e-4; the order of the per-row sums differs).",
]


def plot(report: dict, path: Path) -> None:
    """ms per step against T (log-log), one panel per dynemb method and optimizer, with the
    two baselines in each."""
    rows = report["rows"]
    opts = list(dict.fromkeys(r["optimizer"] for r in rows))
    fig, axes = pyplot().subplots(len(opts), len(DYNEMB_METHODS), squeeze=False,
                                  figsize=(5 * len(DYNEMB_METHODS), 3.8 * len(opts)))
    styles = {"torch_sparse": ("tab:orange", "--"), "torchrec": ("tab:green", ":"),
              "hbm_fit_alone": ("tab:gray", "-."), FLOOR: ("black", ":")}
    for i, opt in enumerate(opts):
        mine = sorted((r for r in rows if r["optimizer"] == opt), key=lambda r: r["tables"])
        ts = [r["tables"] for r in mine]
        for j, m in enumerate(DYNEMB_METHODS):
            ax = axes[i][j]
            for name in (m,) + BASELINES + (FLOOR,):
                med = [r["methods"][name]["median_ms"] for r in mine]
                err = [[a - r["methods"][name]["p10_ms"] for a, r in zip(med, mine)],
                       [r["methods"][name]["p90_ms"] - a for a, r in zip(med, mine)]]
                color, style = styles.get(name, ("tab:blue", "-"))
                ax.errorbar(ts, med, yerr=err, color=color, linestyle=style, marker="o",
                            capsize=3, label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(ts, [str(t) for t in ts])
            ax.set_title(f"{m}, {opt}", fontsize=10)
            ax.set_xlabel(f"tables T ({report['config']['ids']} ids per step in all)")
            ax.set_ylabel("ms per step (median, p10-p90)")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
    save_figure(fig, path)


# -- profile ---------------------------------------------------------------------------------
def profile_phases():
    """The phases of a dynemb training step: (label, owner, attribute) of the function whose
    inclusive time is the phase, and the cProfile (file, function) it maps to. The phases do
    not call each other; :func:`with_rest` adds what they leave out."""
    return [
        ("input split by table (KJT -> per-table ids)", dynemb.modules.dynamic_core, "split_by_table",
         ("dynemb/modules/table_inputs.py", "split_by_table")),
        # the outputs are made in a dict comprehension of DynamicEmbCollection._outputs
        ("output cut (JaggedTensor per feature)", dynemb.modules.collection, "JaggedTensor",
         ("dynemb/modules/collection.py", "<dictcomp>")),
        ("backward grads (occurrence CSR per row)", dynemb.rows.occurrence_grads, "occurrence_csr",
         ("dynemb/rows/occurrence_grads.py", "occurrence_csr")),
        # a group's phases (dynemb.tables.groups): every table is in one
        ("dedup", TableGroup, "dedup", ("dynemb/tables/groups.py", "dedup")),
        ("find_or_insert (claim, pin)", TableGroup, "claim",
         ("dynemb/tables/groups.py", "claim")),
        ("counters of the claim", TableGroup, "_count",
         ("dynemb/tables/groups.py", "_count")),
        ("new rows' initializer", TableGroup, "initialize",
         ("dynemb/tables/groups.py", "initialize")),
        ("gather (rows per occurrence)", GroupBatch, "lookup_occurrences",
         ("dynemb/tables/group_batch.py", "lookup_occurrences")),
        ("fused update (kernel)", dynemb.tables.group_batch, "update_rows_in_place",
         ("dynemb/rows/optimizers.py", "fused_update")),
        ("release pins", GroupStorage, "release",
         ("dynemb/tables/group_storage.py", "release")),
    ]


PREFETCH = "per-table prefetch (dedup .. initializer)"
#: The phases that run inside a table's prefetch.
PREFETCH_PARTS = ("dedup", "find_or_insert (claim, pin)", "counters of the claim",
                  "new rows' initializer")


def profile_run(cfg, tables: int, bar: tqdm) -> dict:
    """HBM_DIRECT (every id fits), SGD, at ``tables`` tables: step times alone, then under
    wrappers timing each phase, then under cProfile (phases by function name)."""
    n = cfg.steps  # steps alone, under the timers, under cProfile: 3n batches after warm-up
    wl = Workload(argparse.Namespace(**{**vars(cfg), "steps": 3 * n}), tables)
    fit, _ = capacities(wl, DynamicEmbTableOptions().bucket_size)
    m = DynembMethod("hbm_fit", wl, cfg.dim, "sgd", DynamicEmbTableOptions(
        max_capacity=fit, init_capacity=fit), StorageMode.HBM_DIRECT)
    grads = wl.gradients(cfg.seed, cfg.dim)

    def steps(first: int) -> List[float]:
        out = []
        for i in range(first, first + n):
            _, fwd, bwd = timed_step(m, wl, i, grads)
            out.append((fwd + bwd) * 1e3)
            bar.update()
        return out

    for i in range(cfg.warmup):
        timed_step(m, wl, i, grads)
        bar.update()
    plain = steps(cfg.warmup)
    timers, phases = PhaseTimers(), profile_phases()
    for label, owner, attr, _ in phases:
        timers.wrap(owner, attr, label)
    timers.wrap(TableGroup, "prefetch", PREFETCH)
    try:
        wrapped = steps(cfg.warmup + n)
    finally:
        timers.restore()
    prof = cProfile.Profile()
    prof.enable()
    profiled = steps(cfg.warmup + 2 * n)
    prof.disable()
    step_w, step_p = statistics.median(wrapped), statistics.median(profiled)
    by_timer = with_rest({label: timers.seconds.get(label, 0.0) / n * 1e3
                          for label, *_ in phases},
                         timers.seconds.get(PREFETCH, 0.0) / n * 1e3, sum(wrapped) / n)
    cum = cprofile_cumulative(prof, n)
    named: Dict[str, float] = {}
    for label, _, _, key in phases:
        named[label] = named.get(label, 0.0) + cum.get(key, 0.0)
    by_name = with_rest(named, cum.get(("dynemb/tables/groups.py", "prefetch"), 0.0),
                        sum(profiled) / n)
    return {"tables": tables, "ids_per_table": wl.per_table, "steps": n,
            "step_ms": statistics.median(plain), "step_ms_all": plain,
            "step_ms_under_timers": step_w, "step_ms_under_cprofile": step_p,
            "phases_ms": by_timer, "phases_ms_cprofile": by_name,
            "calls_per_step": {k: v / n for k, v in timers.calls.items()},
            "prefetch_ms": timers.seconds.get(PREFETCH, 0.0) / n * 1e3,
            "cprofile": profile_tables(prof, n, limit=25)}


def with_rest(phases: Dict[str, float], prefetch: float, step: float) -> Dict[str, float]:
    """``phases`` (ms per step) plus the rest of the tables' ``prefetch`` (its Python around
    the phases it calls: batch record, lookup counters, pins) and the rest of the step.

    >>> with_rest({"dedup": 1.0, "gather": 2.0}, prefetch=1.5, step=5.0)
    {'dedup': 1.0, 'gather': 2.0, 'table.prefetch bookkeeping (the rest of it)': 0.5, \
'python and autograd (the rest of the step)': 1.5}
    """
    inside = sum(v for k, v in phases.items() if k in PREFETCH_PARTS)
    out = dict(phases)
    out["table.prefetch bookkeeping (the rest of it)"] = prefetch - inside
    out["python and autograd (the rest of the step)"] = step - sum(out.values())
    return out


def cprofile_cumulative(prof: cProfile.Profile, steps: int) -> Dict[Tuple[str, str], float]:
    """Cumulative ms per step of every function of the library, by (file, function)."""
    root = str(ROOT) + "/"
    out: Dict[Tuple[str, str], float] = {}
    for (path, _, func), (_, _, _, cum, _) in pstats.Stats(prof).stats.items():
        if path.startswith(root):
            key = (path[len(root):], func)
            out[key] = out.get(key, 0.0) + cum / steps * 1e3
    return out


def run_profile(cfg) -> dict:
    start, git, load_start = time.perf_counter(), git_state(), load_before_run()
    total = len(cfg.profile_tables) * (cfg.warmup + 3 * cfg.steps)
    with tqdm(total=total, desc="tables profile", unit="step") as bar:
        runs = [profile_run(cfg, t, bar) for t in cfg.profile_tables]
    machine = machine_record(git, load_start)
    report = {"machine": machine, "config": config_of(cfg), "runs": runs,
              "notes": ["HBM_DIRECT, every id fits, SGD. phases_ms: inclusive wall time of "
                        "the phase's function (wrapped, summed over the tables) per step; "
                        "phases_ms_cprofile: the same functions' cumulative time under "
                        "cProfile (which slows Python more than the kernels). 'the rest' = "
                        "step - sum of the phases: the Python around them, autograd and "
                        "TorchRec's KJT / JaggedTensor handling."],
              "runtime_s": time.perf_counter() - start, "peak_rss_gib": peak_rss_gib()}
    print(format_profile(runs))
    stem = report_stem(PROFILE_STEM, cfg.quick)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    path = cfg.out_dir / f"{stem}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    return report


def format_profile(runs: List[dict]) -> str:
    labels = list(runs[0]["phases_ms"])
    lines = [f"{'phase (ms per step)':<50}" + "".join(f"{'T=' + str(r['tables']):>16}"
                                                      for r in runs)]
    for label in labels:
        lines.append(f"{label:<50}" + "".join(
            f"{r['phases_ms'][label]:>8.2f} ({r['phases_ms_cprofile'][label]:>5.1f})"
            for r in runs))
    lines.append(f"{'step (alone / under timers / under cProfile)':<50}" + "".join(
        f"{r['step_ms']:>6.1f}/{r['step_ms_under_timers']:.1f}/{r['step_ms_under_cprofile']:.0f}"
        for r in runs))
    return "\n".join(lines)


def machine_record(git, load_start) -> dict:
    """:func:`~benchmarks.common.machine_info` with the load averages before and after the
    run and the thread counts the methods ran with."""
    return dict(machine_info(git, packages=("torchrec", "fbgemm_gpu")),
                loadavg_start=load_start, loadavg_end=os.getloadavg(),
                threads={"torch": torch.get_num_threads(), "numba": numba.get_num_threads(),
                         "idle_openmp_team_parked": any(
                             t.name == "dynemb-idle-openmp-team"
                             for t in threading.enumerate())})


# -- command line ----------------------------------------------------------------------------
def add_workload_options(parser: argparse.ArgumentParser, full: dict) -> None:
    """The options of the :class:`Workload` and its run (table counts, ids, dim, batch,
    vocabulary, Zipf, warm-up and timed steps, threads), for each benchmark that runs it;
    ``full``: its full run's ``tables``, ``ids``, ``warmup`` and ``steps`` (for the help)."""
    tables = " ".join(map(str, full["tables"]))
    parser.add_argument("--tables", type=int, nargs="+",
                        help=f"table counts T (default: {tables})")
    parser.add_argument("--ids", type=int,
                        help=f"ids per step over all tables (default {full['ids']})")
    parser.add_argument("--dim", type=int, default=32, help="embedding dim (default 32)")
    parser.add_argument("--batch", type=int, help="samples per step (default 256)")
    parser.add_argument("--vocab-factor", type=int, default=4,
                        help="rows of each table's vocabulary / its ids per step (default 4)")
    parser.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent (default 1.05)")
    parser.add_argument("--warmup", type=int,
                        help=f"untimed steps first (default {full['warmup']})")
    parser.add_argument("--steps", type=int, help=f"timed steps (default {full['steps']})")
    parser.add_argument("--threads", type=threads_option, default=1,
                        help="torch and numba threads (default 1: on a small shared machine "
                             "a parallel op waits for its slowest thread; 0: every core; "
                             "'library': as a plain script gets them, dynemb.backends.threads' "
                             "defaults and torch's own)")


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = new_parser(__doc__)
    full = {"tables": [1, 8, 64, 128, 256], "ids": 65536, "batch": 256, "warmup": 4,
            "steps": 30, "profile_tables": [1, 128]}
    add_workload_options(parser, full)
    parser.add_argument("--optimizers", nargs="+", choices=["sgd", "rowwise_adagrad"],
                        default=["sgd", "rowwise_adagrad"])
    parser.add_argument("--profile", action="store_true",
                        help="instead of the sweep: where one dynemb step's time goes, per "
                             "phase, at --profile-tables (HBM_DIRECT, SGD); writes "
                             f"{PROFILE_STEM}.json")
    parser.add_argument("--profile-tables", type=int, nargs="+",
                        help="table counts of --profile (default: 1 128)")
    add_run_options(parser, f"tiny smoke run; writes {FILE_STEM}_quick.* "
                            f"({PROFILE_STEM}_quick.json with --profile)")
    cfg = parser.parse_args(argv)
    quick = {"tables": [1, 4], "ids": 2048, "batch": 16, "warmup": 2, "steps": 3,
             "profile_tables": [1, 4]}
    fill_defaults(cfg, quick, full)
    counts = cfg.tables + (cfg.profile_tables if cfg.profile else [])
    refused = [
        (min(cfg.dim, cfg.batch, cfg.steps, cfg.warmup + 1, cfg.vocab_factor, *counts) < 1,
         "--dim, --batch, --steps, --vocab-factor and table counts must be positive, "
         "--warmup >= 0"),
        (any(cfg.ids % t for t in counts),
         f"--ids ({cfg.ids}) must split evenly over every table count {counts}"),
        (cfg.zipf <= 1.0, "--zipf must be > 1 (numpy's Zipf sampler)"),
        (cfg.threads != LIBRARY_THREADS and cfg.threads < 0, "--threads must be >= 0"),
    ]
    for bad, message in refused:
        if bad:
            parser.error(message)
    return cfg


#: ``--threads library``: leave torch's and numba's threads to the libraries' defaults
LIBRARY_THREADS = "library"


def threads_option(text: str):
    """``--threads``: a count, or ``library``.

    >>> threads_option("2"), threads_option("library")
    (2, 'library')
    """
    return LIBRARY_THREADS if text == LIBRARY_THREADS else int(text)


def set_threads(count) -> Tuple[int, int]:
    """Run torch and dynemb's numba kernels on ``count`` threads each (0: every core;
    ``library``: change nothing, dynemb.backends.threads applies its defaults when the first table is
    built); returns (torch threads, numba threads). numba first: starting its OpenMP pool
    sets the process's OpenMP thread count, which torch reads as its own."""
    if count == LIBRARY_THREADS:
        return torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS
    numba_threads = set_numba_threads(count)
    torch.set_num_threads(count or len(os.sched_getaffinity(0)))
    return torch.get_num_threads(), numba_threads


def main(argv: Optional[List[str]] = None) -> dict:
    """Run the sweep (or, with ``--profile``, the profile), print it and write the report."""
    cfg = parse_args(argv)
    set_threads(cfg.threads)
    if cfg.profile:
        return run_profile(cfg)
    start, git, load_start = time.perf_counter(), git_state(), load_before_run()
    rows = []
    total = len(cfg.tables) * len(cfg.optimizers) * (cfg.warmup + cfg.steps)
    with tqdm(total=total, desc="tables bench", unit="step") as bar:
        for tables in cfg.tables:
            wl = Workload(cfg, tables)
            for opt_name in cfg.optimizers:
                rows.append(run_config(cfg, wl, opt_name, bar))
    goals = targets(rows)
    machine = machine_record(git, load_start)
    report = {"machine": machine, "config": config_of(cfg), "labels": LABELS, "notes": NOTES,
              "rows": rows, "targets": goals, "runtime_s": time.perf_counter() - start,
              "peak_rss_gib": peak_rss_gib()}
    print(format_table(rows))
    print()
    print(format_eval(rows))
    print()
    print(format_targets(goals))
    write_report(report, cfg.out_dir, report_stem(FILE_STEM, cfg.quick), plot)
    print(f"run time {report['runtime_s']:.0f} s, peak RSS {report['peak_rss_gib']:.1f} GiB",
          file=sys.stderr)
    return report


if __name__ == "__main__":
    run_command(main)
