"""What one steady-state training step launches: numba kernels and torch ops, counted where
they are called from, for ``bench_gpu``'s workloads; and what it reads back on the host or
makes from host values, and the shapes it allocates.

On a GPU each counted torch op is one kernel, memset or copy of the step (views and
allocations are not counted: they launch nothing); without one the CUDA kernels run under
numba's simulator and every tensor is a host tensor, so the count also holds the small
host-side ops a GPU step does on the host (building per-table values), which on a GPU cost
host time but no kernel. Either way the count is the step's launches as the code issues
them, which ``scripts/gpu_check.sh``'s profile then measures on the device.

A step that is to run without a host sync (and be captured as a CUDA graph) must read no
device value on the host and copy no per-step value from it. The census counts, from
dynemb's own code (torchrec's and torch's are not counted), on every tensor of the step
(on a GPU they are all the module's device's; without one all are host tensors, so each
counted call stands for what it would be on a GPU):

- **host reads**: ``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, ``bool()`` /
  ``int()`` / ``float()`` of a tensor, a tensor used as a Python index (but those of
  :data:`ALLOWED_READS`, host copies made without waiting, counted apart);
- **host values**: tensors made from Python or numpy values (``torch.tensor``,
  ``torch.as_tensor``, ``torch.from_numpy``), and numpy arrays handed to a numba kernel
  (each an implicit copy to the device and back);
- **allocation shapes**: the distinct shapes (and dtypes) the step allocates; a step of one
  padded batch-size bucket should allocate the same ones every time.

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
LIBRARY_CODE = (f"{os.sep}dynemb{os.sep}", f"{os.sep}kernels{os.sep}")
#: tensor methods that read a value back on the host
HOST_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")
#: functions that make a tensor from host values
HOST_VALUES = ("tensor", "as_tensor", "from_numpy")
#: where the CUDA backend hands a tensor to numba: the tensor itself on a GPU, its numpy
#: view under the simulator (not a host read, nor a host value)
HANDOFF = f"backends{os.sep}cuda_backend.py:_arr"
#: host reads a sync-free step may make: a host copy that crossed without waiting
ALLOWED_READS = {f"tables{os.sep}group_failures.py:check":
                 "the refused-key counts, copied to the host without waiting a step before"}
#: ops that allocate
ALLOCATIONS = frozenset(f"aten.{name}" for name in (
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros",
    "zeros_like", "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like",
    "new_full", "arange", "randn", "rand", "randint"))


def library_site(frames) -> Optional[str]:
    """``folder/file.py:function`` of the innermost frame if it is dynemb's own code, and of
    its caller where it is a helper that sends values (``device_values.py``)."""
    frame = frames[-1] if frames else None
    if frame is None or not any(part in frame.filename for part in LIBRARY_CODE):
        return None
    caller = frames[-2] if len(frames) > 1 else None
    if (frame.filename.endswith(f"{os.sep}device_values.py") and caller is not None
            and any(part in caller.filename for part in LIBRARY_CODE)):
        frame = caller
    parts = frame.filename.split(os.sep)
    return f"{os.sep.join(parts[-2:])}:{frame.name}"


def call_site(frames) -> str:
    """``folder/file.py:function`` of the innermost frame in dynemb or TorchRec."""
    for frame in reversed(frames):
        if any(part in frame.filename for part in OWN_CODE):
            parts = frame.filename.split(os.sep)
            return f"{os.sep.join(parts[-2:])}:{frame.name}"
    return "other"


class StepCensus:
    """Counts, while entered, the torch ops that launch work (by op and call site), the CUDA
    backend's numba launches (by kernel), and host reads, host values and allocation shapes
    (see the module docstring)."""

    def __init__(self):
        import torch
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode
        census = self
        self.ops: Counter = Counter()
        self.numba: Counter = Counter()
        self.host_reads: Counter = Counter()
        self.host_values: Counter = Counter()
        self.allowed_reads: Counter = Counter()
        self.allocations: Counter = Counter()
        reads = {getattr(torch.Tensor, name) for name in HOST_READS}
        values = {getattr(torch, name) for name in HOST_VALUES}

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func.overloadpacket)
                name = name if "." in name else f"aten.{name}"
                out = func(*args, **(kwargs or {}))
                if name not in NO_LAUNCH:
                    census.ops[(name, call_site(traceback.extract_stack()[:-1]))] += 1
                if name in ALLOCATIONS and isinstance(out, torch.Tensor):
                    census.allocations[(tuple(out.shape), str(out.dtype))] += 1
                return out

        class Function(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func in reads or func in values:
                    site = library_site(traceback.extract_stack()[:-1])
                    if site is not None and site != HANDOFF:
                        kind = census.host_reads if func in reads else census.host_values
                        if func in reads and site in ALLOWED_READS:
                            kind = census.allowed_reads
                        kind[f"{getattr(func, '__name__', func)} at {site}"] += 1
                return func(*args, **(kwargs or {}))

        self._modes = (Function(), Dispatch())

    def __enter__(self) -> "StepCensus":
        from dynemb.backends.numba_backends import CudaBackend
        self._launch, self._arr = CudaBackend._launch, CudaBackend._arr
        census, launch, handoff = self, self._launch, self._arr
        handed = {}  # the tensors' own arrays as _arr handed them, kept while counting

        def arr(backend, t):
            out = handoff(backend, t)
            handed[id(out)] = out
            return out

        def counted(backend, kernel, n, *args):
            import numpy as np
            if n > 0:
                name = getattr(getattr(kernel, "py_func", None), "__name__", "kernel")
                census.numba[name] += 1
                for a in args:
                    if isinstance(a, np.ndarray) and a.ndim > 0 and id(a) not in handed:
                        census.host_values[f"numpy argument of {name}"] += 1
            launch(backend, kernel, n, *args)

        CudaBackend._launch, CudaBackend._arr = counted, arr
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        from dynemb.backends.numba_backends import CudaBackend
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        CudaBackend._launch, CudaBackend._arr = self._launch, self._arr

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
                "numba_by_kernel": {k: n / steps for k, n in self.numba.most_common()},
                "host_reads": sum(self.host_reads.values()) / steps,
                "host_reads_by_site": {k: n / steps for k, n in self.host_reads.most_common()},
                "allowed_reads_by_site": {k: n / steps
                                          for k, n in self.allowed_reads.most_common()},
                "host_values": sum(self.host_values.values()) / steps,
                "host_values_by_site": {k: n / steps
                                        for k, n in self.host_values.most_common()},
                "allocation_shapes": sorted(f"{dtype}{list(shape)}"
                                            for shape, dtype in self.allocations)}


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
    shapes = []
    rows = []
    for i in range(args.warmup, args.warmup + args.steps):
        with StepCensus() as census:
            method.step(i, grads)
        rows.append(census)
        shapes.append(census.report(1)["allocation_shapes"])
    total = rows[0]
    for census in rows[1:]:
        for field in ("ops", "numba", "host_reads", "host_values", "allowed_reads",
                      "allocations"):
            getattr(total, field).update(getattr(census, field))
    return {"workload": name, **vars(spec), **total.report(args.steps),
            "allocation_shapes_by_step": shapes}


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
    parser.add_argument("--mode", choices=["hbm_direct", "cache", "cache_hits", "host_only",
                                           "default"],
                        help="the tables' storage (default hbm_direct; see bench_gpu.Dynemb)")
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
              f"{row['numba_launches']:5.1f} numba launches, {row['host_reads']:5.1f} host "
              f"reads, {row['host_values']:5.1f} host values per step; "
              f"{len(row['allocation_shapes'])} allocation shapes")
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
