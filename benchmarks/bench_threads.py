"""Step times of a plain training script under CPU load, with and without dynemb's default
thread settings (:mod:`dynemb.backends.threads`), next to TorchRec's ``EmbeddingCollection`` in the
same process.

Each configuration runs in a fresh Python process (thread settings are fixed at import): a
small model (one embedding table, a dense layer over its outputs) trained step by step,
a ``DynamicEmbCollection`` and TorchRec's ``EmbeddingCollection`` (sparse gradients,
``torch.optim.SGD``) taking turns on the same batches. Busy-loop processes, one per core,
load the machine while the configurations run, one after the other, in rounds (so drifting
background load falls on every configuration alike). A step is prefetch + forward + the
dense layer + backward + the optimizers; times are reported as median, p99 and mean, and as
the ratio of dynemb's to TorchRec's in the same process.

``--tables-workload`` measures instead the many-tables step of ``bench_tables.py`` (65,536 ids
per step over 128 one-feature tables and over one, HBM_DIRECT, dim 32, SGD, forward and
backward, next to torch sparse embeddings on the same ids in the same process) under each
environment of :data:`TABLE_CONFIGS`, with the library's thread defaults (nothing set by the
script), for this checkout and, with ``--before REV``, for the library at commit REV, the two
taking turns in every round.

Run from the repository root::

    .venv/bin/python -m benchmarks.bench_threads            # about 3 minutes on a quiet 2-core machine, 10 or more when shared
    .venv/bin/python -m benchmarks.bench_threads --quick    # smoke run, about 40 seconds
    .venv/bin/python -m benchmarks.bench_threads --tables-workload --before c525657   # ~10 minutes
    .venv/bin/python -m benchmarks.bench_threads --idle-cpu --rounds 3   # seconds
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
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
#: ``--tables-workload``: configuration name -> environment variables of its process
TABLE_CONFIGS: Dict[str, Dict[str, str]] = {
    "none set": {},
    "DYNEMB_THREADS=off": {"DYNEMB_THREADS": "off"},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE": {"OMP_NUM_THREADS": "1",
                                                  "OMP_WAIT_POLICY": "PASSIVE"},
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


def tables_worker(args: argparse.Namespace) -> dict:
    """The many-tables step at ``args.table_counts`` tables, dynemb (HBM_DIRECT, every id
    fits) and torch sparse embeddings at every count taking turns on each batch (an order
    drawn per step), with whatever thread settings the libraries pick; the library comes
    from ``args.root``. Returns ms per step and the settings the process ended up with."""
    sys.path.insert(0, str(args.root))
    import gc
    import numba
    import numpy as np
    import torch

    import dynemb
    from benchmarks import bench_tables as bt
    from dynemb import DynamicEmbTableOptions, StorageMode

    cfg = argparse.Namespace(ids=args.table_ids, vocab_factor=4, zipf=1.05, seed=0,
                             warmup=args.warmup, steps=args.steps, batch=256, dim=32)
    wall, cpu = time.perf_counter(), time.process_time()
    setups = []  # (workload, dynemb, torch sparse, gradients) per table count
    for tables in args.table_counts:
        wl = bt.Workload(cfg, tables)
        fit, _ = bt.capacities(wl, DynamicEmbTableOptions().bucket_size)
        dyn = bt.DynembMethod("hbm_fit", wl, cfg.dim, "sgd", DynamicEmbTableOptions(
            max_capacity=fit, init_capacity=fit), StorageMode.HBM_DIRECT)
        ref = bt.TorchSparseMethod(wl, cfg.dim, "sgd", dyn.initial_rows(wl, cfg.dim))
        setups.append((wl, dyn, ref, wl.gradients(cfg.seed, cfg.dim)))
    times = {str(wl.tables): {dyn.name: [], ref.name: []} for wl, dyn, ref, _ in setups}
    # every table count and method on each batch, in an order drawn per step: a load that
    # drifts falls on all of them alike
    runs = [(wl, m, grads) for wl, dyn, ref, grads in setups for m in (dyn, ref)]
    for i in range(cfg.warmup + cfg.steps):
        if i == cfg.warmup:
            gc.collect()
            gc.freeze()
        for j in np.random.default_rng(i).permutation(len(runs)):
            wl, method, grads = runs[j]
            _, fwd, bwd = bt.timed_step(method, wl, i, grads)
            if i >= cfg.warmup:
                times[str(wl.tables)][method.name].append((fwd + bwd) * 1e3)
    gc.unfreeze()
    out: dict = {"step_ms": times}
    parked = any(t.name == "dynemb-idle-openmp-team" for t in threading.enumerate())
    out.update(numba_threads=numba.get_num_threads(), torch_threads=torch.get_num_threads(),
               threading_layer=numba.threading_layer(), idle_openmp_team_parked=parked,
               cpu_per_wall=(time.process_time() - cpu) / (time.perf_counter() - wall),
               library=str(Path(dynemb.__file__).parent))
    return out


#: ``--idle-cpu``: configuration name -> environment variables of its process
IDLE_CONFIGS: Dict[str, Dict[str, str]] = {
    "libgomp's default wait (DYNEMB_THREADS=off)": {"DYNEMB_THREADS": "off"},
    "dynemb default (idle team)": {},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE", "DYNEMB_THREADS": "off"},
}


def idle_cpu_worker(repeats: int = 100, sleep_s: float = 0.005) -> dict:
    """Process CPU time per second of wall time over ``repeats`` x (one parallel torch op on
    1M floats, then ``sleep_s`` asleep), after building one CPU table (which applies
    dynemb's thread defaults): what idle OpenMP workers burn between regions."""
    import torch
    from torchrec import EmbeddingConfig

    from dynemb import DynamicEmbCollection
    DynamicEmbCollection([EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=64,
                                          feature_names=["f"])])
    x = torch.ones(1 << 20)
    x.mul_(1.0)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        x.mul_(1.0)
        time.sleep(sleep_s)
    return {"cpu_per_wall": (time.process_time() - cpu) / (time.perf_counter() - wall),
            "torch_threads": torch.get_num_threads(),
            "idle_openmp_team_parked": any(t.name == "dynemb-idle-openmp-team"
                                           for t in threading.enumerate())}


