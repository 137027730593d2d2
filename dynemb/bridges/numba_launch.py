"""Launching numba CUDA kernels on torch tensors with less host time per launch.

numba's own launch (``kernel[blocks, threads, stream](*arrays)``) converts every tensor to a
``DeviceNDArray`` (``cuda.as_cuda_array``: about 35 us each on an H200 host) and types every
argument again to pick the compiled kernel; a training step's ~30 array arguments then cost
more host time than its kernels take on the device.

:class:`KernelLauncher` does the first launch of each kernel and argument signature the
standard way, then builds the same driver arguments numba would (the array's size, item size,
pointer, shape and strides; ctypes scalars) straight from the tensors, and **checks them
against numba's own marshalling of that first call** (``_Kernel._prepare_args``). Only a
signature whose arguments came out identical is launched directly from then on; any other
(an argument type it does not build, a numba-cuda whose internals differ, a non-contiguous
tensor) keeps numba's launch. ``DYNEMB_DIRECT_LAUNCH=0`` turns the direct path off.

Example::

    launcher = KernelLauncher()
    launcher.launch(table_cuda.find_kernel, blocks, threads, torch.cuda.current_stream(),
                    (keys_tensor, num_buckets, bucket_size, query, out))
"""
from __future__ import annotations

import ctypes
import os
import threading
from typing import Dict, Tuple

import torch

#: The numba-cuda internals the direct path reads (checked once; missing ones disable it).
_NUMBA_INTERNALS = ("argument_types", "_prepare_args", "_codelibrary", "cooperative", "debug")


def direct_launch_enabled() -> bool:
    """False when ``DYNEMB_DIRECT_LAUNCH=0`` asks for numba's launch everywhere."""
    return os.environ.get("DYNEMB_DIRECT_LAUNCH", "1") != "0"


class KernelLauncher:
    """Launches numba kernels on torch CUDA tensors, directly once a signature is checked.

    ``launch(kernel, blocks, threads, stream, args)``: ``args`` are torch tensors (any
    contiguous CUDA tensor), Python ints and bools, numpy float32 / float64 scalars, exactly
    as the kernel would take them through numba. ``stream`` is a ``torch.cuda.Stream``."""

    def __init__(self):
        from numba import cuda
        self._cuda = cuda
        self._lock = threading.Lock()
        self._streams: Dict[int, object] = {}
        #: (kernel, signature) -> (the driver function, argument types), or None: numba's launch
        self._direct: Dict[Tuple, object] = {}
        #: kernel name -> why one of its signatures keeps numba's launch
        self._refusals: Dict[str, str] = {}
        self._enabled = direct_launch_enabled()
        self._launch_fn = self._config_of = None
        if self._enabled:
            try:
                from cuda.core import LaunchConfig, launch
                from numba.cuda._compat import CUDA_CORE_GE_1_0
            except ImportError:
                self._enabled = False
            else:
                self._launch_fn = launch
                flag = "is_cooperative" if CUDA_CORE_GE_1_0 else "cooperative_launch"
                self._config_of = lambda blocks, threads: LaunchConfig(
                    grid=blocks, block=threads, shmem_size=0, **{flag: False})

    @property
    def direct_signatures(self) -> int:
        """How many (kernel, signature) pairs launch directly (checked against numba)."""
        return sum(1 for v in self._direct.values() if v is not None)

    @property
    def refusals(self) -> Dict[str, str]:
        """Kernels with a signature that keeps numba's launch, and why (the first reason)."""
        return dict(self._refusals)

    def numba_stream(self, stream: torch.cuda.Stream):
        """numba's handle of a torch stream, made once per stream."""
        handle = stream.cuda_stream
        found = self._streams.get(handle)
        if found is None:
            found = self._streams[handle] = self._cuda.external_stream(handle)
        return found

    def launch(self, kernel, blocks: int, threads: int, stream: torch.cuda.Stream,
               args: tuple) -> None:
        numba_stream = self.numba_stream(stream)
        key = (kernel, _signature(args)) if self._enabled else None
        if key is not None and key[1] is None:
            self._refuse(kernel, "a non-contiguous tensor argument")
        direct = self._direct.get(key) if key is not None and key[1] is not None else None
        if direct is not None:
            function, types = direct
            self._launch_fn(numba_stream, self._config_of(blocks, threads), function,
                            *_driver_args(types, args))
            return
        converted = tuple(self._cuda.as_cuda_array(a.detach()) if isinstance(a, torch.Tensor)
                          else a for a in args)
        kernel[blocks, threads, numba_stream](*converted)
        if key is not None and key[1] is not None and key not in self._direct:
            path, reason = _checked_direct_path(kernel, args, converted)
            with self._lock:
                self._direct[key] = path
            if path is None:
                self._refuse(kernel, reason)

    def _refuse(self, kernel, reason: str) -> None:
        name = getattr(getattr(kernel, "py_func", None), "__name__", repr(kernel))
        self._refusals.setdefault(name, reason)


