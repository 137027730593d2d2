"""A table with no partner: does it cost more as a group of one than on its own path? One
table of each storage mode that groups on the host (HBM_DIRECT, CACHE, HOST_ONLY, DEFAULT,
and HBM_DIRECT with admission), trained as a group of one (the default) and with ``group_tables=False`` (the
table's own path), interleaved step by step on bench_collection's workload (Zipf ids over
1e8, 4,096 samples x 20 ids a step, the CACHE holding a quarter of the ids seen), SGD and
Adam. Both must end with the same counters; the run aborts otherwise.

Run from the repository root::

    .venv/bin/python -m benchmarks.bench_group_of_one           # ~3 minutes
    .venv/bin/python -m benchmarks.bench_group_of_one --quick   # smoke run

Writes ``<out-dir>/group_of_one_cpu.json`` and ``.png``: per mode and optimizer the median
step of each path and the median of the per-step (paired) ratios group of one / own path.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import numba
import torch
from tqdm import tqdm

from benchmarks.bench_collection import cache_rows, hbm_capacity, make_kjt, make_workload
from benchmarks.common import (add_run_options, check, config_of, fill_defaults, git_state,
                               load_before_run, machine_info, new_parser, paired_ratios,
                               pyplot, report_stem, run_command, save_figure, write_report)
from dynemb import DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig, OptimizerType
from dynemb.rows.admission import FrequencyAdmission

FILE_STEM = "group_of_one_cpu"
FEATURE, TABLE = "f0", "t"
MODES = ("hbm_direct", "cache", "host_only", "hbm_admission", "default")
OPTIMIZERS = {"sgd": OptimizerType.SGD, "adam": OptimizerType.ADAM}


def table_options(mode: str, capacity: int, cache_rows_: int, width: int):
    if mode == "cache":
        return DynamicEmbTableOptions(max_capacity=capacity, caching=True,
                                      local_hbm_for_values=cache_rows_ * width * 4)
    if mode == "default":  # the CACHE's device rows, the host tier the rest
        return DynamicEmbTableOptions(max_capacity=capacity,
                                      local_hbm_for_values=cache_rows_ * width * 4)
    if mode == "host_only":
        return DynamicEmbTableOptions(max_capacity=capacity, local_hbm_for_values=0)
    if mode == "hbm_admission":
        return DynamicEmbTableOptions(max_capacity=capacity, admission=FrequencyAdmission(2))
    return DynamicEmbTableOptions(max_capacity=capacity)


def build_pair(mode: str, dim: int, opt: OptimizerConfig, capacity: int, rows: int):
    """(the table as a group of one, the table on its own path)."""
    from torchrec import EmbeddingConfig
    width = dim + opt.state_dim(dim)
    options = {TABLE: table_options(mode, capacity, rows, width)}
    configs = [EmbeddingConfig(name=TABLE, embedding_dim=dim, num_embeddings=capacity,
                               feature_names=[FEATURE])]
    pair = [DynamicEmbCollection(configs, table_options=options, optimizer=opt,
                                 group_tables=grouped) for grouped in (True, False)]
    check(pair[0].table_groups() == [(TABLE,)], f"{mode}: not a group of one")
    check(pair[1].table_groups() == [], f"{mode}: grouped with group_tables=False")
    return pair


def run_pair(cfg, wl, mode: str, dim: int, opt_name: str, bar: tqdm) -> dict:
    opt = OptimizerConfig(OPTIMIZERS[opt_name], learning_rate=0.01)
    bucket = DynamicEmbTableOptions().bucket_size
    pair = build_pair(mode, dim, opt, hbm_capacity(wl.num_distinct, bucket),
                      cache_rows(cfg, wl.num_distinct, bucket))
    times: List[List[float]] = [[], []]
    for i in range(cfg.warmup + cfg.steps):
        for j in ((0, 1) if i % 2 else (1, 0)):  # each path first on every other step
            kjt = make_kjt(wl.raw[i], wl.lengths)
            t0 = time.perf_counter()
            pair[j](kjt)[FEATURE].values().sum().backward()
            if i >= cfg.warmup:
                times[j].append((time.perf_counter() - t0) * 1e3)
        bar.update()
    check(pair[0].stats() == pair[1].stats(), f"{mode} {opt_name}: the two paths counted "
                                              f"differently")
    stats = pair[0].stats()[TABLE]
    return {"mode": mode, "dim": dim, "optimizer": opt_name,
            "group_of_one_ms": statistics.median(times[0]),
            "own_path_ms": statistics.median(times[1]),
            "ratio": statistics.median(times[0]) / statistics.median(times[1]),
            "paired": paired_ratios(times[0], times[1]),
            "evictions": int(stats["evictions"]),
            "admission_rejects": int(stats["admission_rejects"]),
            "step_ms": {"group_of_one": times[0], "own_path": times[1]}}


def plot(report: dict, path: Path) -> None:
    rows = report["rows"]
    fig, ax = pyplot().subplots(figsize=(8, 3.6))
    labels = [f"{r['mode']}\n{r['optimizer']} d{r['dim']}" for r in rows]
    ax.bar(range(len(rows)), [r["paired"]["median"] for r in rows], color="tab:blue")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("group of one / own path\n(median of paired steps)")
    save_figure(fig, path)


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = new_parser(__doc__)
    parser.add_argument("--dims", type=int, nargs="+", help="embedding dims (default 64)")
    parser.add_argument("--batch", type=int, help="samples per step (default 4096)")
    parser.add_argument("--length", type=int, default=20, help="ids per sample (default 20)")
    parser.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent (default 1.05)")
    parser.add_argument("--id-space", type=int, default=10**8)
    parser.add_argument("--cache-fraction", type=float,
                        help="CACHE rows / distinct ids of the run (default 0.25)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 4)")
    parser.add_argument("--steps", type=int, help="timed steps (default 24)")
    add_run_options(parser, f"tiny smoke run; writes {FILE_STEM}_quick.*")
    cfg = parser.parse_args(argv)
    fill_defaults(cfg, {"dims": [16], "batch": 128, "warmup": 1, "steps": 3,
                        "cache_fraction": 0.9},
                  {"dims": [64], "batch": 4096, "warmup": 4, "steps": 24,
                   "cache_fraction": 0.25})
    return cfg


def main(argv: Optional[List[str]] = None) -> dict:
    cfg = parse_args(argv)
    torch.set_num_threads(1)
    numba.set_num_threads(1)
    start, git, load_start = time.perf_counter(), git_state(), load_before_run()
    wl = make_workload(cfg)
    runs = [(m, d, o) for m in MODES for d in cfg.dims for o in OPTIMIZERS]
    rows = []
    with tqdm(total=len(runs) * (cfg.warmup + cfg.steps), desc="group of one",
              unit="step") as bar:
        for mode, dim, opt_name in runs:
            bar.set_postfix_str(f"{mode} d{dim} {opt_name}")
            rows.append(run_pair(cfg, wl, mode, dim, opt_name, bar))
    report = {"machine": dict(machine_info(git), loadavg_start=load_start),
              "config": config_of(cfg), "rows": rows,
              "runtime_s": time.perf_counter() - start}
    for r in rows:
        print(f"{r['mode']:>14} d{r['dim']:<4} {r['optimizer']:>5}: group of one "
              f"{r['group_of_one_ms']:8.2f} ms, own path {r['own_path_ms']:8.2f} ms, "
              f"ratio {r['ratio']:.2f} (paired {r['paired']['median']:.2f})")
    write_report(report, cfg.out_dir, report_stem(FILE_STEM, cfg.quick), plot)
    print(f"run time {report['runtime_s']:.0f} s", file=sys.stderr)
    return report


if __name__ == "__main__":
    run_command(main)
