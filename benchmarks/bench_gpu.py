"""The GPU training step against a plain torch embedding: five workloads, interleaved rounds.

Each workload is a one-process training step over one-feature tables whose ids all fit
(HBM_DIRECT), the same ids on both sides, from ``bench_tables.Workload`` (Zipf ids over a
vocabulary of 4x the ids of a step):

| workload | tables | ids a step | dim | optimizer |
|---|---:|---:|---:|---|
| ``T1_82k_sgd`` | 1 | 4,096 x 20 | 128 | SGD |
| ``T1_82k_adam`` | 1 | 4,096 x 20 | 128 | Adam (torch: ``SparseAdam``) |
| ``T1_328k_sgd`` | 1 | 16,384 x 20 | 128 | SGD |
| ``T26_sgd`` | 26 | 26 x 8,192 | 64 | SGD |
| ``T256_sgd`` | 256 | 256 x 256 | 32 | SGD |

- ``dynemb``: ``DynamicEmbCollection`` (``validate_inputs=False``) takes raw 63-bit ids; a
  step is ``ec(kjt)`` (prefetch inline) and backward from fixed gradients (the fused update).
- ``torch_sparse``: one ``nn.Embedding(sparse=True)`` per table takes the dense row numbers;
  a step is the lookups, backward from the same gradients and ``SGD`` / ``SparseAdam``.

Per workload and method: ms per step of the whole loop (``--steps`` steps between two device
synchronizations) in each of ``--rounds`` interleaved rounds (the median is reported), the
host time of a step (call to return, the device synchronized before and after), and from
``torch.profiler`` over ``--profiled-steps`` steps the CUDA kernels, memcpys and memsets per
step. The ratio ``dynemb_ms / torch_sparse_ms`` is printed beside the issue's targets
(reported, not asserted).

Usage::

    python -m benchmarks.bench_gpu --json gpu_step.json --plot gpu_step.png   # on a GPU
    python -m benchmarks.bench_gpu --device cpu --scale 0.01 --rounds 1       # CPU dry run
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional


@dataclass(frozen=True)
class Spec:
    tables: int
    batch: int
    ids_per_table: int
    dim: int
    optimizer: str


WORKLOADS: Dict[str, Spec] = {
    "T1_82k_sgd": Spec(1, 4096, 4096 * 20, 128, "sgd"),
    "T1_82k_adam": Spec(1, 4096, 4096 * 20, 128, "adam"),
    "T1_328k_sgd": Spec(1, 16384, 16384 * 20, 128, "sgd"),
    "T26_sgd": Spec(26, 4096, 8192, 64, "sgd"),
    "T256_sgd": Spec(256, 256, 256, 32, "sgd"),
}
# dynemb_ms / torch_sparse_ms the GPU step is meant to reach (reported, not asserted)
TARGETS = {"T1_82k_sgd": 1.0, "T1_82k_adam": 0.5, "T1_328k_sgd": 1.0, "T26_sgd": 0.5,
           "T256_sgd": 0.3}
LEARNING_RATE = 1e-3


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default=None, choices=[None, "cpu", "cuda"],
                        help="kernels (default: by device; cuda with --device cpu: simulator)")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply every workload's batch and ids (a dry run: 0.01)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--profiled-steps", type=int, default=3)
    parser.add_argument("--batches", type=int, default=8, help="distinct batches cycled through")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--plot", help="also draw ms per step of both methods into this image")
    args = parser.parse_args(argv)
    if args.device == "cpu" and args.backend == "cuda":
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    return args


def scaled(spec: Spec, scale: float) -> Spec:
    batch = max(1, round(spec.batch * scale))
    per_table = max(batch, round(spec.ids_per_table * scale))
    return Spec(spec.tables, batch, per_table, spec.dim, spec.optimizer)


def workload(spec: Spec, args):
    from benchmarks.bench_tables import Workload
    cfg = argparse.Namespace(seed=args.seed, ids=spec.tables * spec.ids_per_table,
                             vocab_factor=4, zipf=1.05, batch=spec.batch, warmup=0,
                             steps=args.batches)
    return Workload(cfg, spec.tables)


class Dynemb:
    name = "dynemb"

    def __init__(self, spec: Spec, wl, args, device):
        """HBM_DIRECT tables that hold every id; with ``args.cache`` (step_census) CACHE
        tables of buckets of 16 whose device rows hold 3 times a step's distinct ids (below
        the ids seen over the steps: they write back and load), and with ``args.alone``
        each table in a group of one (``group_tables=False``). step_census's ``args.mode``
        also takes ``cache_hits`` (CACHE tables whose device rows hold every id: all hits
        once seen), ``host_only`` (a device budget of 0) and ``default`` (device rows for
        half the ids, the rest in the host tier)."""
        import torch
        from benchmarks.bench_tables import FIT_LOAD, table_configs, whole_buckets
        from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig,
                            OptimizerType, StorageMode)
        fit = whole_buckets(wl.rows / FIT_LOAD, DynamicEmbTableOptions().bucket_size)
        config = OptimizerConfig({"sgd": OptimizerType.SGD, "adam": OptimizerType.ADAM}
                                 [spec.optimizer], learning_rate=LEARNING_RATE)
        width = spec.dim + config.state_dim(spec.dim)
        kind = getattr(args, "mode", None) or ("cache" if getattr(args, "cache", False)
                                               else "hbm_direct")
        if kind == "cache":
            most = max(max(step) for step in wl.unique_per_step)
            cached = whole_buckets(3 * most, 16)
            options = DynamicEmbTableOptions(max_capacity=fit, caching=True, bucket_size=16,
                                             local_hbm_for_values=cached * width * 4)
            mode = StorageMode.CACHE
        elif kind == "cache_hits":
            options = DynamicEmbTableOptions(max_capacity=2 * fit, caching=True,
                                             local_hbm_for_values=fit * width * 4)
            mode = StorageMode.CACHE
        elif kind == "host_only":
            options = DynamicEmbTableOptions(max_capacity=fit, local_hbm_for_values=0)
            mode = StorageMode.HOST_ONLY
        elif kind == "default":
            options = DynamicEmbTableOptions(max_capacity=fit, bucket_size=16,
                                             local_hbm_for_values=max(16, fit // 2) * width * 4)
            mode = StorageMode.DEFAULT
        else:
            options = DynamicEmbTableOptions(max_capacity=fit, init_capacity=fit)
            mode = StorageMode.HBM_DIRECT
        self.module = DynamicEmbCollection(
            table_configs(wl, spec.dim, fit), table_options=options, optimizer=config,
            device=torch.device(device), validate_inputs=False, backend=args.backend,
            group_tables=not getattr(args, "alone", False))
        assert set(self.module.storage_modes().values()) == {mode}
        self.features = wl.features
        self.batches = [device_kjt(wl, wl.raw[i], device) for i in range(args.batches)]

    def step(self, i: int, grads) -> None:
        import torch
        out = self.module(self.batches[i % len(self.batches)])
        torch.autograd.backward([out[f].values() for f in self.features], grads)


class TorchSparse:
    name = "torch_sparse"

    def __init__(self, spec: Spec, wl, args, device):
        import torch
        self.tables = torch.nn.ModuleList(
            torch.nn.Embedding(wl.rows, spec.dim, sparse=True, device=device)
            for _ in range(spec.tables))
        params = list(self.tables.parameters())
        self.opt = (torch.optim.SGD(params, lr=LEARNING_RATE) if spec.optimizer == "sgd"
                    else torch.optim.SparseAdam(params, lr=LEARNING_RATE))
        self.batches = [wl.dense[i].to(device).split(wl.per_table) for i in range(args.batches)]

    def step(self, i: int, grads) -> None:
        import torch
        self.opt.zero_grad(set_to_none=True)
        ids = self.batches[i % len(self.batches)]
        outs = [table(t_ids) for table, t_ids in zip(self.tables, ids)]
        torch.autograd.backward(outs, grads)
        self.opt.step()


def device_kjt(wl, values, device):
    """A batch of ``wl`` (its ``values``: ``wl.raw[i]`` or ``wl.dense[i]``) on ``device``
    with its per-feature lengths and offsets given, so that TorchRec reads nothing back from
    the device (see scripts/gpu_sync_check.py)."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    lengths = wl.lengths
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return KeyedJaggedTensor(
        keys=wl.features, values=values.to(device), lengths=lengths.to(device),
        offsets=offsets.to(device), stride=len(lengths) // wl.tables,
        length_per_key=[wl.per_table] * wl.tables,
        offset_per_key=[k * wl.per_table for k in range(wl.tables + 1)])


