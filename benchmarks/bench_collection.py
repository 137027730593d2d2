"""CPU time of one training step (prefetch + forward + backward with the optimizer update) of
``DynamicEmbCollection`` in HBM_DIRECT and CACHE mode against TorchRec's static
``EmbeddingCollection`` and its ``ManagedCollisionEmbeddingCollection``, measured in the same
run on the same batches.

Run from the repository root::

    .venv/bin/python -m benchmarks.bench_collection            # full run (~2 minutes, 2 idle cores)
    .venv/bin/python -m benchmarks.bench_collection --quick    # seconds-long smoke run

Writes ``<out-dir>/collection_cpu.json`` and ``.png`` (``collection_cpu_quick.*`` with
``--quick``) and prints a table, the ratios and PASS/FAIL lines for the targets (reported,
not asserted). The dynamic and static tables start from the same rows and must return the same
embeddings at every step; a mismatch aborts the run (nothing written).
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numba
import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import dynemb
from benchmarks.common import (add_run_options, check, config_of, fill_defaults,
                               git_state, load_before_run, machine_info,
                               new_parser, paired_ratios, peak_rss_gib, percentile,
                               profile_tables, pyplot, report_stem, run_command, save_figure,
                               verdict, write_report, zipf_ranks)
from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig, OptimizerType,
                    StorageMode)
from dynemb.backends import threads as dynemb_threads
from dynemb.foundations.counters import COUNTER_NAMES

FILE_STEM = "collection_cpu"
TABLE, FEATURE = "t0", "f0"
#: HBM_DIRECT's max_capacity holds the distinct ids at this load factor.
HBM_LOAD = 0.5
LEARNING_RATES = {"sgd": 1e-3, "adam": 1e-3}
ADAM_EPS = 1e-8
#: Embeddings of the methods that start from the same rows must agree this closely (checked
#: at every step on ``PROBES`` output rows spread over the batch).
PROBES, PROBE_RTOL, PROBE_ATOL = 256, 1e-4, 1e-5
#: The cache must hold this many times one batch's distinct ids: they are all pinned at once,
#: and a bucket that receives more pinned keys than it has slots fails the step.
CACHE_HEADROOM = 2.0

METHOD_ORDER = ["hbm_direct", "cache", "static", "static_torch", "managed_collision"]
TARGETS = [  # (ratio, comparison, threshold, description)
    ("hbm_vs_static", "<=", 1.25, "HBM_DIRECT <= 1.25x static"),
    ("hbm_vs_torch_sparse", "<=", 1.5,
     "HBM_DIRECT <= 1.5x a torch sparse embedding with the matching torch optimizer"),
    ("mc_vs_hbm", ">=", 3.0, "managed collision >= 3x HBM_DIRECT"),
    ("cache_vs_hbm", "<=", 1.5, "CACHE <= 1.5x HBM_DIRECT"),
]


# -- workload --------------------------------------------------------------------------------
@dataclass
class Workload:
    """The batches every method trains on: ``raw[i]`` ids in ``[0, id_space)`` for the dynamic
    tables and managed collision, ``dense[i]`` the same ids remapped to ``[0, num_distinct)``
    for the static tables. ``sorted_ids[dense[i]] == raw[i]``."""

    raw: List[torch.Tensor]
    dense: List[torch.Tensor]
    sorted_ids: torch.Tensor
    lengths: torch.Tensor  # [batch], the bag length of every sample
    unique_per_batch: List[int]

    @property
    def num_distinct(self) -> int:
        return self.sorted_ids.numel()


def make_workload(cfg: argparse.Namespace) -> Workload:
    """Zipf ranks mapped to distinct random ids (a fixed random injection of the ranks that
    occur into ``[0, id_space)``, so hot ids are scattered, not contiguous), then remapped to
    dense ids in sorted-id order (random with respect to frequency, like a hash table)."""
    rng = np.random.default_rng(cfg.seed)
    per_batch = cfg.batch * cfg.length
    num_batches = cfg.warmup + cfg.steps
    ranks = zipf_ranks(rng, per_batch * num_batches, cfg.zipf, cfg.id_space)
    unique_ranks, rank_index = np.unique(ranks, return_inverse=True)
    id_of_rank = rng.choice(cfg.id_space, size=unique_ranks.size, replace=False)
    raw = id_of_rank[rank_index].astype(np.int64)
    sorted_ids, dense = np.unique(raw, return_inverse=True)
    raw_t, dense_t = torch.from_numpy(raw), torch.from_numpy(dense.astype(np.int64))
    cuts = [(i * per_batch, (i + 1) * per_batch) for i in range(num_batches)]
    return Workload(
        raw=[raw_t[a:b].clone() for a, b in cuts], dense=[dense_t[a:b].clone() for a, b in cuts],
        sorted_ids=torch.from_numpy(sorted_ids.astype(np.int64)),
        lengths=torch.full((cfg.batch,), cfg.length, dtype=torch.int64),
        unique_per_batch=[int(np.unique(raw[a:b]).size) for a, b in cuts])


def make_kjt(values: torch.Tensor, lengths: torch.Tensor):
    """A fresh one-feature KJT (so no method sees offsets or splits cached by another)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    return KeyedJaggedTensor(keys=[FEATURE], values=values, lengths=lengths.clone())


