"""Check that an HBM_DIRECT training step of DynamicEmbCollection never stalls the host.

Builds an unsharded ``DynamicEmbCollection`` on ``--device`` (HBM_DIRECT, no input
validation, capacity fixed so the tables never grow), runs warm-up steps (kernel compilation,
first allocations), then checks each phase of a step, prefetch / forward (with the loss) /
backward (the fused update), three ways:

- ``census``: a torch dispatch mode lists the ops of the phase that make the host wait for the
  GPU when their tensors are on CUDA (``.item()``, ``nonzero``, boolean-mask indexing,
  ``unique``...) and any ``fbgemm`` op (the machine's fbgemm is a CPU build). Works on the
  CPU too, under numba's simulator, as a dry run: there every tensor is a host tensor, so
  reads of host-side buffers and checks the code runs only on CPU show up as well
  (candidates, reported but not counted as failures).
- ``warn`` (CUDA only): ``torch.cuda.set_sync_debug_mode("warn")``, every sync site recorded.
- ``error`` (CUDA only): ``set_sync_debug_mode("error")``; the phase passes if it raises
  nothing.

Syncs that numba makes itself (not through torch) are invisible to both torch modes; the
census and the step times are the check there.

The batches are built on the host with their lengths, offsets and per-feature lengths
(``KeyedJaggedTensor(..., lengths=, offsets=, stride=, length_per_key=,
offset_per_key=)``), then moved to the device before the checks: TorchRec then needs neither
a host read of the lengths nor fbgemm's ``asynchronous_complete_cumsum`` on the device.

Usage::

    python scripts/gpu_sync_check.py                              # on a GPU
    python scripts/gpu_sync_check.py --device cpu --backend cuda  # simulator, census only
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from typing import Dict, List

PHASES = ("prefetch", "forward", "backward")
#: aten ops that copy a data-dependent size or value to the host when run on CUDA.
SYNCING_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten.nonzero_static",
               "aten.equal", "aten.is_nonzero", "aten.masked_select", "aten._unique2",
               "aten.unique_dim", "aten.unique_consecutive", "aten._unique",
               "aten.repeat_interleave", "aten.item", "aten.allclose"}
#: Frames of these packages are where a sync site is reported (the first one up the stack).
OWN_CODE = (os.sep + "dynemb" + os.sep, os.sep + "kernels" + os.sep,
            os.sep + "torchrec" + os.sep, os.sep + "scripts" + os.sep)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default=None, choices=[None, "cpu", "cuda"],
                        help="kernels (default: by device; cuda with --device cpu: simulator)")
    parser.add_argument("--batch", type=int, default=512, help="samples per batch")
    parser.add_argument("--length", type=int, default=8, help="mean ids per sample and feature")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--optimizer", default="rowwise_adagrad",
                        choices=["sgd", "adam", "adagrad", "rowwise_adagrad"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="checked steps per mode")
    parser.add_argument("--timed-steps", type=int, default=20,
                        help="steps timed after the checks (0: none)")
    parser.add_argument("--profiled-steps", type=int, default=0,
                        help="steps after the timed ones under torch.profiler (0: none): "
                             "CUDA kernels per step and the top ops, numba's launches and "
                             "argument conversions named")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.device == "cpu" and args.backend == "cuda":
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    return args


# -- batches ------------------------------------------------------------------------------
FEATURES = ("history", "target", "user")


def make_batch(args, gen, device):
    """A KJT on ``device`` carrying everything TorchRec would otherwise compute on it."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    lengths = torch.cat([torch.randint(1, 2 * args.length, (args.batch,), generator=gen),
                         torch.ones(args.batch, dtype=torch.int64),
                         torch.ones(args.batch, dtype=torch.int64)])
    per_key = lengths.view(len(FEATURES), args.batch).sum(1).tolist()
    total = int(lengths.sum())
    # Zipf-like ids: a few hot ones, a long tail of new ones
    ranks = (torch.rand(total, generator=gen) ** -1.2).clamp(max=1e9).to(torch.int64)
    values = ranks * 2654435761 % (1 << 62)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    offset_per_key = [0]
    for n in per_key:
        offset_per_key.append(offset_per_key[-1] + n)
    return KeyedJaggedTensor(
        keys=list(FEATURES), values=values.to(device), lengths=lengths.to(device),
        offsets=offsets.to(device), stride=args.batch, length_per_key=per_key,
        offset_per_key=offset_per_key)