def synchronize(device) -> None:
    import torch
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def loop_ms(method, grads, args, device, first: int) -> float:
    """ms per step of ``--steps`` steps run back to back (synchronized at both ends)."""
    synchronize(device)
    start = time.perf_counter()
    for i in range(first, first + args.steps):
        method.step(i, grads)
    synchronize(device)
    return (time.perf_counter() - start) * 1e3 / args.steps


def host_ms(method, grads, args, device) -> float:
    """Median host time of a step: from the call to its return, the device idle before."""
    times = []
    for i in range(args.steps):
        synchronize(device)
        start = time.perf_counter()
        method.step(i, grads)
        times.append((time.perf_counter() - start) * 1e3)
    synchronize(device)
    return statistics.median(times)


def profiled(method, grads, args, device) -> Dict[str, float]:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from benchmarks.gpu_profile import device_activity
    activities = [ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for i in range(args.profiled_steps):
            method.step(i, grads)
        synchronize(device)
    return {k: v / max(args.profiled_steps, 1) for k, v in device_activity(prof).items()}


def run(args) -> dict:
    import torch
    from tqdm import tqdm
    device = args.device
    setups = {}
    for name in args.workloads:
        spec = scaled(WORKLOADS[name], args.scale)
        wl = workload(spec, args)
        gen = torch.Generator().manual_seed(args.seed + spec.dim)
        grads = [g.to(device) for g in torch.randn(spec.tables * wl.per_table, spec.dim,
                                                   generator=gen).split(wl.per_table)]
        setups[name] = (spec, wl, grads)
    methods = {name: [cls(spec, wl, args, device) for cls in (Dynemb, TorchSparse)]
               for name, (spec, wl, grads) in setups.items()}
    rows = {name: {"workload": name, **vars(setups[name][0])} for name in args.workloads}
    with tqdm(total=len(args.workloads) * 2 * (args.rounds + 1), desc="workload x method") as bar:
        for name in args.workloads:  # warm-up, host time and profile once per method
            grads = setups[name][2]
            for method in methods[name]:
                for i in range(args.warmup):
                    method.step(i, grads)
                rows[name][f"{method.name}_host_ms"] = host_ms(method, grads, args, device)
                for key, value in profiled(method, grads, args, device).items():
                    rows[name][f"{method.name}_{key}"] = value
                bar.update()
        for r in range(args.rounds):  # interleaved: every workload and method once per round
            for name in args.workloads:
                grads = setups[name][2]
                order = methods[name] if r % 2 == 0 else methods[name][::-1]
                for method in order:
                    rows[name].setdefault(f"{method.name}_ms_rounds", []).append(
                        loop_ms(method, grads, args, device, first=r * args.steps))
                    bar.update()
    for row in rows.values():
        for method in ("dynemb", "torch_sparse"):
            row[f"{method}_ms"] = statistics.median(row[f"{method}_ms_rounds"])
        row["ratio"] = row["dynemb_ms"] / row["torch_sparse_ms"]
        row["target_ratio"] = TARGETS[row["workload"]]
    return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "device": device, "backend": args.backend, "commit": commit(),
            "torch": torch.__version__, "config": vars(args), "rows": list(rows.values())}


