"""Many tables on a GPU: step time and CUDA kernels per training step against the table count.

The GPU side of ``benchmarks/bench_tables.py``: the same workload (``--ids`` ids a step split
evenly over T one-feature tables, Zipf ids, dim ``--dim``, each optimizer of ``--optimizers``),
every id fitting its
HBM_DIRECT table, for each T of ``--tables``:

- ``dynemb``: ``DynamicEmbCollection`` on the GPU (``validate_inputs=False``), a step being
  ``ec(kjt)`` (inline prefetch) and backward from fixed gradients (the fused update);
- ``torch_sparse``: TorchRec's ``EmbeddingCollection`` on the GPU with sparse gradients and
  ``torch.optim.SGD`` or bench_tables' ``RowwiseAdagrad``, the same ids (dense row numbers)
  and gradients.

Per optimizer, method and T: the median step time over ``--steps`` steps (CUDA synchronized), and from
``torch.profiler`` over ``--profiled-steps`` steps the CUDA kernels, memcpys and memsets per
step (CUPTI sees numba's launches as well as torch's). A table count whose kernels per step
grow with T is one that launches per table.

Usage::

    python -m scripts.gpu_tables --json tables_cuda.json                 # on a GPU
    python -m scripts.gpu_tables --device cpu --backend cuda --tables 1 4 --ids 256 \\
        --steps 1 --profiled-steps 1                                     # simulator dry run
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from benchmarks.bench_gpu import device_kjt, synchronize
from benchmarks.gpu_profile import device_activity, label_numba_launches, print_top_ops, top_ops


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default=None, choices=[None, "cpu", "cuda"],
                        help="kernels (default: by device; cuda with --device cpu: simulator)")
    parser.add_argument("--tables", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--ids", type=int, default=65536, help="ids per step over all tables")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--optimizers", nargs="+", choices=["sgd", "rowwise_adagrad"],
                        default=["sgd", "rowwise_adagrad"])
    parser.add_argument("--batch", type=int, default=256, help="samples per step")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--profiled-steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--plot", help="also draw ms per step and kernels per step against T "
                        "into this image file")
    args = parser.parse_args(argv)
    if args.device == "cpu" and args.backend == "cuda":
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    return args


def workload(args, tables: int):
    from benchmarks.bench_tables import Workload
    cfg = argparse.Namespace(seed=args.seed, ids=args.ids, vocab_factor=4, zipf=1.05,
                             batch=args.batch, warmup=args.warmup,
                             steps=args.steps + args.profiled_steps)
    return Workload(cfg, tables)


class Dynemb:
    name, dense = "dynemb", False

    def __init__(self, args, wl, device, opt_name):
        import torch
        from benchmarks.bench_tables import (FIT_LOAD, optimizer_config, table_configs,
                                             whole_buckets)
        from dynemb import DynamicEmbCollection, DynamicEmbTableOptions, StorageMode
        fit = whole_buckets(wl.rows / FIT_LOAD, DynamicEmbTableOptions().bucket_size)
        options = DynamicEmbTableOptions(max_capacity=fit, init_capacity=fit)
        self.module = DynamicEmbCollection(
            table_configs(wl, args.dim, fit), table_options=options,
            optimizer=optimizer_config(opt_name), device=torch.device(device),
            validate_inputs=False, backend=args.backend)
        assert set(self.module.storage_modes().values()) == {StorageMode.HBM_DIRECT}
        self.groups = len(self.module.table_groups())

    def step(self, kjt, features, grads):
        import torch
        out = self.module(kjt)
        torch.autograd.backward([out[f].values() for f in features], grads)


class TorchSparse:
    name, dense = "torch_sparse", True

    def __init__(self, args, wl, device, opt_name):
        import torch
        from torchrec import EmbeddingCollection
        from benchmarks.bench_tables import EPS, LEARNING_RATE, RowwiseAdagrad, table_configs
        self.module = EmbeddingCollection(tables=table_configs(wl, args.dim, wl.rows),
                                          device=torch.device(device))
        for emb in self.module.embeddings.values():
            emb.sparse = True
        weights = list(self.module.parameters())
        self.opt = (torch.optim.SGD(weights, lr=LEARNING_RATE) if opt_name == "sgd"
                    else RowwiseAdagrad(weights, LEARNING_RATE, EPS))
        self.groups = 0

    def step(self, kjt, features, grads):
        import torch
        self.opt.zero_grad(set_to_none=True)
        out = self.module(kjt)
        torch.autograd.backward([out[f].values() for f in features], grads)
        self.opt.step()


def measure(method, args, wl, device, opt_name) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    gen = torch.Generator().manual_seed(args.seed + args.dim)
    grads = [g.to(device) for g in torch.randn(wl.tables * wl.per_table, args.dim,
                                               generator=gen).split(wl.per_table)]
    kjts = [device_kjt(wl, (wl.dense if method.dense else wl.raw)[i], device)
            for i in range(args.warmup + args.steps + args.profiled_steps)]
    synchronize(device)
    for kjt in kjts[:args.warmup]:
        method.step(kjt, wl.features, grads)
    times = []
    for kjt in kjts[args.warmup:args.warmup + args.steps]:
        synchronize(device)
        start = time.perf_counter()
        method.step(kjt, wl.features, grads)
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    activities = [ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for kjt in kjts[args.warmup + args.steps:]:
            method.step(kjt, wl.features, grads)
        synchronize(device)
    per_step = {k: v / max(args.profiled_steps, 1) for k, v in device_activity(prof).items()}
    return {"method": method.name, "optimizer": opt_name, "tables": wl.tables, "groups": method.groups,
            "step_ms": statistics.median(times), "step_ms_all": times, **per_step,
            "top_ops": top_ops(prof, args.profiled_steps)}


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch
    from tqdm import tqdm
    device = args.device
    label_numba_launches()
    rows = []
    with tqdm(total=2 * len(args.tables) * len(args.optimizers), desc="methods x T") as bar:
        for opt_name in args.optimizers:
            for tables in args.tables:
                wl = workload(args, tables)
                for cls in (Dynemb, TorchSparse):
                    method = cls(args, wl, device, opt_name)
                    rows.append(measure(method, args, wl, device, opt_name))
                    bar.update()
    report = {"device": device, "backend": args.backend, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
              "config": vars(args), "rows": rows}
    print(f"{'opt':<16} {'T':>5} {'method':<13} {'groups':>6} {'step ms':>9} {'kernels':>8} "
          f"{'memcpy':>7} {'memset':>7}")
    for r in rows:
        print(f"{r['optimizer']:<16} {r['tables']:>5} {r['method']:<13} {r['groups']:>6} {r['step_ms']:>9.2f} "
              f"{r['kernels']:>8.1f} {r['memcpy']:>7.1f} {r['memset']:>7.1f}")
    for opt_name, name in [(o, n) for o in args.optimizers for n in ("dynemb", "torch_sparse")]:
        mine = {r["tables"]: r for r in rows if r["method"] == name and r["optimizer"] == opt_name}
        low, high = min(mine), max(mine)
        print(f"{name} {opt_name}: step at T={high} / T={low}: "
              f"{mine[high]['step_ms'] / mine[low]['step_ms']:.2f}; kernels per step "
              f"{mine[low]['kernels']:.0f} -> {mine[high]['kernels']:.0f}")
    for r in rows:
        if (r["method"] == "dynemb" and r["optimizer"] == args.optimizers[0]
                and r["tables"] in (min(args.tables), max(args.tables))):
            print(f"dynemb {r['optimizer']} at T={r['tables']}, ms per step (host self, device self):")
            print_top_ops(r["top_ops"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot(report, args.plot)
    return 0


def plot(report: dict, path: str) -> None:
    """Step time and kernels per step against the table count, one line per method and
    optimizer (log-log)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    lines = sorted({(r["method"], r.get("optimizer", "sgd")) for r in report["rows"]})
    for method, opt in lines:
        rows = sorted((r for r in report["rows"] if r["method"] == method
                       and r.get("optimizer", "sgd") == opt), key=lambda r: r["tables"])
        style = "-o" if method == "dynemb" else "--s"
        for ax, field in zip(axes, ("step_ms", "kernels")):
            ax.plot([r["tables"] for r in rows], [r[field] for r in rows], style,
                    label=f"{method}, {opt}")
    for ax, label in zip(axes, ("ms per step", "CUDA kernels per step")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tables T (same ids per step in all)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{report.get('gpu') or report['device']}: "
                 f"{report['config']['ids']} ids a step, dim {report['config']['dim']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
