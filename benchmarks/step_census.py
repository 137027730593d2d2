"""What one steady-state training step launches: numba kernels and torch ops, counted where
they are called from, for ``bench_gpu``'s workloads.

On a GPU each counted torch op is one kernel, memset or copy of the step (views and
allocations are not counted: they launch nothing); without one the CUDA kernels run under
numba's simulator and every tensor is a host tensor, so the count also holds the small
host-side ops a GPU step does on the host (building per-table values), which on a GPU cost
host time but no kernel. Either way the count is the step's launches as the code issues
them, which ``scripts/gpu_check.sh``'s profile then measures on the device.

Usage::

    python -m benchmarks.step_census                       # simulator, small workloads
    python -m benchmarks.step_census --device cuda --scale 1 --json census.json   # a GPU
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections import Counter
from typing import Dict, Optional

#: ops that launch nothing: views, metadata and allocations without a fill
NO_LAUNCH = frozenset(f"aten.{name}" for name in (
    "view", "_unsafe_view", "reshape", "alias", "detach", "slice", "select", "split",
    "split_with_sizes", "unbind", "expand", "as_strided", "unsqueeze", "squeeze", "t",
    "transpose", "permute", "narrow", "diagonal", "empty", "empty_like", "empty_strided",
    "new_empty", "new_empty_strided", "lift_fresh", "sym_size", "sym_numel", "sym_stride",
    "is_same_size", "_reshape_alias", "view_as", "expand_as", "resolve_conj", "resolve_neg",
    "set_", "_has_compatible_shallow_copy_type"))
OWN_CODE = (f"{os.sep}dynemb{os.sep}", f"{os.sep}kernels{os.sep}", f"{os.sep}torchrec{os.sep}")


def call_site(frames) -> str:
    """``folder/file.py:function`` of the innermost frame in dynemb or TorchRec."""
    for frame in reversed(frames):
        if any(part in frame.filename for part in OWN_CODE):
            parts = frame.filename.split(os.sep)
            return f"{os.sep.join(parts[-2:])}:{frame.name}"
    return "other"


class StepCensus:
    """Counts, while entered, the torch ops that launch work (by op and call site) and the
    CUDA backend's numba launches (by kernel)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        census = self
        self.ops: Counter = Counter()
        self.numba: Counter = Counter()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func.overloadpacket)
                name = name if "." in name else f"aten.{name}"
                if name not in NO_LAUNCH:
                    census.ops[(name, call_site(traceback.extract_stack()[:-1]))] += 1
                return func(*args, **(kwargs or {}))

        self._mode = Mode()

    def __enter__(self) -> "StepCensus":
        from dynemb.backends.numba_backends import CudaBackend
        self._launch = CudaBackend._launch
        census, launch = self, self._launch

        def counted(backend, kernel, n, *args):
            if n > 0:
                census.numba[getattr(getattr(kernel, "py_func", None), "__name__", "kernel")] += 1
            launch(backend, kernel, n, *args)

        CudaBackend._launch = counted
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        from dynemb.backends.numba_backends import CudaBackend
        self._mode.__exit__(*exc)
        CudaBackend._launch = self._launch

    def report(self, steps: int) -> dict:
        """Per step: torch ops and numba launches, in total and by call site / kernel."""
        sites: Counter = Counter()
        for (op, site), n in self.ops.items():
            sites[site] += n
        return {"torch_ops": sum(self.ops.values()) / steps,
                "numba_launches": sum(self.numba.values()) / steps,
                "torch_ops_by_site": {s: n / steps for s, n in sites.most_common()},
                "torch_ops_by_op": {f"{op} at {site}": n / steps
                                    for (op, site), n in self.ops.most_common()},
                "numba_by_kernel": {k: n / steps for k, n in self.numba.most_common()}}


def census_of(name: str, args) -> dict:
    """The census of ``args.steps`` steady-state steps of workload ``name``."""
    import torch
    from benchmarks.bench_gpu import WORKLOADS, Dynemb, scaled, workload
    spec = scaled(WORKLOADS[name], args.scale)
    wl = workload(spec, args)
    grads = [g.to(args.device) for g in torch.randn(spec.tables * wl.per_table, spec.dim)
             .split(wl.per_table)]
    method = Dynemb(spec, wl, args, args.device)
    for i in range(args.warmup):
        method.step(i, grads)
    with StepCensus() as census:
        for i in range(args.warmup, args.warmup + args.steps):
            method.step(i, grads)
    return {"workload": name, **vars(spec), **census.report(args.steps)}


def parse_args(argv=None) -> argparse.Namespace:
    from benchmarks.bench_gpu import WORKLOADS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS),
                        default=["T1_82k_sgd", "T26_sgd"])
    parser.add_argument("--scale", type=float, default=0.002,
                        help="multiply every workload's batch and ids (the simulator is slow)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batches", type=int, default=4, help="distinct batches cycled through")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", action="store_true",
                        help="CACHE tables with device rows below the ids seen (evicting to "
                             "their host stores) instead of HBM_DIRECT tables holding every id")
    parser.add_argument("--alone", action="store_true",
                        help="every table in a group of one (group_tables=False)")
    parser.add_argument("--json", help="also write the census to this JSON file")
    args = parser.parse_args(argv)
    args.backend = "cuda"
    if args.device == "cpu":
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    return args


def main(argv=None) -> Dict[str, dict]:
    args = parse_args(argv)
    rows = {name: census_of(name, args) for name in args.workloads}
    for row in rows.values():
        print(f"{row['workload']:>12}: {row['torch_ops']:6.1f} torch ops, "
              f"{row['numba_launches']:5.1f} numba launches per step")
        for site, n in list(row["torch_ops_by_site"].items())[:12]:
            print(f"{'':>14}{n:6.1f}  {site}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "config": vars(args), "rows": list(rows.values())},
                      f, indent=1)
    return rows


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
