"""What a sweep of expiry costs per million rows, against a training step in the same run.

An HBM_DIRECT table (LRU) is filled with ``rows`` keys over ``age_steps`` training steps (each
step inserts its share, so the rows' ages spread evenly), then, on identical copies, three
things are timed: a sweep that erases nothing (``older_than`` above every age: the cost of
reading every row's score), a sweep that erases about half the rows, and one training step
of ``ids`` Zipf ids (the unit a ``ttl_steps`` sweep is paid in, every ``expire_every``
steps). The erased count must equal what the keys' ages say; a mismatch aborts the run.

Run from the repository root::

    .venv/bin/python -m benchmarks.bench_expiry            # 1M and 4M rows (~1 minute)
    .venv/bin/python -m benchmarks.bench_expiry --quick    # seconds-long smoke run

Writes ``<out-dir>/expiry_cpu.json`` and ``.png`` (ms per million rows, per table size).
"""
from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch
from torchrec import EmbeddingConfig, KeyedJaggedTensor
from tqdm import tqdm

from benchmarks.common import (add_run_options, check, config_of, fill_defaults, git_state,
                               machine_info, new_parser, pyplot, report_stem, run_command,
                               save_figure, set_numba_threads, write_report, zipf_ranks)
from dynemb import DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig, OptimizerType

FILE_STEM = "expiry_cpu"
FEATURE = "f"


def kjt(ids: np.ndarray) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync([FEATURE], torch.from_numpy(ids),
                                               torch.tensor([ids.size]))


def filled_module(rows: int, age_steps: int, dim: int) -> DynamicEmbCollection:
    """A module whose table holds keys ``0..rows-1``, key ``k`` last used at step
    ``k * age_steps // rows + 1``."""
    config = EmbeddingConfig(name="t", embedding_dim=dim, num_embeddings=rows,
                             feature_names=[FEATURE])
    ec = DynamicEmbCollection([config], table_options=DynamicEmbTableOptions(),
                              optimizer=OptimizerConfig(OptimizerType.SGD, learning_rate=0.01))
    for part in np.array_split(np.arange(rows, dtype=np.int64), age_steps):
        out = ec(kjt(part))
        out[FEATURE].values().sum().backward()
    return ec


def timed(fn, rounds: int) -> float:
    """Median ms of ``fn()`` over ``rounds`` calls (each on its own fresh copy)."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run_size(cfg, rows: int, bar: tqdm) -> dict:
    ec = filled_module(rows, cfg.age_steps, cfg.dim)
    check(ec.stats()["t"]["rows_device"] == rows, "the table did not take every row")
    half = cfg.age_steps // 2
    copies = [copy.deepcopy(ec) for _ in range(cfg.rounds)]
    ec.expire(older_than=cfg.age_steps + 1)  # compiles the sweep's kernels
    none_ms = timed(lambda: check(ec.expire(older_than=cfg.age_steps + 1) == {"t": 0},
                                  "a sweep past every age erased rows"), cfg.rounds)
    want = sum(1 for k in range(rows) if cfg.age_steps - (k * cfg.age_steps // rows + 1) >= half)
    erased = []
    half_ms = timed(lambda: erased.append(copies.pop().expire(older_than=half)["t"]),
                    cfg.rounds)
    check(set(erased) == {want}, f"erased {erased}, the ages say {want}")
    rng = np.random.default_rng(cfg.seed)
    batches = [zipf_ranks(rng, cfg.ids, 1.05, rows).astype(np.int64) for _ in range(cfg.steps)]

    def train():
        out = ec(kjt(batches.pop()))
        out[FEATURE].values().sum().backward()
    step_ms = timed(train, cfg.steps)
    bar.update()
    per_million = 1e6 / rows
    return {"rows": rows, "erased_half": want, "sweep_nothing_ms": none_ms,
            "sweep_half_ms": half_ms, "train_step_ms": step_ms,
            "sweep_nothing_ms_per_million_rows": none_ms * per_million,
            "sweep_half_ms_per_million_rows": half_ms * per_million,
            "sweep_nothing_vs_step": none_ms / step_ms, "sweep_half_vs_step": half_ms / step_ms}


def plot(report: dict, path: Path) -> None:
    rows = report["rows"]
    fig, ax = pyplot().subplots(figsize=(6, 3.8))
    x = [r["rows"] / 1e6 for r in rows]
    for key, label in (("sweep_nothing_ms", "sweep erasing nothing"),
                       ("sweep_half_ms", "sweep erasing half the rows"),
                       ("train_step_ms", f"one training step of {report['config']['ids']} ids")):
        ax.plot(x, [r[key] for r in rows], "o-", label=label)
    per_m = ", ".join(f"{r['sweep_nothing_ms_per_million_rows']:.0f}" for r in rows)
    ax.set_title(f"a sweep: {per_m} ms per million rows", fontsize=9)
    ax.set_xlabel("rows in the table (millions)")
    ax.set_ylabel("ms")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def parse_args(argv: Optional[List[str]]):
    parser = new_parser(__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", help="rows (default 1M 4M)")
    parser.add_argument("--age-steps", type=int, help="steps the rows are spread over "
                        "(default 32)")
    parser.add_argument("--ids", type=int, help="ids of the training step (default 65536)")
    parser.add_argument("--dim", type=int, default=32, help="embedding dim (default 32)")
    parser.add_argument("--rounds", type=int, help="sweeps timed per size (default 3)")
    parser.add_argument("--steps", type=int, help="training steps timed (default 10)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch and numba threads (default 1)")
    add_run_options(parser, f"tiny smoke run; writes {FILE_STEM}_quick.*")
    cfg = parser.parse_args(argv)
    fill_defaults(cfg, {"sizes": [20_000], "age_steps": 8, "ids": 2048, "rounds": 2,
                        "steps": 3},
                  {"sizes": [1 << 20, 1 << 22], "age_steps": 32, "ids": 65536, "rounds": 3,
                   "steps": 10})
    if min(*cfg.sizes, cfg.age_steps, cfg.ids, cfg.rounds, cfg.steps) < 1:
        parser.error("sizes, --age-steps, --ids, --rounds and --steps must be positive")
    return cfg


def main(argv: Optional[List[str]] = None) -> dict:
    cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    set_numba_threads(cfg.threads)
    print(f"filling {len(cfg.sizes)} tables of up to {max(cfg.sizes):,} rows, then sweeping")
    with tqdm(total=len(cfg.sizes), desc="expiry bench", unit="table") as bar:
        rows = [run_size(cfg, n, bar) for n in cfg.sizes]
    report = {"machine": machine_info(git_state()), "config": config_of(cfg), "rows": rows}
    for r in rows:
        print(f"{r['rows']:>9,} rows: sweep {r['sweep_nothing_ms_per_million_rows']:7.1f} "
              f"ms/M rows (erasing half: {r['sweep_half_ms_per_million_rows']:7.1f}); "
              f"= {r['sweep_nothing_vs_step']:.2f} / {r['sweep_half_vs_step']:.2f} "
              f"training steps of {cfg.ids} ids ({r['train_step_ms']:.1f} ms)")
    write_report(report, cfg.out_dir, report_stem(FILE_STEM, cfg.quick), plot)
    return report


if __name__ == "__main__":
    run_command(main)
