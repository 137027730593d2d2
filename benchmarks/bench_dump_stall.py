"""The training loop's stall for a dump: ``dump(blocking=True)`` against ``blocking=False``.

One HBM_DIRECT table (dim ``--dim``, SGD) is filled to ``--rows`` rows
(:func:`~dynemb.tables.fill.fill_to_load_factor`), then a training loop runs steps of
``--batch`` Zipf ids (most already in the table, some new). In the same run, alternating
``--repeats`` times, the loop calls a full dump at one step:

- **blocking**: the step's time over the median step: the loop waits for every file;
- **non-blocking**: the step's time over the median step is the snapshot's copy (the
  call's stall); the loop goes on at once and every later step until the files are
  committed is timed too: their time over the median is what the background writing costs
  the loop (page cache, memory bandwidth, the GIL between the writer's calls).

Reported per repeat and as medians: the blocking stall, the non-blocking call's stall, the
ratio of the two (``blocking / non-blocking``), the non-blocking total (call plus the
slowdown while writing), the seconds until its files were committed, and the snapshot's
host memory. Both dumps go to the same directory (``--work-dir``), written over each time.
No timing is asserted. Results: ``results/dump_stall_cpu.json`` and ``.png``.

    .venv/bin/python -m benchmarks.bench_dump_stall            # 8M rows: ~4 GiB RAM, 1.5 GB disk
    .venv/bin/python -m benchmarks.bench_dump_stall --quick    # 50k rows, seconds
"""
from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict

import numpy as np
import torch
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from tqdm import tqdm

from benchmarks.common import (add_run_options, check, config_of, fill_defaults, git_state,
                               machine_info, new_parser, pyplot, report_stem, run_command,
                               save_figure, write_report, zipf_ranks)
from dynemb import DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig, OptimizerType
from dynemb.checkpoint import dump
from dynemb.tables.fill import fill_to_load_factor

LOAD_FACTOR = 0.7


def build(rows: int, dim: int) -> DynamicEmbCollection:
    capacity = -(-int(rows / LOAD_FACTOR) // 128) * 128
    options = DynamicEmbTableOptions(init_capacity=capacity, max_capacity=capacity)
    return DynamicEmbCollection(
        [EmbeddingConfig(name="t", embedding_dim=dim, num_embeddings=capacity,
                         feature_names=["f"])],
        table_options=options, optimizer=OptimizerConfig(OptimizerType.SGD,
                                                         learning_rate=0.01))


class Loop:
    """Training steps on Zipf ids over the table's keys plus new ones; each step timed."""

    def __init__(self, ec: DynamicEmbCollection, batch: int, seed: int):
        keys, _ = ec.tables["t"].tier.hash.image()
        self.keys = keys[keys >= 0].clone()
        self.ec, self.batch = ec, batch
        self.rng = np.random.default_rng(seed)

    def step(self) -> float:
        ranks = zipf_ranks(self.rng, self.batch, 1.05, 2 * self.keys.numel())
        ranks = torch.from_numpy(ranks.astype(np.int64)) - 1  # 0: the most frequent
        ids = torch.where(ranks < self.keys.numel(), self.keys[ranks.clamp(
            max=self.keys.numel() - 1)], ranks + (1 << 50))  # beyond the table: new ids
        kjt = KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.tensor([ids.numel()]))
        start = time.perf_counter()
        self.ec(kjt)["f"].values().sum().backward()
        return time.perf_counter() - start


def one_repeat(loop: Loop, root: Path, args, index: int) -> Dict:
    """A blocking dump and a non-blocking one, each called at a step of the loop."""
    out = {}
    for kind in ("blocking", "non_blocking") if index % 2 == 0 else ("non_blocking",
                                                                     "blocking"):
        shutil.rmtree(root / kind, ignore_errors=True)
        before = [loop.step() for _ in range(args.steps_between)]
        base = statistics.median(before)
        held = loop.ec.tables["t"].tier.hash.size()
        start = time.perf_counter()
        result = dump(loop.ec, root / kind, blocking=(kind == "blocking"))
        call = time.perf_counter() - start
        record = {"median_step_s": base, "call_s": call, "stall_s": call,
                  "steps_before_s": before}
        if kind == "non_blocking":
            during = []
            while not result.done():
                during.append(loop.step())
            info = result.wait()
            record.update(
                written_s=time.perf_counter() - start, steps_during_s=during,
                slowdown_s=sum(max(0.0, t - base) for t in during),
                snapshot_bytes=result.snapshot_bytes)
            record["total_stall_s"] = call + record["slowdown_s"]
        else:
            info = result
        check(info.rows == held, f"the {kind} dump wrote {info.rows} rows of {held}")
        record.update(rows=info.rows, bytes=info.bytes)
        out[kind] = record
    out["ratio"] = out["blocking"]["stall_s"] / out["non_blocking"]["stall_s"]
    return out


