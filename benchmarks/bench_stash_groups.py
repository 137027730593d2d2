"""Memory stashing of table groups: T HBM_DIRECT tables that stash their rows between each
forward and its backward (``StashMode.ALL``), trained as one group (the group's rows go to
host memory and back as one tensor, one copy each way) next to the same tables one by one
(``group_tables=False``: T stashes and T restores a step, as stashing tables trained before
they could group) and the same grouped tables without stashing, in the same run on the same
batches (bench_tables' workload: Zipf ids, T one-feature tables, SGD).

Every step is timed (forward with its stash, backward with its restore). The three must
return bit-identical embeddings at every step; a mismatch aborts the run. The report gives
each method's median step and the paired ratios of the grouped stashing tables to the
others. On CPU the "device" is host memory, so the copies are memcpy: the ratios say what
the group saves in calls and Python, not in transfer time (that needs a GPU).

Run from the repository root::

    .venv/bin/python -m benchmarks.bench_stash_groups           # T = 1, 26, 128 (~2 minutes)
    .venv/bin/python -m benchmarks.bench_stash_groups --quick   # seconds-long smoke run

Writes ``<out-dir>/stash_groups_cpu.json`` and ``.png``.
"""
from __future__ import annotations

import gc
import statistics
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.bench_tables import (FIT_LOAD, DynembMethod, Workload, add_workload_options,
                                     run_table_counts, set_threads, timed_step, whole_buckets)
from benchmarks.common import (add_run_options, check, fill_defaults, new_parser,
                               paired_ratios, pyplot, run_command, save_figure)
from dynemb import DynamicEmbTableOptions, StorageMode
from dynemb.options import StashMode

FILE_STEM = "stash_groups_cpu"
GROUPED, ALONE, PLAIN = "stash_grouped", "stash_alone", "no_stash"
LABELS = {
    GROUPED: "dynemb HBM_DIRECT, StashMode.ALL, tables grouped (the default)",
    ALONE: "the same stashing tables one by one (group_tables=False)",
    PLAIN: "the same tables grouped, without stashing",
}


def build_methods(wl: Workload, dim: int) -> List[DynembMethod]:
    fit = whole_buckets(wl.rows / FIT_LOAD, DynamicEmbTableOptions().bucket_size)

    def options(stash: StashMode) -> DynamicEmbTableOptions:
        return DynamicEmbTableOptions(init_capacity=fit, max_capacity=fit, stash=stash)

    methods = [DynembMethod(GROUPED, wl, dim, "sgd", options(StashMode.ALL),
                            StorageMode.HBM_DIRECT),
               DynembMethod(ALONE, wl, dim, "sgd", options(StashMode.ALL),
                            StorageMode.HBM_DIRECT, group_tables=False),
               DynembMethod(PLAIN, wl, dim, "sgd", options(StashMode.NONE),
                            StorageMode.HBM_DIRECT)]
    check(len(methods[0].module.table_groups()) == 1, "the stashing tables did not group")
    check(all(len(g) == 1 for g in methods[1].module.table_groups()),
          "group_tables=False made groups of more than one table")
    return methods


def run_config(cfg, wl: Workload, bar: tqdm) -> dict:
    """Every method on every batch (in an order drawn per batch), after ``cfg.warmup``
    untimed steps; each stash is checked to have left the rows."""
    methods = build_methods(wl, cfg.dim)
    grads = wl.gradients(cfg.seed, cfg.dim)
    times: Dict[str, List[float]] = {m.name: [] for m in methods}
    gc.collect()
    for i in range(cfg.warmup + cfg.steps):
        bar.set_postfix_str(f"T={wl.tables}: step {i + 1}")
        probes = {}
        for j in np.random.default_rng(i).permutation(len(methods)):
            m = methods[j]
            probes[m.name], fwd, bwd = timed_step(m, wl, i, grads)
            if i >= cfg.warmup:
                times[m.name].append((fwd + bwd) * 1e3)
        for name in (ALONE, PLAIN):
            check(torch.equal(probes[GROUPED], probes[name]),
                  f"T={wl.tables}, step {i}: {name} differs from the grouped stashing tables")
        bar.update()
    for m in methods[:2]:
        stashes = {s.stashes for s in m.module.memory_stash.table_stashes().values()}
        check(stashes == {cfg.warmup + cfg.steps}, f"{m.name}: stashed {stashes} times")
    row = {"tables": wl.tables, "ids_per_table": wl.per_table, "rows_per_table": wl.rows,
           "stashed_mib": methods[0].module.memory_stash.table_stashes()[
               next(iter(methods[0].module.tables))].stashed_bytes / 2 ** 20,
           "methods": {}}
    for name, step_ms in times.items():
        row["methods"][name] = {"median_ms": statistics.median(step_ms), "step_ms": step_ms}
    for base in (ALONE, PLAIN):
        row[f"{GROUPED}_vs_{base}"] = paired_ratios(times[GROUPED], times[base])
    return row


def format_rows(rows: List[dict]) -> str:
    lines = [f"{'T':>4} {'MiB':>7} " + " ".join(f"{n:>13}" for n in LABELS)
             + "   grouped/alone   grouped/no_stash (median of paired steps)"]
    for r in rows:
        ms = " ".join(f"{r['methods'][n]['median_ms']:>10.2f} ms" for n in LABELS)
        lines.append(f"{r['tables']:>4} {r['stashed_mib']:>7.1f} {ms}   "
                     f"{r[f'{GROUPED}_vs_{ALONE}']['median']:>13.2f}"
                     f"{r[f'{GROUPED}_vs_{PLAIN}']['median']:>19.2f}")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    rows = report["rows"]
    fig, ax = pyplot().subplots(figsize=(6, 3.8))
    x = np.arange(len(rows))
    width = 0.8 / len(LABELS)
    for k, name in enumerate(LABELS):
        ax.bar(x + k * width, [r["methods"][name]["median_ms"] for r in rows], width,
               label=name)
    ax.set_xticks(x + width, [f"T={r['tables']}\ngrouped/alone "
                              f"{r[f'{GROUPED}_vs_{ALONE}']['median']:.2f}x" for r in rows])
    ax.set_ylabel("median step ms")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def parse_args(argv: Optional[List[str]]):
    parser = new_parser(__doc__)
    full = {"tables": [1, 26, 128], "ids": 26624, "batch": 256, "steps": 20, "warmup": 3}
    add_workload_options(parser, full)
    add_run_options(parser, f"tiny smoke run; writes {FILE_STEM}_quick.*")
    cfg = parser.parse_args(argv)
    fill_defaults(cfg, {"tables": [1, 4], "ids": 2048, "batch": 16, "steps": 3, "warmup": 1},
                  full)
    if min(cfg.dim, cfg.batch, cfg.steps, *cfg.tables) < 1 or cfg.warmup < 0 or any(
            cfg.ids % t for t in cfg.tables):
        parser.error("--dim, --batch, --steps and table counts must be positive, --warmup "
                     "at least 0, and --ids must split evenly over every table count")
    return cfg


def main(argv: Optional[List[str]] = None) -> dict:
    cfg = parse_args(argv)
    set_threads(cfg.threads)
    return run_table_counts(cfg, "stash groups bench", cfg.warmup + cfg.steps, run_config,
                            format_rows, plot, FILE_STEM, LABELS)


if __name__ == "__main__":
    run_command(main)
