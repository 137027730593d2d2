"""How the CPU kernels ask numba to compile them, chosen for compile time as much as run time.

A kernel's first call on a machine compiles it (seconds to minutes on a small CPU; cached
afterwards), so two habits of numba that cost compile time and buy no speed are turned off:

- Only a kernel's explicit ``prange`` loops run in parallel (:func:`prange_loops`). With
  ``parallel=True`` numba also turns every array expression (``stats[:] = 0``,
  ``column.sum()``) into a parallel loop of its own, each compiled as a separate function; on
  the few entries such expressions touch here that is slower to compile and no faster to run.
- Large helpers (a table's claim loop, a store's write-back) are plain ``@njit`` functions,
  not ``inline="always"``: numba inlines those by copying their IR into every caller and
  compiling it again there, LLVM inlines small functions anyway, and a helper compiled once
  is cached once. Tiny helpers shared with the CUDA kernels (hashing, scoring, prefetch) and
  the per-row copies of a store's write-backs and loads stay inlined.

Measured on a 2-core CPU (``find_or_insert_cpu`` alone, empty cache): 66 s of compilation
with both habits, 21 s without inlining, 13 s with neither; the same run time.

Example::

    @njit(cache=True, parallel=prange_loops())
    def kernel(out):
        for i in prange(out.size):
            out[i] = i
"""
import functools
import os
import sys

from numba.core import event
from numba.core.compiler_lock import global_compiler_lock
from numba.core.registry import CPUDispatcher
from tqdm import tqdm

try:
    import fcntl
except ImportError:  # not POSIX: each process compiles what it misses
    fcntl = None


def prange_loops() -> dict:
    """numba's ``parallel`` options that parallelize explicit ``prange`` loops only (a new
    dict each call: numba consumes it)."""
    return dict(prange=True, comprehension=False, reduction=False, inplace_binop=False,
                setitem=False, numpy=False, stencil=False, fusion=False)


# -- one compilation per machine ----------------------------------------------------------------
# Processes of one machine (the ranks of a job, the workers of a test run) share numba's cache
# of compiled kernels, but each would compile a kernel it misses there, all at the same time.
_held_locks: set = set()  # lock files this process holds (a compilation nested in another)
_announced = False
_listening = False


def compile_once_per_machine(*modules) -> None:
    """Make the processes of one machine compile each CPU kernel (numba dispatcher) of
    ``modules`` once: the first to need it compiles it under a file lock beside numba's cache
    entry, the others wait for the lock and load what it wrote. The first compilation in a
    process is announced on stderr (by rank 0 only, where ``RANK`` is set).

    Example::

        from dynemb.kernels import table_cpu
        compile_once_per_machine(table_cpu)   # what dynemb's CPU backend does
    """
    global _listening
    for module in modules:
        for kernel in vars(module).values():
            if isinstance(kernel, CPUDispatcher) and "_compile_alone" not in vars(kernel):
                kernel._compile_alone = kernel.compile
                kernel.compile = functools.partial(_compile_under_lock, kernel)
    if not _listening:
        _listening = True
        event.register("numba:compile", _Announcer())


def _compile_under_lock(kernel, sig):
    path = _lock_path(kernel)
    # numba's own lock first: one thread of a process compiles at a time, so no two threads
    # of one process wait for the same file lock
    with global_compiler_lock:
        if path is None or path in _held_locks:
            return kernel._compile_alone(sig)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            handle = open(path, "a+b")
        except OSError:  # a cache numba cannot write to either: nothing to share
            return kernel._compile_alone(sig)
        with handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            _held_locks.add(path)
            try:
                # numba looks in its cache first: a kernel another process compiled while
                # this one waited loads from there
                return kernel._compile_alone(sig)
            finally:
                _held_locks.discard(path)
                fcntl.flock(handle, fcntl.LOCK_UN)


def _lock_path(kernel):
    cache = getattr(kernel._cache, "_cache_path", None)
    if fcntl is None or cache is None:
        return None
    function = kernel.py_func
    return os.path.join(cache, f"{function.__module__}.{function.__qualname__}.lock")


class _Announcer(event.Listener):
    """numba's compile events (they come only where a kernel is compiled, not loaded from the
    cache): the first of a dynemb kernel says why the first steps wait."""

    def on_start(self, compiling):
        global _announced
        kernel = compiling.data["dispatcher"]
        function = kernel.py_func
        if _announced or not function.__module__.startswith("dynemb.kernels"):
            return
        _announced = True
        if os.environ.get("RANK", "0") == "0":
            cache = getattr(kernel._cache, "_cache_path", "numba's cache")
            # tqdm's write: a progress bar on the terminal is redrawn below the line
            tqdm.write(f"dynemb: compiling its CPU kernels for this machine, once (later runs "
                       f"load them from {cache}); the first steps wait for it", file=sys.stderr)

    def on_end(self, compiling):
        pass