def upstream_gradient(cfg: argparse.Namespace, dim: int) -> torch.Tensor:
    """[ids per batch, dim] fixed N(0, 1) gradient of the embeddings, what the dense part of a
    model would hand back: every method runs backward from it (no loss is computed, so the
    step times hold no dense work)."""
    gen = torch.Generator().manual_seed(cfg.seed + dim)
    return torch.randn(cfg.batch * cfg.length, dim, generator=gen)


# -- methods ---------------------------------------------------------------------------------
class Method:
    """One implementation under test. A training step is ``prefetch``, ``forward`` (returns the
    [ids, dim] embeddings of the batch) and ``backward`` from the upstream gradient (including
    the optimizer update), each timed on its own."""

    name: str
    label: str
    dense_ids: bool = False  # trains on Workload.dense instead of Workload.raw

    def prefetch(self, kjt) -> None:
        return None

    def forward(self, kjt) -> torch.Tensor:
        raise NotImplementedError

    def backward(self, values: torch.Tensor, grad: torch.Tensor) -> None:
        values.backward(grad)

    def describe(self) -> dict:
        return {}


class DynembMethod(Method):
    """``DynamicEmbCollection``: prefetch, forward, backward (fused update in backward)."""

    def __init__(self, name: str, mode: StorageMode, dim: int, opt: OptimizerConfig,
                 options: DynamicEmbTableOptions):
        from torchrec import EmbeddingConfig
        self.name, self.mode = name, mode
        self.label = f"DynamicEmbCollection {mode.name}"
        self.ec = DynamicEmbCollection(
            [EmbeddingConfig(name=TABLE, embedding_dim=dim, num_embeddings=options.max_capacity,
                             feature_names=[FEATURE])],
            table_options=options, optimizer=opt)
        mode_now = self.ec.storage_modes()[TABLE]
        check(mode_now is mode, f"{name}: expected storage mode {mode.name}, got {mode_now.name}")

    def prefetch(self, kjt) -> None:
        self.ec.prefetch(kjt)

    def forward(self, kjt) -> torch.Tensor:
        return self.ec(kjt)[FEATURE].values()

    def stats(self) -> dict:
        return self.ec.stats()[TABLE]

    def initializer(self):
        table = self.ec.tables[TABLE]
        return table.options.initializer, table.options.seed, table.table_id


class FusedStaticMethod(Method):
    """TorchRec ``EmbeddingCollection`` row-wise sharded on a 1-rank gloo group with fbgemm's
    fused CPU TBE optimizer (the update runs in backward), as in ``tests/torchrec_twin.py``."""

    dense_ids = True

    def __init__(self, dim: int, num_rows: int, lr: float, initial: torch.Tensor):
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec import EmbeddingCollection, EmbeddingConfig
        from torchrec.distributed import DistributedModelParallel
        from torchrec.distributed.embedding import EmbeddingCollectionSharder
        from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
        from torchrec.distributed.types import ShardingEnv, ShardingPlan

        self.name = "static"
        self.label = "TorchRec EC, row-wise sharded (1 rank), fbgemm fused EXACT_SGD"
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        model = _ECWrapper(EmbeddingCollection(
            tables=[EmbeddingConfig(name=TABLE, embedding_dim=dim, num_embeddings=num_rows,
                                    feature_names=[FEATURE])], device=torch.device("meta")))
        sharder = EmbeddingCollectionSharder(
            fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": lr})
        plan = ShardingPlan({"ec": construct_module_sharding_plan(
            model.ec, {TABLE: row_wise(compute_kernel="fused")}, sharder=sharder, local_size=1,
            world_size=1, device_type="cpu")})
        self.dmp = DistributedModelParallel(
            module=model, device=torch.device("cpu"), plan=plan,
            env=ShardingEnv.from_process_group(dist.GroupMember.WORLD), sharders=[sharder])
        shards = [v.local_shards()[0].tensor for v in self.dmp.state_dict().values()]
        check(len(shards) == 1 and tuple(shards[0].shape) == (num_rows, dim),
              "static: unexpected shard layout")
        shards[0].detach().copy_(initial)

    def forward(self, kjt) -> torch.Tensor:
        return self.dmp(kjt)[FEATURE].values()


class _ECWrapper(torch.nn.Module):
    """DMP shards the children of the module it wraps."""

    def __init__(self, ec):
        super().__init__()
        self.ec = ec

    def forward(self, kjt):
        return self.ec(kjt)


class SparseStaticMethod(Method):
    """TorchRec ``EmbeddingCollection``, unsharded, its ``nn.Embedding`` switched to sparse
    gradients, trained by ``torch.optim.SGD`` or ``torch.optim.SparseAdam``."""

    dense_ids = True

    def __init__(self, name: str, dim: int, num_rows: int, opt_name: str, lr: float,
                 initial: torch.Tensor):
        from torchrec import EmbeddingCollection, EmbeddingConfig
        self.name = name
        optimizer = "torch.optim.SGD" if opt_name == "sgd" else "torch.optim.SparseAdam"
        self.label = f"TorchRec EC unsharded, sparse grads, {optimizer}"
        self.ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name=TABLE, embedding_dim=dim, num_embeddings=num_rows,
                                    feature_names=[FEATURE])], device=torch.device("cpu"))
        emb = self.ec.embeddings[TABLE]
        emb.sparse = True
        with torch.no_grad():
            emb.weight.copy_(initial)
        self.opt = SparseOptimizer(opt_name, [emb.weight], lr)

    def forward(self, kjt) -> torch.Tensor:
        return self.ec(kjt)[FEATURE].values()

    def backward(self, values: torch.Tensor, grad: torch.Tensor) -> None:
        self.opt.zero_grad()
        values.backward(grad)
        self.opt.step()


