"""Tables that grow: a training run in which T HBM_DIRECT tables start at a small
``init_capacity`` and double up to the capacity that holds every id, trained as one group
(each growth re-lays the group's arrays) next to the same tables run one by one
(``group_tables=False``, as tables that grow trained before they could group), the same
tables created at their full size (no growth), and a torch sparse embedding per table, in
the same run on the same batches (bench_tables' workload: Zipf ids, T one-feature tables).

Every step is timed, growth steps included: the report gives each method's median step, its
whole run (the sum, where the growth steps count), and the ratios of the grouped tables to
the others, per step (paired) and over the run. The grouped and the one-by-one tables must
return bit-identical embeddings at every step, and both the full-size tables' (to float
tolerance); a mismatch aborts the run.

Run from the repository root::

    .venv/bin/python -m benchmarks.bench_growth             # T = 1, 26, 128 (~2 minutes)
    .venv/bin/python -m benchmarks.bench_growth --quick     # seconds-long smoke run

Writes ``<out-dir>/growth_cpu.json`` and ``.png`` (step time over the run, per T).
"""
from __future__ import annotations

import argparse
import gc
import statistics
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.bench_tables import (FIT_LOAD, PROBE_ATOL, PROBE_RTOL, DynembMethod,
                                     TorchSparseMethod, Workload, run_table_counts, set_threads,
                                     threads_option, timed_step, whole_buckets)
from benchmarks.common import (add_run_options, check, fill_defaults, new_parser,
                               paired_ratios, pyplot, run_command, save_figure)
from dynemb import DynamicEmbTableOptions, StorageMode

FILE_STEM = "growth_cpu"
GROUPED, ALONE, FULL, TORCH = "grow_grouped", "grow_alone", "full_size", "torch_sparse"
LABELS = {
    GROUPED: "dynemb HBM_DIRECT growing from init_capacity, tables grouped (the default)",
    ALONE: "the same tables run one by one (group_tables=False)",
    FULL: "dynemb HBM_DIRECT created at the full capacity (never grows), grouped",
    TORCH: "nn.Embedding(sparse=True) per table (TorchRec EC, unsharded) + torch SGD",
}


def build_methods(wl: Workload, dim: int, init_fraction: int) -> List:
    bucket = DynamicEmbTableOptions().bucket_size
    fit = whole_buckets(wl.rows / FIT_LOAD, bucket)  # every id fits, as bench_tables' hbm_fit
    init = whole_buckets(fit / init_fraction, bucket)
    growing = DynamicEmbTableOptions(init_capacity=init, max_capacity=fit)
    methods = [DynembMethod(GROUPED, wl, dim, "sgd", growing, StorageMode.HBM_DIRECT),
               DynembMethod(ALONE, wl, dim, "sgd", growing, StorageMode.HBM_DIRECT,
                            group_tables=False),
               DynembMethod(FULL, wl, dim, "sgd", DynamicEmbTableOptions(
                   init_capacity=fit, max_capacity=fit), StorageMode.HBM_DIRECT)]
    check(len(methods[0].module.table_groups()) == 1, "the growing tables did not group")
    check(all(len(g) == 1 for g in methods[1].module.table_groups()),
          "group_tables=False made groups of more than one table")
    methods.append(TorchSparseMethod(wl, dim, "sgd", methods[0].initial_rows(wl, dim)))
    return methods


def capacity_of(method: DynembMethod) -> int:
    return sum(int(s["device_capacity"]) for s in method.module.stats().values())


def run_config(cfg, wl: Workload, bar: tqdm) -> dict:
    """Every method on every batch (in an order drawn per batch), from the first step."""
    methods = build_methods(wl, cfg.dim, cfg.init_fraction)
    grads = wl.gradients(cfg.seed, cfg.dim)
    times: Dict[str, List[float]] = {m.name: [] for m in methods}
    capacity = {m.name: [] for m in methods[:2]}
    gc.collect()
    for i in range(cfg.steps):
        bar.set_postfix_str(f"T={wl.tables}: step {i + 1}")
        probes = {}
        for j in np.random.default_rng(i).permutation(len(methods)):
            m = methods[j]
            probes[m.name], fwd, bwd = timed_step(m, wl, i, grads)
            times[m.name].append((fwd + bwd) * 1e3)
        for m in methods[:2]:
            capacity[m.name].append(capacity_of(m))
        check(torch.equal(probes[GROUPED], probes[ALONE]),
              f"T={wl.tables}, step {i}: grouped and one-by-one tables differ")
        for name in (FULL, TORCH):
            check(torch.allclose(probes[name], probes[GROUPED], rtol=PROBE_RTOL,
                                 atol=PROBE_ATOL),
                  f"T={wl.tables}, step {i}: {name} differs from the growing tables")
        bar.update()
    check(capacity[GROUPED] == capacity[ALONE], "grouped and one-by-one tables grew apart")
    row = {"tables": wl.tables, "ids_per_table": wl.per_table, "rows_per_table": wl.rows,
           "capacity_start": capacity[GROUPED][0], "capacity_end": capacity[GROUPED][-1],
           "growth_steps": sum(1 for a, b in zip(capacity[GROUPED], capacity[GROUPED][1:])
                               if b != a),
           "capacity_per_step": capacity[GROUPED], "methods": {}}
    for name, step_ms in times.items():
        row["methods"][name] = {"median_ms": statistics.median(step_ms),
                                "total_ms": sum(step_ms), "step_ms": step_ms}
    mine = times[GROUPED]
    for base in (ALONE, FULL, TORCH):
        row[f"{GROUPED}_vs_{base}"] = statistics.median(mine) / statistics.median(times[base])
        row[f"{GROUPED}_vs_{base}_total"] = sum(mine) / sum(times[base])
        row[f"{GROUPED}_vs_{base}_paired"] = paired_ratios(mine, times[base])
    return row


