"""Step times of a plain training script under CPU load, with and without dynemb's default
thread settings (:mod:`dynemb.foundations.threads`), next to TorchRec's ``EmbeddingCollection`` in the
same process.

Each configuration runs in a fresh Python process (thread settings are fixed at import): a
small model (one embedding table, a dense layer over its outputs) trained step by step,
a ``DynamicEmbCollection`` and TorchRec's ``EmbeddingCollection`` (sparse gradients,
``torch.optim.SGD``) taking turns on the same batches. Busy-loop processes, one per core,
load the machine while the configurations run, one after the other, in rounds (so drifting
background load falls on every configuration alike). A step is prefetch + forward + the
dense layer + backward + the optimizers; times are reported as median, p99 and mean, and as
the ratio of dynemb's to TorchRec's in the same process.

Run from the repository root::

    .venv/bin/python -m benchmarks.bench_threads            # about 3 minutes on a quiet 2-core machine, 10 or more when shared
    .venv/bin/python -m benchmarks.bench_threads --quick    # smoke run, about 40 seconds
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent

#: configuration name -> environment variables of its process. DYNEMB_THREADS=off turns
#: dynemb's thread default off (numba on every core, as before it); the last two are what a
#: user could set by hand instead (a wait policy set before torch loads; numba's other layer).
CONFIGS: Dict[str, Dict[str, str]] = {
    "no default (DYNEMB_THREADS=off)": {"DYNEMB_THREADS": "off"},
    "dynemb default": {},
    "off + OMP_WAIT_POLICY=PASSIVE": {"DYNEMB_THREADS": "off", "OMP_WAIT_POLICY": "PASSIVE"},
    "off + numba workqueue layer": {"DYNEMB_THREADS": "off",
                                    "NUMBA_THREADING_LAYER": "workqueue"},
}
#: variables of the parent's environment a configuration must not inherit
CLEARED = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "NUMBA_NUM_THREADS", "NUMBA_THREADING_LAYER",
           "OMP_NUM_THREADS", "DYNEMB_THREADS")


# -- the worker: one configuration in its own process ----------------------------------------
def worker(args: argparse.Namespace) -> dict:
    """Train both models in turn for ``args.steps`` steps; return their step times (s) and a
    check that the two learned the same rows."""
    import numba
    import torch
    from torchrec import EmbeddingCollection, EmbeddingConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, Initializer,
                        InitializerKind, OptimizerConfig, OptimizerType)

    dim, lr = args.dim, 0.05
    config = EmbeddingConfig(name="t", embedding_dim=dim, num_embeddings=args.ids,
                             feature_names=["f"])
    init = Initializer(InitializerKind.UNIFORM, low=-0.05, high=0.05)
    dyn = DynamicEmbCollection([config], table_options=DynamicEmbTableOptions(
        initializer=init, seed=1, max_capacity=2 * args.ids),
        optimizer=OptimizerConfig(OptimizerType.SGD, learning_rate=lr))
    ref = EmbeddingCollection([config])
    table = dyn.tables["t"]
    with torch.no_grad():
        ref.embeddings["t"].weight.copy_(init.rows(torch.arange(args.ids), dim, seed=1,
                                                   table_id=table.table_id))
    ref.embeddings["t"].sparse = True
    dense = {name: torch.nn.Sequential(torch.nn.Linear(dim, 256), torch.nn.ReLU(),
                                       torch.nn.Linear(256, 1)) for name in ("dynemb", "torchrec")}
    dense["torchrec"].load_state_dict(dense["dynemb"].state_dict())
    opts = {"dynemb": torch.optim.SGD(dense["dynemb"].parameters(), lr=lr),
            "torchrec": torch.optim.SGD([*dense["torchrec"].parameters(),
                                         *ref.parameters()], lr=lr)}
    modules = {"dynemb": dyn, "torchrec": ref}
    g = torch.Generator().manual_seed(0)
    ids = args.batch * args.length

    def step(name: str, kjt) -> float:
        start = time.perf_counter()
        opts[name].zero_grad()
        emb = modules[name](kjt)["f"].values()
        loss = dense[name](emb).square().mean()
        loss.backward()
        opts[name].step()
        return time.perf_counter() - start

    times: Dict[str, List[float]] = {"dynemb": [], "torchrec": []}
    for i in range(args.warmup + args.steps):
        values = torch.randint(0, args.ids, (ids,), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            ["f"], values, torch.full((args.batch,), args.length))
        order = ["dynemb", "torchrec"] if i % 2 == 0 else ["torchrec", "dynemb"]
        for name in order:
            t = step(name, kjt)
            if i >= args.warmup:
                times[name].append(t)
    probe = torch.arange(0, args.ids, max(1, args.ids // 256))
    rows, found = dyn.read_rows("t", probe)
    diff = float((rows[found] - ref.embeddings["t"].weight.detach()[probe][found]).abs().max())
    return {"times_s": times, "max_row_diff": diff,
            "numba_threads": numba.get_num_threads(), "torch_threads": torch.get_num_threads(),
            "threading_layer": numba.threading_layer(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}


# -- the parent: load the machine, run every configuration in rounds --------------------------
def _busy() -> None:
    while True:
        pass


def run_config(name: str, args: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(CONFIGS[name])
    cmd = [sys.executable, "-m", "benchmarks.bench_threads", "--worker",
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
           "--length", str(args.length), "--dim", str(args.dim), "--ids", str(args.ids)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"configuration {name!r} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(times: List[float]) -> dict:
    ms = sorted(t * 1e3 for t in times)
    p99 = ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))]
    return {"median_ms": statistics.median(ms), "p99_ms": p99, "mean_ms": statistics.fmean(ms),
            "max_ms": ms[-1]}


def measure(args: argparse.Namespace, load: int) -> Dict[str, dict]:
    """Every configuration, ``args.rounds`` times in turn, with ``load`` busy processes."""
    busy = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(load)]
    for p in busy:
        p.start()
    try:
        runs: Dict[str, List[dict]] = {name: [] for name in CONFIGS}
        for _ in range(args.rounds):
            for name in CONFIGS:
                runs[name].append(run_config(name, args))
                print(f"  load {load}: {name}: dynemb median "
                      f"{statistics.median(runs[name][-1]['times_s']['dynemb']) * 1e3:.1f} ms",
                      file=sys.stderr)
    finally:
        for p in busy:
            p.terminate()
            p.join()
    return {name: _combine(r) for name, r in runs.items()}


def _combine(runs: List[dict]) -> dict:
    dyn = [t for r in runs for t in r["times_s"]["dynemb"]]
    ref = [t for r in runs for t in r["times_s"]["torchrec"]]
    s_dyn, s_ref = summarize(dyn), summarize(ref)
    worst = max(r["max_row_diff"] for r in runs)
    if worst > 1e-4:
        raise RuntimeError(f"dynemb and TorchRec learned different rows (max diff {worst})")
    return {"dynemb": s_dyn, "torchrec": s_ref,
            "ratio": {k: s_dyn[k] / s_ref[k] for k in ("median_ms", "p99_ms", "mean_ms")},
            "settings": {k: runs[0][k] for k in ("numba_threads", "torch_threads",
                                                  "threading_layer", "omp_wait_policy")},
            "max_row_diff": worst, "times_s": {"dynemb": dyn, "torchrec": ref}}


def format_table(results: Dict[str, Dict[str, dict]]) -> str:
    lines = [f"{'load':>4}  {'configuration':<30} {'numba':>5} {'layer':>9} "
             f"{'dynemb ms med/p99/mean':>24} {'torchrec ms med/p99/mean':>26} "
             f"{'ratio med/p99/mean':>20}"]
    for load, per in results.items():
        for name, r in per.items():
            d, t, q, s = r["dynemb"], r["torchrec"], r["ratio"], r["settings"]
            lines.append(
                f"{load:>4}  {name:<30} {s['numba_threads']:>5} {s['threading_layer']:>9} "
                f"{d['median_ms']:>7.1f} {d['p99_ms']:>7.1f} {d['mean_ms']:>7.1f}   "
                f"{t['median_ms']:>7.1f} {t['p99_ms']:>7.1f} {t['mean_ms']:>7.1f}   "
                f"{q['median_ms']:>5.2f} {q['p99_ms']:>6.2f} {q['mean_ms']:>6.2f}")
    return "\n".join(lines)


def plot(results: Dict[str, Dict[str, dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = list(results)
    fig, axes = plt.subplots(1, len(loads), figsize=(6 * len(loads), 4.5), squeeze=False)
    for ax, load in zip(axes[0], loads):
        names = list(results[load])
        data = [[t * 1e3 for t in results[load][n]["times_s"][who]]
                for n in names for who in ("dynemb", "torchrec")]
        labels = [f"{n}\n{who}" for n in names for who in ("dynemb", "torchrec")]
        ax.boxplot(data, whis=(1, 99), showmeans=True)
        ax.set_xticks(range(1, len(labels) + 1), labels, rotation=70, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("step time (ms, log)")
        ax.set_title(f"{load} busy processes")
    fig.suptitle("training step times, whiskers p1-p99, triangle: mean")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="runs of each configuration per load")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--length", type=int, default=20)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--ids", type=int, default=200_000)
    p.add_argument("--loads", type=int, nargs="+", default=None,
                   help="busy processes per run (default: 0 and the number of cores)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rounds, args.batch = 8, 2, 1, 256
    if args.loads is None:
        args.loads = [0, len(os.sched_getaffinity(0))]
    return args


def main(argv: Optional[List[str]] = None) -> dict:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return {}
    import numba

    from benchmarks.common import git_state, machine_info
    numba.get_num_threads()  # machine_info names the threading layer: start it (this process only)
    report = {"machine": machine_info(git_state(), packages=["torchrec"]),
              "config": {k: v for k, v in vars(args).items() if k not in ("worker", "out_dir")},
              "configurations": CONFIGS, "load_average_before": os.getloadavg()}
    results = {load: measure(args, load) for load in args.loads}
    report["load_average_after"] = os.getloadavg()
    report["results"] = {str(k): v for k, v in results.items()}
    print(format_table(results))
    stem = "threads_cpu_quick" if args.quick else "threads_cpu"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1))
    plot(results, args.out_dir / f"{stem}.png")
    print(f"wrote {args.out_dir / stem}.json and .png")
    return report


if __name__ == "__main__":
    main()