class ManagedCollisionMethod(Method):
    """TorchRec ``ManagedCollisionEmbeddingCollection``: ``MCHManagedCollisionModule`` (LRU,
    ``eviction_interval=1`` so every id gets a slot in the step that first sees it, like a
    dynamic table) over an unsharded EC with sparse gradients and a torch optimizer.

    ``zch_size`` is the number of distinct ids plus the one slot MCH keeps for misses, so it
    never has to evict a live id. (TorchRec's other module, ``HashZchManagedCollisionModule``,
    cannot train on CPU: fbgemm's CPU ``zero_collision_hash`` only runs read-only.)"""

    def __init__(self, dim: int, num_distinct: int, opt_name: str, lr: float, id_space: int,
                 initializer: dynemb.Initializer):
        from torchrec import EmbeddingCollection, EmbeddingConfig
        from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
        from torchrec.modules.mc_modules import (LRU_EvictionPolicy, ManagedCollisionCollection,
                                                 MCHManagedCollisionModule)
        self.name = "managed_collision"
        optimizer = "torch.optim.SGD" if opt_name == "sgd" else "torch.optim.SparseAdam"
        self.label = f"TorchRec MC-EC (MCH, LRU, interval 1), sparse grads, {optimizer}"
        self.zch_size = num_distinct + 1
        ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name=TABLE, embedding_dim=dim, num_embeddings=self.zch_size,
                                    feature_names=[FEATURE])], device=torch.device("cpu"))
        emb = ec.embeddings[TABLE]
        emb.sparse = True
        with torch.no_grad():  # same range as the dynamic tables' rows
            emb.weight.uniform_(initializer.low, initializer.high)
        mch = MCHManagedCollisionModule(
            zch_size=self.zch_size, device=torch.device("cpu"),
            eviction_policy=LRU_EvictionPolicy(), eviction_interval=1, input_hash_size=id_space)
        self.module = ManagedCollisionEmbeddingCollection(
            ec, ManagedCollisionCollection({TABLE: mch}, ec.embedding_configs()))
        self.mch = mch
        self.opt = SparseOptimizer(opt_name, [emb.weight], lr)

    def forward(self, kjt) -> torch.Tensor:
        out, _ = self.module(kjt)
        return out[FEATURE].values()

    def backward(self, values: torch.Tensor, grad: torch.Tensor) -> None:
        self.opt.zero_grad()
        values.backward(grad)
        self.opt.step()

    def describe(self) -> dict:
        free = int(self.mch.open_slots().item())
        return {"zch_size": self.zch_size, "open_slots": free}


class SparseOptimizer:
    """``torch.optim.SGD`` or ``torch.optim.SparseAdam`` on sparse gradients.

    SparseAdam adds eps to ``sqrt(v)`` before the bias correction, fbgemm (and dynemb) to
    ``sqrt(v / (1 - beta2^t))``; the group's eps is rescaled every step to
    ``ADAM_EPS * sqrt(1 - beta2^t)`` so both apply the same eps (it matters for gradient
    elements near eps, and the embeddings are compared across methods)."""

    def __init__(self, opt_name: str, params, lr: float):
        self.adam = opt_name == "adam"
        self.opt = (torch.optim.SparseAdam(params, lr=lr, eps=ADAM_EPS) if self.adam
                    else torch.optim.SGD(params, lr=lr))
        self.t = 0

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def step(self) -> None:
        self.t += 1
        if self.adam:
            for group in self.opt.param_groups:
                group["eps"] = ADAM_EPS * math.sqrt(1.0 - group["betas"][1] ** self.t)
        self.opt.step()