def format_rows(rows: List[dict]) -> str:
    lines = [f"{'T':>4} {'growths':>7} " + " ".join(f"{n:>13}" for n in LABELS)
             + "   grouped/alone (median, run)   grouped/full   grouped/torch"]
    for r in rows:
        ms = " ".join(f"{r['methods'][n]['median_ms']:>10.2f} ms" for n in LABELS)
        lines.append(f"{r['tables']:>4} {r['growth_steps']:>7} {ms}   "
                     f"{r[f'{GROUPED}_vs_{ALONE}']:>8.2f} {r[f'{GROUPED}_vs_{ALONE}_total']:>6.2f}"
                     f"{'':>15}{r[f'{GROUPED}_vs_{FULL}']:>6.2f}"
                     f"{r[f'{GROUPED}_vs_{TORCH}']:>16.2f}")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    rows = report["rows"]
    fig, axes = pyplot().subplots(1, len(rows), squeeze=False, figsize=(5 * len(rows), 3.8))
    for ax, r in zip(axes[0], rows):
        for name in LABELS:
            ax.plot(r["methods"][name]["step_ms"], label=name, lw=1.2)
        for i, (a, b) in enumerate(zip(r["capacity_per_step"], r["capacity_per_step"][1:])):
            if b != a:  # the step in which the tables grew
                ax.axvline(i + 1, color="grey", lw=0.6, ls=":")
        ax.set_title(f"T={r['tables']}: grouped/alone {r[f'{GROUPED}_vs_{ALONE}']:.2f}x")
        ax.set_xlabel("step (dotted: a growth)")
        ax.set_ylabel("step ms")
        ax.set_yscale("log")
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path)


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = new_parser(__doc__)
    parser.add_argument("--tables", type=int, nargs="+", help="table counts T "
                        "(default: 1 26 128)")
    parser.add_argument("--ids", type=int, help="ids per step over all tables (default 26624)")
    parser.add_argument("--dim", type=int, default=32, help="embedding dim (default 32)")
    parser.add_argument("--batch", type=int, help="samples per step (default 256)")
    parser.add_argument("--vocab-factor", type=int, default=4,
                        help="rows of each table's vocabulary / its ids per step (default 4)")
    parser.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent (default 1.05)")
    parser.add_argument("--steps", type=int, help="steps, all timed (default 24)")
    parser.add_argument("--init-fraction", type=int, default=16,
                        help="init_capacity = the full capacity / this (default 16)")
    parser.add_argument("--threads", type=threads_option, default=1,
                        help="torch and numba threads (default 1; 'library': the defaults)")
    add_run_options(parser, f"tiny smoke run; writes {FILE_STEM}_quick.*")
    cfg = parser.parse_args(argv)
    fill_defaults(cfg, {"tables": [1, 4], "ids": 2048, "batch": 16, "steps": 4},
                  {"tables": [1, 26, 128], "ids": 26624, "batch": 256, "steps": 24})
    cfg.warmup = 0  # bench_tables' workload: every step is timed here
    if min(cfg.dim, cfg.batch, cfg.steps, cfg.init_fraction, *cfg.tables) < 1 or any(
            cfg.ids % t for t in cfg.tables):
        parser.error("--dim, --batch, --steps, --init-fraction and table counts must be "
                     "positive, and --ids must split evenly over every table count")
    return cfg


def prime_kernels(dim: int) -> None:
    """Compile the kernels a growing group runs (numba compiles at first call), so that the
    first method to grow does not pay for it."""
    cfg = argparse.Namespace(seed=0, ids=512, batch=8, vocab_factor=4, zipf=1.05, warmup=0,
                             steps=4)
    wl = Workload(cfg, 2)
    grads = wl.gradients(0, dim)
    methods = build_methods(wl, dim, 64)
    start = capacity_of(methods[0])
    for m in methods:
        for i in range(cfg.steps):
            timed_step(m, wl, i, grads)
    check(capacity_of(methods[0]) > start, "the warm-up run did not grow its tables")


def main(argv: Optional[List[str]] = None) -> dict:
    cfg = parse_args(argv)
    set_threads(cfg.threads)
    prime_kernels(cfg.dim)
    return run_table_counts(cfg, "growth bench", cfg.steps, run_config, format_rows, plot,
                            FILE_STEM, LABELS)


if __name__ == "__main__":
    run_command(main)