def _signature(args) -> Tuple:
    """What picks the compiled kernel: each tensor's dtype and rank (contiguous tensors only;
    None for any other) and its device (a kernel is loaded once per device), each scalar's
    type."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if not a.is_contiguous():
                return None
            out.append((a.dtype, a.dim(), a.get_device()))
        else:
            out.append(type(a))
    return tuple(out)


def _driver_args(types, args) -> list:
    """The driver arguments numba's ``_Kernel._prepare_args`` makes of ``args``: per array
    (meminfo, parent, size, item size, pointer, shape..., strides in bytes...), per scalar
    a ctypes value (a bool as it is)."""
    from numba.cuda import types as nt
    out = []
    for ty, a in zip(types, args):
        if isinstance(ty, nt.Array):
            item = a.element_size()
            shape = tuple(a.shape)
            strides, step = [0] * len(shape), item
            for i in range(len(shape) - 1, -1, -1):  # C-contiguous strides from the shape
                strides[i] = step
                step *= shape[i]
            # an empty tensor's null pointer goes as 0: numba's own launcher takes it as
            # None, but cuda.core's launch refuses None ("unsupported type NoneType")
            out += [0, 0, a.numel(), item, a.data_ptr(), *shape, *strides]
        elif ty == nt.boolean:
            out.append(a)
        elif ty == nt.float32:
            out.append(ctypes.c_float(a))
        elif ty == nt.float64:
            out.append(ctypes.c_double(a))
        elif isinstance(ty, nt.Integer):
            out.append(getattr(ctypes, f"c_{ty}")(a))
        else:
            raise TypeError(f"no direct launch for an argument of type {ty}")
    return out


def _checked_direct_path(kernel, args, converted):
    """((driver function, argument types), "") when the arguments built here equal numba's
    own for this call, else (None, why): numba's launch stays."""
    try:
        argtypes = tuple(kernel.typeof_pyval(a) for a in converted)
        compiled = kernel.overloads[argtypes]
        missing = [name for name in _NUMBA_INTERNALS if not hasattr(compiled, name)]
        if missing:
            return None, f"this numba-cuda lacks {missing}"
        if compiled.debug or compiled.cooperative:
            return None, "a debug or cooperative kernel"
        types = compiled.argument_types
        theirs: list = []
        for ty, value in zip(types, converted):
            compiled._prepare_args(ty, value, 0, [], theirs)
        mine = _driver_args(types, args)
        mine, theirs = [_comparable(x) for x in mine], [_comparable(x) for x in theirs]
        if mine != theirs:
            first = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b) \
                if len(mine) == len(theirs) else min(len(mine), len(theirs))
            return None, (f"driver arguments differ from numba's at {first} of "
                          f"{len(theirs)}: {mine[first:first + 2]} != {theirs[first:first + 2]} "
                          f"(types {types})")
        return (compiled._codelibrary.get_cufunc().kernel, types), ""
    except Exception as error:  # any surprise in numba's internals: keep its launch
        return None, f"{type(error).__name__}: {str(error)[:200]}"


def _comparable(value):
    if value is None:  # numba's null pointer; the direct path passes it as 0
        return "int", 0
    if isinstance(value, ctypes._SimpleCData):
        return type(value).__name__, value.value
    return type(value).__name__ if isinstance(value, bool) else "int", int(value)