def optimizer_config(opt_name: str) -> OptimizerConfig:
    kind = {"sgd": OptimizerType.SGD, "adam": OptimizerType.ADAM}[opt_name]
    return OptimizerConfig(kind, learning_rate=LEARNING_RATES[opt_name], eps=ADAM_EPS)


def hbm_capacity(num_distinct: int, bucket: int) -> int:
    """HBM_DIRECT's max_capacity: the distinct ids at load ``HBM_LOAD``, whole buckets."""
    return math.ceil(num_distinct / HBM_LOAD / bucket) * bucket


def cache_rows(cfg: argparse.Namespace, num_distinct: int, bucket: int) -> int:
    """Device rows of the CACHE table: ``cache_fraction`` of the distinct ids, whole buckets."""
    return max(bucket, round(cfg.cache_fraction * num_distinct / bucket) * bucket)


def build_methods(cfg, wl: Workload, dim: int, opt_name: str) -> List[Method]:
    """Every method of one configuration, the static tables starting from the rows the
    dynamic tables give the same ids."""
    opt = optimizer_config(opt_name)
    bucket = DynamicEmbTableOptions().bucket_size
    width = dim + opt.state_dim(dim)
    nd = wl.num_distinct
    capacity = hbm_capacity(nd, bucket)
    rows = cache_rows(cfg, nd, bucket)
    hbm = DynembMethod("hbm_direct", StorageMode.HBM_DIRECT, dim, opt,
                       DynamicEmbTableOptions(max_capacity=capacity))
    cache = DynembMethod("cache", StorageMode.CACHE, dim, opt, DynamicEmbTableOptions(
        max_capacity=capacity, caching=True, local_hbm_for_values=rows * width * 4))
    check(cache.stats()["device_capacity"] == rows, "cache: device rows differ from the budget")
    init, seed, table_id = hbm.initializer()
    initial = init.rows(wl.sorted_ids, dim, seed=seed, table_id=table_id)
    lr = LEARNING_RATES[opt_name]
    methods: List[Method] = [hbm, cache]
    if opt_name == "sgd":
        methods.append(FusedStaticMethod(dim, nd, lr, initial))
        methods.append(SparseStaticMethod("static_torch", dim, nd, opt_name, lr, initial))
    else:  # fbgemm's CPU TBE has no Adam: the sparse torch EC is the static baseline
        methods.append(SparseStaticMethod("static", dim, nd, opt_name, lr, initial))
    methods.append(ManagedCollisionMethod(dim, nd, opt_name, lr, cfg.id_space, init))
    return methods


# -- timing ----------------------------------------------------------------------------------
@dataclass
class Row:
    """One method on one configuration: per timed step, the step time and its phases."""

    dim: int
    optimizer: str
    method: str
    label: str
    median_ms: float
    p10_ms: float
    p90_ms: float
    phases_median_ms: Dict[str, float]
    step_ms: List[float]
    extra: Dict[str, object] = field(default_factory=dict)


def timed_step(method: Method, kjt, grad: torch.Tensor
               ) -> Tuple[torch.Tensor, Tuple[float, float, float]]:
    """(probe rows of the embeddings, (prefetch, forward, backward) seconds) of one step."""
    t0 = time.perf_counter()
    method.prefetch(kjt)
    t1 = time.perf_counter()
    values = method.forward(kjt)
    t2 = time.perf_counter()
    method.backward(values, grad)
    t3 = time.perf_counter()
    probe = torch.linspace(0, values.shape[0] - 1, PROBES).long()
    return values.detach()[probe].clone(), (t1 - t0, t2 - t1, t3 - t2)


def batch_of(method: Method, wl: Workload, i: int):
    return make_kjt(wl.dense[i] if method.dense_ids else wl.raw[i], wl.lengths)


