"""What the 2-rank benchmarks (``bench_sharded``, ``bench_pooled``) share: dynemb's model and
TorchRec's take turns on the same batches; each step both must agree, and a few extra steps
are profiled per phase, under cProfile and (optionally) under ``torch.profiler``."""
from __future__ import annotations

import cProfile
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import torch

from benchmarks.common import (check, paired_ratios, percentile, profile_tables, pyplot,
                               save_figure)

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


def summarize_ranks(per_rank: List[Dict[str, Any]], *, config_keys: Tuple[str, ...],
                    rank_fields: Tuple[str, ...], target: float) -> List[Dict[str, Any]]:
    """Per configuration (its ``config_keys`` copied from the results): a step's time is the
    slower rank's (the ranks meet in the collectives every step); medians, p10/p90, the ratio
    dynemb / TorchRec against ``target`` and the paired per-step ratios; per rank its medians
    and its result's ``rank_fields``."""
    rows = []
    for k, first in enumerate(per_rank[0]["results"]):
        entries = [r["results"][k] for r in per_rank]
        step_ms = {m: [max(e["step_s"][m][i] for e in entries) * 1e3
                       for i in range(len(first["step_s"][m]))] for m in METHODS}
        med = {m: statistics.median(step_ms[m]) for m in METHODS}
        ids = sum(e["ids_per_step"] for e in entries)
        ratio = med["dynemb"] / med["torchrec"]
        rows.append({
            **{key: first[key] for key in config_keys},
            "median_ms": med,
            "p10_ms": {m: percentile(step_ms[m], 10) for m in METHODS},
            "p90_ms": {m: percentile(step_ms[m], 90) for m in METHODS},
            "ratio": ratio,
            "ratio_paired": paired_ratios(step_ms["dynemb"], step_ms["torchrec"]),
            "target": target, "passed": ratio <= target,
            "ids_per_step_all_ranks": ids,
            "m_ids_per_s": {m: ids / med[m] / 1e3 for m in METHODS},
            "step_ms": step_ms,
            "per_rank": [{"rank": r["rank"], "median_ms": {
                m: statistics.median(r["results"][k]["step_s"][m]) * 1e3 for m in METHODS},
                **{f: r["results"][k][f] for f in rank_fields}} for r in per_rank],
            "max_loss_rel_diff": max(e["worst_diff"]["loss"] for e in entries),
            "max_probe_abs_diff": max(e["worst_diff"]["probe"] for e in entries),
            "profile": [{"rank": r["rank"], **r["results"][k]["profile"]} for r in per_rank
                        if r["results"][k]["profile"]],
        })
    return rows


def plot_steps_and_ratios(rows: List[Dict[str, Any]], path, *, names: List[str],
                          labels: Dict[str, str], target: float, title: str, figsize,
                          tick_size=None, parity_line: bool = False) -> None:
    """Left: median step ms per configuration (p10-p90 whiskers) of both models. Right: the
    ratio of median step times against ``target`` (and 1.0 dotted with ``parity_line``)."""
    fig, (ax, ax_r) = pyplot().subplots(1, 2, figsize=figsize,
                                        gridspec_kw={"width_ratios": [1.6, 1]})
    x = np.arange(len(rows))
    width = 0.38
    for i, m in enumerate(METHODS):
        ys = [r["median_ms"][m] for r in rows]
        err = [[r["median_ms"][m] - r["p10_ms"][m] for r in rows],
               [r["p90_ms"][m] - r["median_ms"][m] for r in rows]]
        ax.bar(x + (i - 0.5) * width, ys, width, yerr=err, capsize=3, label=labels[m])
    ax.set_xticks(x, names, fontsize=tick_size)
    ax.set_ylabel("ms per training step (median, p10-p90)")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    bars = ax_r.bar(x, [r["ratio"] for r in rows], 0.5, color="tab:purple")
    ax_r.bar_label(bars, fmt="%.2f", fontsize=8)
    ax_r.axhline(target, color="black", linestyle="--", linewidth=1,
                 label=f"target <= {target}")
    if parity_line:
        ax_r.axhline(1.0, color="gray", linestyle=":", linewidth=1)
    ax_r.set_xticks(x, names, fontsize=None if tick_size is None else tick_size - 1)
    ax_r.set_ylabel("dynemb / TorchRec step time")
    ax_r.set_ylim(0, max(target, max(r["ratio"] for r in rows)) * 1.25)
    ax_r.set_title("ratio of median step times")
    ax_r.legend(fontsize=8)
    save_figure(fig, path)
