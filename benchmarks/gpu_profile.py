"""Profiling helpers of the GPU benchmark and scripts: numba's launches and argument
conversions named in ``torch.profiler``, and a step's top ops."""
from __future__ import annotations

from typing import Dict, List


def label_numba_launches() -> None:
    """Each launch of the CUDA backend shows in the profiler as ``numba:<kernel>`` (the
    launch's host time: argument typing and the launch) and each tensor handed to numba as
    ``numba:as_cuda_array`` (its conversion, which ``dynemb.bridges.numba_launch`` skips once a
    kernel's arguments are checked), so that their host time is their own."""
    import torch
    from dynemb.backends.numba_backends import CudaBackend
    launch = CudaBackend._launch
    if getattr(launch, "labelled", False):
        return

    def labelled(self, kernel, n, *args):
        name = getattr(getattr(kernel, "py_func", None), "__name__", "kernel")
        with torch.profiler.record_function(f"numba:{name}"):
            launch(self, kernel, n, *args)

    labelled.labelled = True
    CudaBackend._launch = labelled
    from numba import cuda
    convert = cuda.as_cuda_array

    def labelled_convert(obj, *args, **kwargs):
        with torch.profiler.record_function("numba:as_cuda_array"):
            return convert(obj, *args, **kwargs)

    cuda.as_cuda_array = labelled_convert


def device_activity(prof) -> Dict[str, int]:
    """Kernels, memcpys and memsets the profiler saw on the device."""
    from torch.autograd import DeviceType
    counts = {"kernels": 0, "memcpy": 0, "memset": 0}
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        name = event.name.lower()
        kind = "memcpy" if "memcpy" in name else "memset" if "memset" in name else "kernels"
        counts[kind] += 1
    return counts


def top_ops(prof, steps: int, limit: int = 15) -> List[dict]:
    """Where a step's time goes: the ops of most host time (self), with their device time,
    in ms per step."""
    rows = []
    for avg in prof.key_averages():
        device_us = getattr(avg, "self_device_time_total", 0) or 0
        rows.append({"op": avg.key, "calls": avg.count / max(steps, 1),
                     "self_cpu_ms": avg.self_cpu_time_total / 1e3 / max(steps, 1),
                     "self_device_ms": device_us / 1e3 / max(steps, 1)})
    rows.sort(key=lambda r: -(r["self_cpu_ms"] + r["self_device_ms"]))
    return rows[:limit]


def print_top_ops(ops: List[dict], limit: int = 10) -> None:
    """The rows of :func:`top_ops`, one line each: op, calls, host and device ms per step."""
    for op in ops[:limit]:
        print(f"  {op['op'][:60]:<60} x{op['calls']:<6.0f} {op['self_cpu_ms']:8.3f} "
              f"{op['self_device_ms']:8.3f}")