def run_config(cfg, wl: Workload, dim: int, opt_name: str, progress: tqdm) -> List[Row]:
    """Warm up, then time every method on each batch in turn (the order rotates per step, so
    background load and cache effects fall on all of them alike)."""
    label = f"dim {dim} {opt_name}"
    progress.set_postfix_str(f"{label}: building tables")
    methods = build_methods(cfg, wl, dim, opt_name)
    grad = upstream_gradient(cfg, dim)
    phases: Dict[str, list] = {m.name: [] for m in methods}
    before: Dict[str, dict] = {}
    for i in range(cfg.warmup + cfg.steps):
        timed = i >= cfg.warmup
        if i == cfg.warmup:
            before = {m.name: m.stats() for m in methods if isinstance(m, DynembMethod)}
        progress.set_postfix_str(f"{label}: {'step' if timed else 'warm-up'} {i + 1}")
        shift = i % len(methods)
        probes = {}
        for method in methods[shift:] + methods[:shift]:
            kjt = batch_of(method, wl, i)
            probes[method.name], times = timed_step(method, kjt, grad)
            if timed:
                phases[method.name].append(times)
        check_embeddings(probes, f"{label}, step {i}")
        progress.update()
    rows = []
    for m in methods:
        totals = [sum(t) * 1e3 for t in phases[m.name]]
        medians = {name: statistics.median(t[k] * 1e3 for t in phases[m.name])
                   for k, name in enumerate(("prefetch", "forward", "backward"))}
        extra = m.describe()
        if isinstance(m, DynembMethod):
            extra.update(dynemb_extra(cfg, wl, m, before[m.name], m.stats()))
        rows.append(Row(dim, opt_name, m.name, m.label, statistics.median(totals),
                        percentile(totals, 10), percentile(totals, 90), medians, totals, extra))
    del methods
    gc.collect()
    return rows


def check_embeddings(probes: Dict[str, torch.Tensor], where: str) -> None:
    """Every method returned finite embeddings; those that start from the same rows (dynamic
    and static tables, not managed collision) returned the same ones."""
    for name, rows in probes.items():
        check(bool(torch.isfinite(rows).all()), f"{where}: {name} returned non-finite rows")
    ref = probes["hbm_direct"]
    for name in ("cache", "static", "static_torch"):
        if name in probes and not torch.allclose(probes[name], ref, rtol=PROBE_RTOL,
                                                 atol=PROBE_ATOL):
            worst = float((probes[name] - ref).abs().max())
            check(False, f"{where}: {name}'s embeddings differ from hbm_direct's by up to "
                         f"{worst:.3g}; the methods no longer train alike")


def dynemb_extra(cfg, wl: Workload, method: DynembMethod, before: dict, after: dict) -> dict:
    """Table counters over the timed steps, checked for consistency; CACHE hit rate."""
    delta = {k: after[k] - before[k] for k in COUNTER_NAMES}
    expected = cfg.steps * cfg.batch * cfg.length
    check(delta["lookups"] == expected,
          f"{method.name}: counted {delta['lookups']} lookups over the timed steps, expected "
          f"{expected}")
    check(after["rows_device"] <= after["device_capacity"], f"{method.name}: size > capacity")
    out = {"timed_counters": delta, "stats_after": after,
           "hit_rate": delta["hits"] / max(1, delta["unique_keys"])}
    if method.mode is StorageMode.CACHE:
        check(delta["evictions"] > 0, "cache: nothing was evicted; the cache is not smaller "
                                      "than the working set")
        check(delta["write_backs"] == delta["evictions"], "cache: evictions not written back")
        if delta["store_evictions"]:  # reported, not fatal: the step times are still valid
            tqdm.write(f"warning: CACHE's backing store dropped {delta['store_evictions']} "
                       f"rows while below its max capacity ({after['rows_backing']} rows "
                       f"stored)", file=sys.stderr)
    else:
        check(after["rows_device"] == wl.num_distinct,
              f"hbm_direct: holds {after['rows_device']} rows, expected every distinct id "
              f"({wl.num_distinct})")
    return out


# -- profile ---------------------------------------------------------------------------------
def profile_dynemb(cfg, wl: Workload, progress: tqdm) -> List[dict]:
    """cProfile of ``--profile`` steps of HBM_DIRECT and CACHE, each alone, after the warm-up
    batches, at the first dim and optimizer: where a dynemb step spends its time."""
    dim, opt_name = cfg.dims[0], cfg.optimizers[0]
    grad = upstream_gradient(cfg, dim)
    methods = [m for m in build_methods(cfg, wl, dim, opt_name) if isinstance(m, DynembMethod)]
    out = []
    for m in methods:
        progress.set_postfix_str(f"profile {m.name}: warm-up")
        for i in range(cfg.warmup):
            timed_step(m, batch_of(m, wl, i), grad)
        progress.set_postfix_str(f"profile {m.name}")
        prof, phases = cProfile.Profile(), []
        steps = range(cfg.warmup, cfg.warmup + cfg.profile)
        for i in steps:
            kjt = batch_of(m, wl, i)
            prof.enable()
            phases.append(timed_step(m, kjt, grad)[1])
            prof.disable()
        n = len(steps)
        out.append({"dim": dim, "optimizer": opt_name, "method": m.name, "steps": n,
                    "step_ms_under_profiler": statistics.median(sum(p) for p in phases) * 1e3,
                    **profile_tables(prof, n)})
    return out