def make_collection(args, device):
    import torch
    from torchrec import EmbeddingConfig
    from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig,
                        OptimizerType, StorageMode)
    rows = 1 << 16
    tables = [EmbeddingConfig(name="items", embedding_dim=args.dim, num_embeddings=rows,
                              feature_names=["history", "target"]),
              EmbeddingConfig(name="users", embedding_dim=args.dim, num_embeddings=rows,
                              feature_names=["user"])]
    # init_capacity = max_capacity: a growth would read the table's size on the host
    options = DynamicEmbTableOptions(max_capacity=rows, init_capacity=rows)
    optimizer = OptimizerConfig(OptimizerType(args.optimizer), learning_rate=0.05)
    ec = DynamicEmbCollection(tables, device=torch.device(device), table_options=options,
                              optimizer=optimizer, validate_inputs=False, backend=args.backend)
    modes = set(ec.storage_modes().values())
    if modes != {StorageMode.HBM_DIRECT}:
        raise RuntimeError(f"expected HBM_DIRECT tables, got {modes}")
    return ec


# -- one step, phase by phase -------------------------------------------------------------
def step_phases(ec, kjt):
    """The phases of one training step, as callables run in order."""
    box = {}

    def prefetch():
        ec.prefetch(kjt)

    def forward():
        out = ec(kjt)
        box["loss"] = sum(jt.values().pow(2).sum() for jt in out.values())

    def backward():
        box.pop("loss").backward()

    return dict(zip(PHASES, (prefetch, forward, backward)))


def where(frames) -> str:
    """``file:line (function)`` of the innermost frame in dynemb, TorchRec or this script."""
    for frame in reversed(frames):
        if any(part in frame.filename for part in OWN_CODE):
            short = frame.filename.split(os.sep)
            return f"{os.sep.join(short[-2:])}:{frame.lineno} ({frame.name})"
    last = frames[-1]
    return f"{last.filename}:{last.lineno} ({last.name})"


def make_census(any_device: bool):
    """A dispatch mode counting syncing ops and fbgemm ops by (op, where); ops on host
    tensors count only with ``any_device`` (the simulator, where every tensor is one)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Census(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.found: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            name = name if "." in name else f"aten.{name}"
            flagged = name in SYNCING_OPS or name.startswith("fbgemm.") or (
                name in ("aten.index", "aten.index_put", "aten.index_put_")
                and _bool_index(args))
            if flagged and (any_device or _on_cuda(args, kwargs)):
                self.found[(name, where(traceback.extract_stack()[:-1]))] += 1
            return func(*args, **(kwargs or {}))

    return Census()


def _on_cuda(args, kwargs) -> bool:
    import torch
    from torch.utils._pytree import tree_leaves
    return any(isinstance(t, torch.Tensor) and t.is_cuda
               for t in tree_leaves((args, kwargs or {})))


def _bool_index(args) -> bool:
    """Indexing with a boolean mask: its output size is read on the host."""
    import torch
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in indices or ())


def run_census(ec, batches, any_device: bool) -> Dict[str, Dict[str, int]]:
    found = {p: Counter() for p in PHASES}
    for kjt in batches:
        for phase, call in step_phases(ec, kjt).items():
            census = make_census(any_device)
            with census:
                call()
            found[phase].update(census.found)
    return {p: {f"{op} at {site}": n for (op, site), n in c.items()} for p, c in found.items()}


def run_warn(ec, batches) -> Dict[str, Dict[str, int]]:
    import torch
    found = {p: Counter() for p in PHASES}
    sites: List[str] = []

    def record_site(message, category, filename, lineno, file=None, line=None):
        # called inside warnings.warn: the stack still holds the code that synced
        if "synchroniz" in str(message):
            torch_site = f"{os.sep.join(filename.split(os.sep)[-2:])}:{lineno}"
            frames = [f for f in traceback.extract_stack()[:-1] if f.filename != warnings.__file__]
            sites.append(f"{where(frames)} via {torch_site}")

    # torch's first set_sync_debug_mode("warn") of a process warns of a sync of its own (on
    # the H200: at that call, torch/cuda/__init__.py:1270, the only warning of the run, and
    # error mode passed every phase); made here, outside the recorded phases
    torch.cuda.set_sync_debug_mode("warn")
    torch.cuda.set_sync_debug_mode("default")
    for kjt in batches:
        for phase, call in step_phases(ec, kjt).items():
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record_site
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    call()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            found[phase].update(sites)
            sites.clear()
    return {p: dict(c) for p, c in found.items()}


def run_error(ec, batches) -> Dict[str, Dict]:
    """Per phase: passed steps, and the first failure with where it came from."""
    import torch
    result = {p: {"passed": 0, "failed": 0, "first_error": None} for p in PHASES}
    for kjt in batches:
        for phase, call in step_phases(ec, kjt).items():
            torch.cuda.set_sync_debug_mode("error")
            try:
                call()
                result[phase]["passed"] += 1
            except RuntimeError as error:
                result[phase]["failed"] += 1
                if result[phase]["first_error"] is None:
                    frames = traceback.extract_tb(error.__traceback__)
                    result[phase]["first_error"] = (f"{str(error).splitlines()[0]} "
                                                    f"at {where(frames)}")
                ec.clear_prefetched()  # the step is lost; start the next one clean
                break
            finally:
                torch.cuda.set_sync_debug_mode("default")
    return result


def time_steps(ec, batches, device) -> Dict[str, float]:
    import torch
    on_cuda = device.type == "cuda"
    times = []
    for kjt in batches:
        if on_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for call in step_phases(ec, kjt).values():
            call()
        if on_cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return {"steps": len(times), "median_ms": statistics.median(times),
            "min_ms": min(times), "max_ms": max(times)} if times else {}


def profile_steps(ec, batches, device) -> Dict:
    """Device activity per step and the top ops of ``batches`` under torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.gpu_profile import device_activity, label_numba_launches, top_ops
    label_numba_launches()
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for kjt in batches:
            for call in step_phases(ec, kjt).values():
                call()
        if device.type == "cuda":
            torch.cuda.synchronize()
    per_step = {k: v / len(batches) for k, v in device_activity(prof).items()}
    return {**per_step, "top_ops": top_ops(prof, len(batches), limit=25)}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(args.seed)
    ec = make_collection(args, device)
    on_cuda = device.type == "cuda"
    count = (args.warmup + args.steps * (3 if on_cuda else 1) + args.timed_steps
             + args.profiled_steps)
    batches = [make_batch(args, gen, device) for _ in range(count)]
    if on_cuda:
        torch.cuda.synchronize()
    take = iter(batches)

    def next_batches(n):
        return [next(take) for _ in range(n)]

    for kjt in next_batches(args.warmup):
        for call in step_phases(ec, kjt).values():
            call()
    report = {"device": str(device), "backend": args.backend, "torch": torch.__version__,
              "census": run_census(ec, next_batches(args.steps), any_device=not on_cuda)}
    if on_cuda:
        torch.cuda.synchronize()
        report["warn"] = run_warn(ec, next_batches(args.steps))
        torch.cuda.synchronize()
        report["error"] = run_error(ec, next_batches(args.steps))
    report["timing"] = time_steps(ec, next_batches(args.timed_steps), device)
    if args.profiled_steps:
        report["profile"] = profile_steps(ec, next_batches(args.profiled_steps), device)
    report["stats"] = {name: {k: v for k, v in s.items() if isinstance(v, (int, float))}
                       for name, s in ec.stats().items()}
    failed = print_report(report, on_cuda)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 1 if failed else 0