def commit() -> Optional[str]:
    """The commit measured: $DYNEMB_COMMIT (a copy without .git), else git's HEAD."""
    if os.environ.get("DYNEMB_COMMIT"):
        return os.environ["DYNEMB_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def format_rows(report: dict) -> str:
    lines = [f"{'workload':<12} {'dynemb ms':>10} {'torch ms':>9} {'ratio':>6} {'target':>6} "
             f"{'host ms':>8} {'kernels':>8} {'memcpy':>7} {'memset':>7}"]
    for r in report["rows"]:
        verdict = "PASS" if r["ratio"] <= r["target_ratio"] else "FAIL"
        lines.append(
            f"{r['workload']:<12} {r['dynemb_ms']:>10.3f} {r['torch_sparse_ms']:>9.3f} "
            f"{r['ratio']:>6.2f} {r['target_ratio']:>6.2f} {r['dynemb_host_ms']:>8.3f} "
            f"{r.get('dynemb_kernels', 0):>8.1f} {r.get('dynemb_memcpy', 0):>7.1f} "
            f"{r.get('dynemb_memset', 0):>7.1f}  {verdict}")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """ms per step of both methods per workload (log scale), the ratio written above."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = report["rows"]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.38
    ax.bar([x - width / 2 for x in xs], [r["dynemb_ms"] for r in rows], width, label="dynemb")
    ax.bar([x + width / 2 for x in xs], [r["torch_sparse_ms"] for r in rows], width,
           label="torch nn.Embedding(sparse=True)")
    for x, r in zip(xs, rows):
        top = max(r["dynemb_ms"], r["torch_sparse_ms"])
        ax.annotate(f"{r['ratio']:.2f}x (target {r['target_ratio']:g}x)", (x, top * 1.08),
                    ha="center", fontsize=8)
    ax.set_xticks(list(xs), [r["workload"] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("ms per training step")
    ax.legend(fontsize=8)
    ax.set_title(f"{report.get('gpu') or report['device']} at {str(report['commit'])[:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    report = run(args)
    print(format_rows(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot(report, args.plot)
    return report


if __name__ == "__main__":
    main()