# -- report ----------------------------------------------------------------------------------
def comparisons(rows: List[Row]) -> List[dict]:
    """Per configuration, the target ratios of median step times, plus the median (p10, p90)
    of the per-step paired ratios (same batch, same moment: robust to load drift)."""
    out = []
    for dim, opt_name in dict.fromkeys((r.dim, r.optimizer) for r in rows):
        by = {r.method: r for r in rows if (r.dim, r.optimizer) == (dim, opt_name)}
        entry = {"dim": dim, "optimizer": opt_name,
                 "median_ms": {m: r.median_ms for m, r in by.items()},
                 "static_label": by["static"].label,
                 "cache_hit_rate": by["cache"].extra["hit_rate"]}
        pairs = {"hbm_vs_static": ("hbm_direct", "static"),
                 "mc_vs_hbm": ("managed_collision", "hbm_direct"),
                 "cache_vs_hbm": ("cache", "hbm_direct"),
                 "hbm_vs_static_torch": ("hbm_direct", "static_torch"),
                 # nn.Embedding(sparse=True) + torch.optim: static_torch for SGD, static
                 # (SparseAdam) for Adam
                 "hbm_vs_torch_sparse": ("hbm_direct",
                                         "static_torch" if "static_torch" in by else "static")}
        for name, (num, den) in pairs.items():
            if num not in by or den not in by:
                continue
            entry[name] = by[num].median_ms / by[den].median_ms
            entry[name + "_paired"] = paired_ratios(by[num].step_ms, by[den].step_ms)
        out.append(entry)
    return out


def targets(comps: List[dict]) -> List[dict]:
    out = []
    for c in comps:
        for ratio, op, threshold, name in TARGETS:
            value = c[ratio]
            passed = value <= threshold if op == "<=" else value >= threshold
            out.append({"dim": c["dim"], "optimizer": c["optimizer"], "target": name,
                        "ratio": ratio, "value": value, "threshold": threshold,
                        "passed": passed})
    return out


def format_table(rows: List[Row], comps: List[dict]) -> str:
    header = (f"{'dim':>4} {'opt':<5} {'method':<18} {'median ms':>9} {'p10':>8} {'p90':>8} "
              f"{'prefetch':>8} {'forward':>8} {'backward':>8}  what")
    lines = [header, "-" * (len(header) + 40)]
    for r in rows:
        p = r.phases_median_ms
        lines.append(f"{r.dim:>4} {r.optimizer:<5} {r.method:<18} {r.median_ms:>9.1f} "
                     f"{r.p10_ms:>8.1f} {r.p90_ms:>8.1f} {p['prefetch']:>8.1f} "
                     f"{p['forward']:>8.1f} {p['backward']:>8.1f}  {r.label}")
    lines += ["", f"{'dim':>4} {'opt':<5} {'HBM/static':>10} {'MC/HBM':>8} {'CACHE/HBM':>9} "
                  f"{'HBM/torch-sparse':>16} {'cache hit rate':>14}"]
    for c in comps:
        lines.append(f"{c['dim']:>4} {c['optimizer']:<5} {c['hbm_vs_static']:>10.2f} "
                     f"{c['mc_vs_hbm']:>8.2f} {c['cache_vs_hbm']:>9.2f} "
                     f"{c['hbm_vs_torch_sparse']:>16.2f} "
                     f"{c['cache_hit_rate']:>14.3f}")
    return "\n".join(lines)


def format_targets(results: List[dict]) -> str:
    return "\n".join(f"{verdict(t['passed'])}: {t['target']} (dim {t['dim']}, "
                     f"{t['optimizer']}): {t['value']:.2f}" for t in results)


NOTES = [
    "One training step = prefetch (dynamic tables only) + forward (the lookup: one row per id) "
    "+ backward from a fixed N(0, 1) upstream gradient [ids, dim] (no loss or dense model is "
    "computed) including the optimizer update: fused into backward for the dynamic tables and "
    "fbgemm, optimizer.step() for the torch optimizers. KJT construction is not timed.",
    "Workload: one feature, every sample a bag of `length` ids (EmbeddingCollection returns one "
    "row per id); ids are Zipf ranks truncated to the id space, mapped to distinct random ids. "
    "Static tables see the same ids remapped (untimed) to [0, num_distinct) in sorted-id order.",
    "Methods run in turn on each batch, the order rotating per step; all train on the same "
    "batch sequence. Times are medians (p10, p90) over the timed steps after the warm-up.",
    "hbm_direct, cache and the static tables start from the same rows (the dynamic tables' "
    "initializer applied to each id) and must return the same embeddings at every step "
    "(256 probe rows, rtol 1e-4, atol 1e-5).",
    "static: for SGD TorchRec's EC row-wise sharded on a 1-rank gloo group with fbgemm's fused "
    "EXACT_SGD; for Adam (fbgemm's CPU TBE has no Adam) the unsharded EC with sparse gradients "
    "and torch.optim.SparseAdam. static_torch (SGD only): the unsharded EC with sparse "
    "gradients and torch.optim.SGD, a second static reference.",
    "managed_collision: MCHManagedCollisionModule (LRU, eviction_interval=1, zch_size = distinct "
    "ids + 1) over an unsharded EC with sparse gradients; TorchRec's evict() hook is a no-op.",
    "cache_hit_rate: distinct ids of a batch found in the cache / distinct ids of the batch, "
    "over the timed steps (from ec.stats()).",
]


