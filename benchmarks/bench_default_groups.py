"""DEFAULT tables as one group against the same tables one by one: T DEFAULT tables (a device
budget below the ids seen, the host tier holding the rest) trained as a group (the default)
and with ``group_tables=False``, on bench_tables' workload (the same 65,536 ids a step over
T one-feature tables, Zipf over each table's vocabulary), interleaved step by step in one
process. Both must return the same embeddings bit for bit and end with the same counters;
the run aborts otherwise.

Run from the repository root::

    .venv/bin/python -m benchmarks.bench_default_groups            # ~3 minutes
    .venv/bin/python -m benchmarks.bench_default_groups --quick    # smoke run

Writes ``<out-dir>/default_groups_cpu.json`` and ``.png``: per table count and optimizer the
median step of each path and the median of the per-step (paired) ratios grouped / alone, with
the tables' capacity holding every id, and below the ids seen (both tiers evict).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import List, Optional

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.bench_tables import (Workload, add_workload_options, capacities,
                                     optimizer_config, set_threads, table_configs)
from benchmarks.common import (add_run_options, check, config_of, fill_defaults, git_state,
                               load_before_run, machine_info, new_parser, paired_ratios,
                               pyplot, report_stem, run_command, save_figure, write_report)
from dynemb import DynamicEmbCollection, DynamicEmbTableOptions, StorageMode

FILE_STEM = "default_groups_cpu"
PATHS = ("grouped", "alone")


#: how many rows the tables hold in all: the whole vocabulary at half load ("fits"), or twice
#: the device tier, below the ids seen ("evicts", in both tiers)
CAPACITIES = ("fits", "evicts")


def build_pair(wl: Workload, dim: int, opt_name: str,
               capacity: str) -> List[DynamicEmbCollection]:
    """(the DEFAULT tables grouped, the same tables one by one): each table's device tier
    holds twice one step's distinct ids (bench_tables' evicting capacity), its host tier the
    rest of ``capacity`` (:data:`CAPACITIES`)."""
    bucket = DynamicEmbTableOptions().bucket_size
    fit, small = capacities(wl, bucket)
    rows = fit if capacity == "fits" else 2 * small
    width = dim + optimizer_config(opt_name).state_dim(dim)
    options = DynamicEmbTableOptions(max_capacity=rows, local_hbm_for_values=small * width * 4)
    pair = [DynamicEmbCollection(table_configs(wl, dim, rows), table_options=options,
                                 optimizer=optimizer_config(opt_name), group_tables=grouped)
            for grouped in (True, False)]
    for module in pair:
        modes = set(module.storage_modes().values())
        check(modes == {StorageMode.DEFAULT}, f"expected DEFAULT tables, got {modes}")
    check(len(pair[0].table_groups()) == 1, "the DEFAULT tables did not group")
    check(all(len(g) == 1 for g in pair[1].table_groups()),
          "group_tables=False made groups of more than one table")
    return pair


def run_config(cfg, wl: Workload, opt_name: str, capacity: str, bar: tqdm) -> dict:
    pair = build_pair(wl, cfg.dim, opt_name, capacity)
    grads = wl.gradients(cfg.seed, cfg.dim)
    times: List[List[float]] = [[], []]
    for i in range(cfg.warmup + cfg.steps):
        outs = [None, None]
        for j in np.random.default_rng(i).permutation(2):  # an order drawn per step
            kjt = wl.kjt(i, dense=False)
            t0 = time.perf_counter()
            out = pair[j](kjt)
            values = [out[f].values() for f in wl.features]
            torch.autograd.backward(values, grads)
            if i >= cfg.warmup:
                times[j].append((time.perf_counter() - t0) * 1e3)
            outs[j] = torch.cat([v.detach() for v in values])
        check(torch.equal(outs[0], outs[1]),
              f"T={wl.tables} {opt_name}, step {i}: grouped and alone returned different rows")
        bar.update()
    check(pair[0].stats() == pair[1].stats(),
          f"T={wl.tables} {opt_name}: the two paths counted differently")
    stats = pair[0].stats().values()
    if capacity == "evicts" and not cfg.quick:  # (a quick run sees too few ids to evict)
        check(sum(int(s["evictions"]) for s in stats) > 0, f"T={wl.tables}: no evictions")
    return {"tables": wl.tables, "optimizer": opt_name, "capacity": capacity,
            "grouped_ms": statistics.median(times[0]), "alone_ms": statistics.median(times[1]),
            "ratio": statistics.median(times[0]) / statistics.median(times[1]),
            "paired": paired_ratios(times[0], times[1]),
            "rows_device": sum(int(s["rows_device"]) for s in stats),
            "rows_host": sum(int(s["rows_backing"]) for s in stats),
            "evictions": sum(int(s["evictions"]) for s in stats),
            "step_ms": dict(zip(PATHS, times))}


def plot(report: dict, path) -> None:
    rows = report["rows"]
    fig, ax = pyplot().subplots(figsize=(7, 3.6))
    for key in sorted({(r["optimizer"], r["capacity"]) for r in rows}):
        mine = [r for r in rows if (r["optimizer"], r["capacity"]) == key]
        ax.plot([r["tables"] for r in mine], [r["paired"]["median"] for r in mine], "o-",
                label=" ".join(key))
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("DEFAULT tables (65,536 ids a step over all)")
    ax.set_ylabel("grouped / one by one\n(median of paired steps)")
    ax.legend()
    save_figure(fig, path)


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = new_parser(__doc__)
    full = {"tables": [1, 8, 64, 128], "ids": 65536, "batch": 256, "warmup": 3, "steps": 12}
    add_workload_options(parser, full)
    parser.add_argument("--optimizers", nargs="+", choices=["sgd", "rowwise_adagrad"],
                        default=["sgd", "rowwise_adagrad"])
    add_run_options(parser, f"tiny smoke run; writes {FILE_STEM}_quick.*")
    cfg = parser.parse_args(argv)
    fill_defaults(cfg, {"tables": [1, 4], "ids": 2048, "batch": 16, "warmup": 3, "steps": 2},
                  full)
    if any(cfg.ids % t for t in cfg.tables):
        parser.error(f"--ids ({cfg.ids}) must split evenly over every table count "
                     f"{cfg.tables}")
    return cfg


def main(argv: Optional[List[str]] = None) -> dict:
    cfg = parse_args(argv)
    set_threads(cfg.threads)
    start, git, load_start = time.perf_counter(), git_state(), load_before_run()
    rows = []
    total = (len(cfg.tables) * len(cfg.optimizers) * len(CAPACITIES)
             * (cfg.warmup + cfg.steps))
    with tqdm(total=total, desc="DEFAULT groups", unit="step") as bar:
        for tables in cfg.tables:
            wl = Workload(cfg, tables)
            for opt_name in cfg.optimizers:
                for capacity in CAPACITIES:
                    bar.set_postfix_str(f"T={tables} {opt_name} {capacity}")
                    rows.append(run_config(cfg, wl, opt_name, capacity, bar))
    report = {"machine": dict(machine_info(git), loadavg_start=load_start),
              "config": config_of(cfg), "rows": rows,
              "runtime_s": time.perf_counter() - start}
    for r in rows:
        print(f"T={r['tables']:<4} {r['optimizer']:>15} {r['capacity']:>6}: grouped {r['grouped_ms']:8.2f} ms, "
              f"alone {r['alone_ms']:8.2f} ms, ratio {r['ratio']:.2f} "
              f"(paired {r['paired']['median']:.2f}); rows {r['rows_device']} device, "
              f"{r['rows_host']} host, {r['evictions']} evictions")
    write_report(report, cfg.out_dir, report_stem(FILE_STEM, cfg.quick), plot)
    print(f"run time {report['runtime_s']:.0f} s", file=sys.stderr)
    return report


if __name__ == "__main__":
    run_command(main)