def print_report(report, on_cuda: bool) -> int:
    """One PASS/FAIL line per phase and mode (INFO for the simulator's candidates);
    returns the number of FAILs."""
    failed = 0
    for phase in PHASES:
        found = report["census"][phase]
        lines = [("census", not found if on_cuda else None,
                  "; ".join(f"{k} x{n}" for k, n in found.items()))]
        if on_cuda:
            lines.append(("warn", not report["warn"][phase],
                          "; ".join(f"{k} x{n}" for k, n in report["warn"][phase].items())))
            e = report["error"][phase]
            lines.append(("error", e["failed"] == 0,
                          f"{e['passed']} passed" + (f", {e['failed']} failed: "
                                                     f"{e['first_error']}" if e["failed"] else "")))
        for mode, ok, detail in lines:
            failed += ok is False
            verdict = "INFO" if ok is None else "PASS" if ok else "FAIL"
            print(f"{verdict}  {phase:<9} {mode:<7} {detail or '-'}")
    t = report["timing"]
    if t:
        print(f"step time over {t['steps']} steps: median {t['median_ms']:.2f} ms "
              f"(min {t['min_ms']:.2f}, max {t['max_ms']:.2f}) on {report['device']}")
    p = report.get("profile")
    if p:
        from benchmarks.gpu_profile import print_top_ops  # on the path: profile_steps put it
        print(f"per step: {p['kernels']:.0f} kernels, {p['memcpy']:.0f} memcpys, "
              f"{p['memset']:.0f} memsets; top ops, ms per step (host self, device self):")
        print_top_ops(p["top_ops"], limit=len(p["top_ops"]))
    print(f"{'PASS' if not failed else 'FAIL'}: {failed} sync findings")
    return failed


if __name__ == "__main__":
    sys.exit(main())