def plot(report: dict, path: Path) -> None:
    """Left: median step time per method and configuration (p10-p90 whiskers). Right: the
    target ratios with their thresholds."""
    rows, comps = report["rows"], report["comparisons"]
    groups = list(dict.fromkeys((r["dim"], r["optimizer"]) for r in rows))
    methods = [m for m in METHOD_ORDER if any(r["method"] == m for r in rows)]
    value = {(r["dim"], r["optimizer"], r["method"]): r for r in rows}
    fig, (ax, ax_ratio) = pyplot().subplots(1, 2, figsize=(15, 5.2),
                                            gridspec_kw={"width_ratios": [2.2, 1]})
    width = 0.8 / len(methods)
    x = np.arange(len(groups))
    for i, m in enumerate(methods):
        got = [value.get((d, o, m)) for d, o in groups]
        ys = [r["median_ms"] if r else np.nan for r in got]
        err = [[r["median_ms"] - r["p10_ms"] if r else 0 for r in got],
               [r["p90_ms"] - r["median_ms"] if r else 0 for r in got]]
        ax.bar(x + (i - (len(methods) - 1) / 2) * width, ys, width, yerr=err, capsize=2,
               label=m)
    static = {(r["dim"], r["optimizer"]): "fbgemm fused SGD" if "fbgemm" in r["label"] else
              "torch SparseAdam" for r in rows if r["method"] == "static"}
    ax.set_xticks(x, [f"dim {d}, {o}\n(static: {static.get((d, o), '-')})" for d, o in groups])
    ax.set_ylabel("ms per training step (median, p10-p90)")
    ax.set_title("one training step: prefetch + forward + backward with update")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ratios = [(name, desc, threshold) for name, _, threshold, desc in TARGETS]
    width = 0.8 / len(ratios)
    for i, (name, desc, threshold) in enumerate(ratios):
        xs = x + (i - (len(ratios) - 1) / 2) * width
        bars = ax_ratio.bar(xs, [c[name] for c in comps], width, label=desc)
        ax_ratio.hlines([threshold] * len(xs), xs - width / 2, xs + width / 2, colors="black",
                        linestyles="dashed", linewidth=1)
        ax_ratio.bar_label(bars, fmt="%.2f", fontsize=7)
    ax_ratio.set_xticks(x, [f"dim {c['dim']}\n{c['optimizer']}" for c in comps])
    ax_ratio.set_yscale("log")
    values = [c[name] for c in comps for name, _, _ in ratios]
    low, high = min(0.5, min(values)) / 1.5, max(3.0, max(values)) * 4
    ticks = [t for t in (0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 20, 50) if low <= t <= high]
    ax_ratio.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax_ratio.set_ylim(low, high)
    ax_ratio.minorticks_off()
    ax_ratio.set_ylabel("ratio of median step times, log scale (dashes: target)")
    ax_ratio.set_title("ratios")
    ax_ratio.grid(axis="y", alpha=0.3)
    ax_ratio.legend(fontsize=7, loc="upper left")
    save_figure(fig, path)


# -- command line ----------------------------------------------------------------------------
def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = new_parser(__doc__)
    parser.add_argument("--dims", type=int, nargs="+", help="embedding dims (default: 64 128)")
    parser.add_argument("--optimizers", nargs="+", choices=["sgd", "adam"],
                        default=["sgd", "adam"])
    parser.add_argument("--batch", type=int, help="samples per batch (default: 4096)")
    parser.add_argument("--length", type=int, help="ids per sample (default: 20)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default: 6)")
    parser.add_argument("--steps", type=int, help="timed steps (default: 36)")
    parser.add_argument("--cache-fraction", type=float,
                        help="CACHE device rows / distinct ids of the run (default: 0.1)")
    parser.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent (default 1.05)")
    parser.add_argument("--id-space", type=int, default=10**8,
                        help="ids are drawn from [0, id_space) (default 1e8)")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="also cProfile this many HBM_DIRECT and CACHE steps (first dim "
                             "and optimizer) and report dynemb's heaviest functions")
    parser.add_argument("--numba-threads", type=int, default=0,
                        help="numba threads of dynemb's kernels (default 0: every core, as the "
                             "results in benchmarks/README.md were measured; the library's own "
                             "default, one core less, is what bench_threads.py measures)")
    add_run_options(parser, f"tiny smoke run (dim 16, batch 128); writes {FILE_STEM}_quick.*")
    cfg = parser.parse_args(argv)
    quick = {"dims": [16], "batch": 128, "length": 20, "warmup": 2, "steps": 3,
             "cache_fraction": 0.5}
    full = {"dims": [64, 128], "batch": 4096, "length": 20, "warmup": 6, "steps": 36,
            "cache_fraction": 0.1}
    fill_defaults(cfg, quick, full)
    if min(cfg.batch, cfg.length, cfg.steps, cfg.warmup + 1, *cfg.dims) < 1:
        parser.error("--batch, --length, --steps and --dims must be positive, --warmup >= 0")
    if not 0.0 < cfg.cache_fraction < 1.0:
        parser.error("--cache-fraction must lie in (0, 1)")
    if cfg.profile > cfg.steps:
        parser.error("--profile cannot exceed --steps (it profiles the timed batches)")
    if cfg.zipf <= 1.0:
        parser.error("--zipf must be > 1 (numpy's Zipf sampler)")
    if cfg.numba_threads < 0:
        parser.error("--numba-threads must be >= 0")
    return cfg