def run(args) -> Dict:
    ec = build(args.rows, args.dim)
    report = fill_to_load_factor(ec, args.rows / ec.tables["t"].tier.hash.capacity,
                                 seed=args.seed)["t"]
    rows = ec.tables["t"].tier.hash.size()
    check(rows >= 0.99 * args.rows, f"the table holds {rows} rows of {args.rows}")
    loop = Loop(ec, args.batch, args.seed)
    for _ in range(args.warmup):
        loop.step()
    root = Path(tempfile.mkdtemp(prefix="bench_dump_stall_", dir=args.work_dir))
    try:
        repeats = [one_repeat(loop, root, args, i)
                   for i in tqdm(range(args.repeats), desc="repeats")]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(r[k]["stall_s"] for r in repeats)
           for k in ("blocking", "non_blocking")}
    nb = [r["non_blocking"] for r in repeats]
    return {"rows": rows, "fill_rows": report.rows,
            "row_bytes": ec.tables["t"].row_layout.row_bytes, "repeats": repeats,
            "median": {"blocking_stall_s": med["blocking"],
                       "non_blocking_stall_s": med["non_blocking"],
                       "ratio": statistics.median(r["ratio"] for r in repeats),
                       "non_blocking_total_stall_s": statistics.median(
                           r["total_stall_s"] for r in nb),
                       "non_blocking_written_s": statistics.median(r["written_s"] for r in nb),
                       "median_step_s": statistics.median(
                           r[k]["median_step_s"] for r in repeats
                           for k in ("blocking", "non_blocking")),
                       "snapshot_gib": nb[0]["snapshot_bytes"] / 2 ** 30,
                       "dump_gib": repeats[0]["blocking"]["bytes"] / 2 ** 30}}


def plot(report: Dict, path: Path) -> None:
    plt = pyplot()
    result = report["result"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    reps = result["repeats"]
    x = np.arange(len(reps))
    left.bar(x - 0.2, [r["blocking"]["stall_s"] for r in reps], 0.4, label="blocking")
    left.bar(x + 0.2, [r["non_blocking"]["stall_s"] for r in reps], 0.4,
             label="non-blocking (the call)")
    left.bar(x + 0.2, [r["non_blocking"]["slowdown_s"] for r in reps], 0.4,
             bottom=[r["non_blocking"]["stall_s"] for r in reps],
             label="non-blocking (slower steps while writing)", alpha=0.5)
    left.set_xlabel("repeat")
    left.set_ylabel("seconds the loop stalls")
    left.set_title(f"dump of {result['rows']:,} rows: blocking / non-blocking "
                   f"{result['median']['ratio']:.1f}x")
    left.legend(fontsize=8)
    last = reps[-1]["non_blocking"]
    steps = last["steps_before_s"] + [last["call_s"]] + last["steps_during_s"]
    right.plot(np.array(steps) * 1e3, marker=".")
    right.axvline(len(last["steps_before_s"]), color="gray", linestyle=":")
    right.set_yscale("log")
    right.set_xlabel("step (the dump is called at the dotted line)")
    right.set_ylabel("ms")
    right.set_title("non-blocking: each step, until the files are committed")
    save_figure(fig, path)


def main(argv=None) -> Dict:
    parser = new_parser(__doc__)
    add_run_options(parser, "50k rows, 2 repeats: seconds")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps-between", type=int, default=None)
    parser.add_argument("--work-dir", type=str, default=None,
                        help="where the dumps go (default: the system's temporary folder)")
    args = parser.parse_args(argv)
    fill_defaults(args, {"rows": 50_000, "batch": 2048, "repeats": 2, "steps_between": 3},
                  {"rows": 8_000_000, "batch": 16384, "repeats": 3, "steps_between": 5})
    result = run(args)
    m = result["median"]
    print(f"{result['rows']:,} rows ({m['dump_gib']:.2f} GiB of files), median step "
          f"{m['median_step_s'] * 1e3:.1f} ms")
    print(f"loop stall: blocking {m['blocking_stall_s']:.3f} s, non-blocking "
          f"{m['non_blocking_stall_s']:.3f} s (ratio {m['ratio']:.1f}x); non-blocking with "
          f"the slower steps while writing {m['non_blocking_total_stall_s']:.3f} s, files "
          f"committed after {m['non_blocking_written_s']:.2f} s; snapshot "
          f"{m['snapshot_gib']:.2f} GiB of host memory")
    report = {"benchmark": "dump_stall", "config": config_of(args),
              "machine": machine_info(git_state()), "result": result}
    write_report(report, args.out_dir, report_stem("dump_stall_cpu", args.quick), plot)
    return report


if __name__ == "__main__":
    run_command(main)