def main_idle_cpu(args: argparse.Namespace) -> dict:
    """Every configuration of IDLE_CONFIGS, ``args.rounds`` times in turn."""
    runs: Dict[str, List[dict]] = {name: [] for name in IDLE_CONFIGS}
    for _ in range(args.rounds):
        for name, variables in IDLE_CONFIGS.items():
            env = {k: v for k, v in os.environ.items() if k not in CLEARED}
            env.update(variables)
            out = subprocess.run([sys.executable, "-m", "benchmarks.bench_threads",
                                  "--idle-cpu-worker"], cwd=ROOT, env=env,
                                 capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"configuration {name!r} failed:\n{out.stderr[-3000:]}")
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    for name, r in runs.items():
        values = [x["cpu_per_wall"] for x in r]
        print(f"{name:<46} CPU s per wall s {min(values):.2f}-{max(values):.2f} "
              f"(torch threads {r[0]['torch_threads']}, idle team "
              f"{r[0]['idle_openmp_team_parked']})")
    return runs


def checkout_of(rev: str, into: Path) -> Path:
    """The library and benchmarks of commit ``rev`` under ``into`` (``kernels/`` placed as
    ``dynemb/kernels``, as the installed package maps it)."""
    archive = subprocess.run(["git", "archive", rev, "dynemb", "kernels", "benchmarks"],
                             cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    shutil.copytree(into / "kernels", into / "dynemb" / "kernels")
    return into


def run_tables_config(name: str, root: Path, args: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(TABLE_CONFIGS[name])
    cmd = [sys.executable, str(Path(__file__).resolve()), "--tables-worker", "--root", str(root),
           "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--table-ids", str(args.table_ids), "--table-counts",
           *map(str, args.table_counts)]
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"configuration {name!r} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def tables_ratios(run: dict, many: int) -> dict:
    """dynemb at ``many`` tables against torch sparse there and against dynemb at one."""
    med = {t: {m: statistics.median(v) for m, v in per.items()}
           for t, per in run["step_ms"].items()}
    m, one = med[str(many)], med.get("1")
    return {"dynemb_ms": m["hbm_fit"], "torch_sparse_ms": m["torch_sparse"],
            "vs_torch_sparse": m["hbm_fit"] / m["torch_sparse"],
            "one_table_ms": one["hbm_fit"] if one else None,
            "vs_one_table": m["hbm_fit"] / one["hbm_fit"] if one else None}


def measure_tables(args: argparse.Namespace, codes: Dict[str, Path], load: int) -> dict:
    """Every (code, configuration), ``args.rounds`` times in turn, with ``load`` busy
    processes."""
    busy = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(load)]
    for p in busy:
        p.start()
    many = max(args.table_counts)
    runs: Dict[str, List[dict]] = {}
    try:
        for r in range(args.rounds):
            for name in TABLE_CONFIGS:
                for code, root in codes.items():
                    key = f"{code} | {name}"
                    run = run_tables_config(name, root, args)
                    run["ratios"] = tables_ratios(run, many)
                    run["load_average"] = os.getloadavg()
                    runs.setdefault(key, []).append(run)
                    q = run["ratios"]
                    print(f"  load {load} round {r}: {key}: {q['vs_torch_sparse']:.2f}x torch "
                          f"sparse, {q['vs_one_table'] or float('nan'):.2f}x one table "
                          f"(numba {run['numba_threads']}, torch {run['torch_threads']}, "
                          f"cpu/wall {run['cpu_per_wall']:.2f})", file=sys.stderr, flush=True)
    finally:
        for p in busy:
            p.terminate()
            p.join()
    return runs


def format_tables(results: Dict[str, Dict[str, List[dict]]]) -> str:
    """One line per load, code and configuration: the ratios' range over the rounds."""
    lines = [f"{'busy':>4}  {'code | environment':<58} {'numba':>5} {'torch':>5} "
             f"{'vs torch sparse':>16} {'vs one table':>14} {'dynemb ms':>14}"]
    for load, per in results.items():
        for key, runs in per.items():
            q = [r["ratios"] for r in runs]

            def span(k: str, fmt: str = ".2f") -> str:
                vals = [x[k] for x in q if x[k] is not None]
                return f"{min(vals):{fmt}}-{max(vals):{fmt}}" if vals else "n/a"
            lines.append(f"{load:>4}  {key:<58} {runs[0]['numba_threads']:>5} "
                         f"{runs[0]['torch_threads']:>5} {span('vs_torch_sparse'):>16} "
                         f"{span('vs_one_table'):>14} {span('dynemb_ms', '.1f'):>14}")
    return "\n".join(lines)


def main_tables(args: argparse.Namespace) -> dict:
    from benchmarks.common import git_state, machine_info
    with tempfile.TemporaryDirectory() as tmp:
        codes = {"this checkout": ROOT}
        if args.before:
            codes = {f"before ({args.before})": checkout_of(args.before, Path(tmp)), **codes}
        report = {"machine": machine_info(git_state(), packages=["torchrec"]),
                  "config": {k: str(v) if isinstance(v, Path) else v
                             for k, v in vars(args).items() if k not in ("worker", "out_dir")},
                  "configurations": TABLE_CONFIGS, "load_average_before": os.getloadavg()}
        results = {load: measure_tables(args, codes, load) for load in args.loads}
    report["load_average_after"] = os.getloadavg()
    report["results"] = {str(k): v for k, v in results.items()}
    print(format_tables(results))
    stem = "threads_tables_cpu_quick" if args.quick else "threads_tables_cpu"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out_dir / stem}.json")
    return report


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
    p.add_argument("--tables-workload", action="store_true",
                   help="the many-tables step under each environment of TABLE_CONFIGS "
                        "(default loads: 0 and 1 busy process; steps 12, warm-up 4, "
                        "3 rounds); writes threads_tables_cpu.json")
    p.add_argument("--before", help="with --tables-workload: also the library at this "
                                    "commit, in turn with this checkout")
    p.add_argument("--table-counts", type=int, nargs="+", default=[128, 1])
    p.add_argument("--table-ids", type=int, default=65536)
    p.add_argument("--tables-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--idle-cpu", action="store_true",
                   help="CPU time the process burns around parallel torch ops with sleeps "
                        "between them, per configuration of IDLE_CONFIGS (prints only)")
    p.add_argument("--idle-cpu-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tables_workload or args.tables_worker:
        for name, value in (("steps", 12), ("warmup", 4), ("rounds", 3)):
            if f"--{name}" not in (argv if argv is not None else sys.argv):
                setattr(args, name, value)
        if args.loads is None:
            args.loads = [0, 1]
        if args.quick:
            args.steps, args.warmup, args.rounds, args.table_ids = 3, 1, 1, 4096
            args.table_counts = [8, 1]
    if args.quick and not (args.tables_workload or args.tables_worker):
        args.steps, args.warmup, args.rounds, args.batch = 8, 2, 1, 256
    if args.loads is None:
        args.loads = [0, len(os.sched_getaffinity(0))]
    return args


def main(argv: Optional[List[str]] = None) -> dict:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return {}
    if args.tables_worker:
        print(json.dumps(tables_worker(args)))
        return {}
    if args.idle_cpu_worker:
        print(json.dumps(idle_cpu_worker()))
        return {}
    if args.idle_cpu:
        return main_idle_cpu(args)
    if args.tables_workload:
        return main_tables(args)
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