def set_numba_threads(count: int) -> int:
    """Run dynemb's kernels on ``count`` numba threads (0: every core), instead of the
    library's default (dynemb.backends.threads), which would cap them when the first table is
    built; returns the count in use."""
    os.environ[dynemb_threads.SWITCH] = "off"
    numba.set_num_threads(count or numba.config.NUMBA_NUM_THREADS)
    return numba.get_num_threads()


def check_cache_fits(cfg, wl: Workload) -> None:
    bucket = DynamicEmbTableOptions().bucket_size
    rows, most = cache_rows(cfg, wl.num_distinct, bucket), max(wl.unique_per_batch)
    check(rows >= CACHE_HEADROOM * most,
          f"the cache ({rows} rows = {cfg.cache_fraction} x {wl.num_distinct} distinct ids) is "
          f"too small to pin one batch's {most} distinct ids with headroom "
          f"({CACHE_HEADROOM}x); raise --cache-fraction or --warmup/--steps (more distinct ids)")


def main(argv: Optional[List[str]] = None) -> dict:
    """Run the benchmark, print the tables and targets, write JSON and PNG; returns the report."""
    cfg = parse_args(argv)
    numba_threads = set_numba_threads(cfg.numba_threads)
    start, git, load_start = time.perf_counter(), git_state(), load_before_run()
    wl = make_workload(cfg)
    check_cache_fits(cfg, wl)
    bucket = DynamicEmbTableOptions().bucket_size
    configs = [(d, o) for d in cfg.dims for o in cfg.optimizers]
    rows: List[Row] = []
    profile = []
    total = len(configs) * (cfg.warmup + cfg.steps)
    with tqdm(total=total, desc="collection bench", unit="step") as progress:
        for dim, opt_name in configs:
            rows += run_config(cfg, wl, dim, opt_name, progress)
        if cfg.profile:
            profile = profile_dynemb(cfg, wl, progress)
    comps = comparisons(rows)
    goals = targets(comps)
    machine = machine_info(git, packages=("torchrec", "fbgemm_gpu"))
    machine.update({"loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                    "torch_threads": torch.get_num_threads(), "numba_threads": numba_threads})
    report = {
        "machine": machine,
        "config": config_of(cfg),
        "workload": {"num_distinct": wl.num_distinct, "ids_per_batch": cfg.batch * cfg.length,
                     "unique_per_batch": wl.unique_per_batch,
                     "hbm_direct_capacity": hbm_capacity(wl.num_distinct, bucket),
                     "cache_rows": cache_rows(cfg, wl.num_distinct, bucket)},
        "notes": NOTES,
        "rows": [asdict(r) for r in rows],
        "comparisons": comps,
        "targets": goals,
        "profile": profile,
        "runtime_s": time.perf_counter() - start,
        "peak_rss_gib": peak_rss_gib(),
    }
    print(format_table(rows, comps))
    print()
    print(format_targets(goals))
    for p in profile:
        print(f"\nprofile {p['method']} (dim {p['dim']}, {p['optimizer']}, "
              f"{p['step_ms_under_profiler']:.1f} ms/step under cProfile), ms per step:")
        for f in p["functions"][:20]:
            print(f"  cum {f['cum_ms']:7.2f}  own {f['own_ms']:7.2f}  {f['function']}")
        for op in p["torch_ops"][:10]:
            print(f"  torch {op['own_ms']:7.2f}  {op['call']}")
    write_report(report, cfg.out_dir, report_stem(FILE_STEM, cfg.quick), plot)
    print(f"run time {report['runtime_s']:.0f} s, peak RSS {report['peak_rss_gib']:.1f} GiB")
    return report


if __name__ == "__main__":
    run_command(main)
