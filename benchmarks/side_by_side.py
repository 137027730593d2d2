"""What the 2-rank benchmarks (``bench_sharded``, ``bench_pooled``) share: dynemb's model and
TorchRec's take turns on the same batches; each step both must agree, and a few extra steps
are profiled per phase, under cProfile and (optionally) under ``torch.profiler``."""
from __future__ import annotations

import cProfile
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import torch

from benchmarks.common import check, profile_tables

METHODS = ("dynemb", "torchrec")
#: Both models must agree this closely, every step (loss and the probe rows).
LOSS_RTOL, PROBE_RTOL, PROBE_ATOL = 1e-3, 1e-3, 1e-4


class PhaseTimers:
    """Inclusive wall time and the calling thread's CPU time per label of wrapped callables
    (instance attributes or class methods), restored by :meth:`restore`. The CPU time is a
    phase's own work, without the time spent waiting for the other rank or for the cores
    (which a shared 2-core machine adds to the wall time, unevenly)."""

    def __init__(self) -> None:
        self.seconds: Dict[str, float] = {}
        self.cpu_seconds: Dict[str, float] = {}
        self.calls: Dict[str, int] = {}
        self._undo: List[Tuple[Any, str, Any, bool]] = []

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        had_own = attr in vars(owner)
        self._undo.append((owner, attr, vars(owner).get(attr), had_own))
        setattr(owner, attr, self._timed(label, getattr(owner, attr)))

    def _timed(self, label: str, fn: Callable) -> Callable:
        # a plain function: bound like the original when set on a class, called as is when
        # set on an instance (where ``fn`` is already bound)
        def timed(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t0
                self.cpu_seconds[label] = (self.cpu_seconds.get(label, 0.0)
                                           + time.thread_time() - c0)
                self.calls[label] = self.calls.get(label, 0) + 1
        return timed

    def restore(self) -> None:
        for owner, attr, previous, had_own in reversed(self._undo):
            if had_own:
                setattr(owner, attr, previous)
            else:
                delattr(owner, attr)
        self._undo.clear()


def compare(outs: Dict[str, Any], worst: Dict[str, float], where: str, what: str) -> None:
    """Both models saw the same batch: same loss, same probe rows (``what`` names them)."""
    (loss_a, probe_a), (loss_b, probe_b) = outs["dynemb"], outs["torchrec"]
    check(bool(torch.isfinite(loss_a)) and bool(torch.isfinite(probe_a).all()),
          f"{where}: dynemb produced non-finite values")
    diff = abs(float(loss_a) - float(loss_b)) / max(1.0, abs(float(loss_b)))
    probe = float((probe_a - probe_b).abs().max()) if probe_a.numel() else 0.0
    worst["loss"], worst["probe"] = max(worst["loss"], diff), max(worst["probe"], probe)
    check(diff <= LOSS_RTOL, f"{where}: losses differ ({float(loss_a)} vs {float(loss_b)})")
    check(torch.allclose(probe_a, probe_b, rtol=PROBE_RTOL, atol=PROBE_ATOL),
          f"{where}: {what} differ by up to {probe:.3g}; the models no longer train alike")


def op_table(prof, steps: int, limit: int = 20) -> List[Dict[str, Any]]:
    """The torch ops of ``steps`` profiled steps by self CPU time, ms per step."""
    ops = [{"op": e.key, "self_cpu_ms": e.self_cpu_time_total / steps / 1e3,
            "cpu_ms": e.cpu_time_total / steps / 1e3, "calls_per_step": e.count / steps}
           for e in prof.key_averages()]
    ops.sort(key=lambda r: -r["self_cpu_ms"])
    return ops[:limit]


def profile_steps(n: int, pipes, iters, timed_parts: Dict[str, List[Tuple[Any, str, str]]],
                  check_step: Callable[[Dict[str, Any], str], None], where: str, bar, *,
                  torch_ops: bool = False) -> Dict[str, Any]:
    """``n`` more steps of each model with phase timers on ``timed_parts[method]`` (the models
    still take turns, each step checked by ``check_step(outputs, where)``), then as many of
    dynemb alone under cProfile (its heaviest functions), then with ``torch_ops`` as many of
    each under ``torch.profiler`` (the 20 heaviest ops)."""
    timers = {m: PhaseTimers() for m in METHODS}
    step_s: Dict[str, List[float]] = {m: [] for m in METHODS}
    for m in METHODS:
        for owner, attr, label in timed_parts[m]:
            timers[m].wrap(owner, attr, label)
    try:
        for i in range(n):
            outs = {}
            for m in METHODS if i % 2 == 0 else METHODS[::-1]:
                t0 = time.perf_counter()
                outs[m] = pipes[m].progress(iters[m])
                step_s[m].append(time.perf_counter() - t0)
            check_step(outs, f"{where}, profile step {i}")
            bar.update()
    finally:
        for t in timers.values():
            t.restore()
    out = {m: {"step_ms": statistics.median(step_s[m]) * 1e3,
               "phases_ms": {k: v / n * 1e3 for k, v in timers[m].seconds.items()},
               "phases_cpu_ms": {k: v / n * 1e3 for k, v in timers[m].cpu_seconds.items()},
               "calls_per_step": {k: v / n for k, v in timers[m].calls.items()}}
           for m in METHODS}
    prof, under = cProfile.Profile(), []
    for _ in range(n):
        prof.enable()
        t0 = time.perf_counter()
        pipes["dynemb"].progress(iters["dynemb"])
        under.append(time.perf_counter() - t0)
        prof.disable()
        bar.update()
    out["dynemb"].update(profile_tables(prof, n, limit=25),
                         step_ms_under_cprofile=statistics.median(under) * 1e3)
    if torch_ops:
        for m, ops in _torch_ops(n, pipes, iters, bar).items():
            out[m]["profiler_ops"] = ops
    return out


def _torch_ops(n: int, pipes, iters, bar) -> Dict[str, List[Dict[str, Any]]]:
    profiles: Dict[str, list] = {m: [] for m in METHODS}
    for i in range(n):  # the models take turns again
        for m in METHODS if i % 2 == 0 else METHODS[::-1]:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                pipes[m].progress(iters[m])
            profiles[m].append(p)
        bar.update()
    out = {}
    for m in METHODS:
        merged: Dict[str, Dict[str, float]] = {}
        for p in profiles[m]:
            for row in op_table(p, n, limit=10**6):
                acc = merged.setdefault(row["op"], {"op": row["op"], "self_cpu_ms": 0.0,
                                                    "cpu_ms": 0.0, "calls_per_step": 0.0})
                for key in ("self_cpu_ms", "cpu_ms", "calls_per_step"):
                    acc[key] += row[key]
        out[m] = sorted(merged.values(), key=lambda r: -r["self_cpu_ms"])[:20]
    return out
