"""numba's CUDA simulator, with the threads of a block that never synchronize run one after
another in the calling thread, and those of a block that does without polling.

The simulator runs every thread of a block as a Python thread and polls them in a loop so
that ``cuda.syncthreads`` can block them: starting, polling and joining a thread costs
about 0.3 ms, far more than the body of most of dynemb's kernels, and a test launching
thousands of threads spends most of its time there. A kernel that calls no barrier nor warp
function (neither itself nor any device function it calls, read from their code) cannot
tell one order of its threads from another, so its threads run in order, each seeing its
own ``threadIdx`` / ``blockIdx``, with the simulator's arrays, atomics and error messages
unchanged. Kernels that synchronize (the claim counts' block sum, the optimizer's
reductions) keep threads, released at each barrier as the simulator releases them, but
from a pool kept across launches (starting a thread is most of the cost), and the block
waits for its threads to tell it they reached a barrier or ended instead of polling them in
a loop (which took the GIL from the threads it waited for).

Under the GIL the simulator's threads mostly ran to completion one at a time already (a
thread switch comes every 5 ms), so this takes away no interleaving the tests relied on.
Installed by the repository's ``conftest.py`` when the simulator is on.
"""
import sys
import threading
import types

import numpy as np
from numba.cuda.simulator import kernel as sim_kernel
from numba.cuda.simulator import kernelapi as sim_api

#: What makes the threads of a block depend on each other's progress.
_SYNCHRONIZING = frozenset({
    "syncthreads", "syncthreads_count", "syncthreads_and", "syncthreads_or", "syncwarp",
    "shfl_sync", "shfl_up_sync", "shfl_down_sync", "shfl_xor_sync", "all_sync", "any_sync",
    "eq_sync", "ballot_sync", "match_any_sync", "match_all_sync", "activemask",
    "lanemask_lt"})
_verdicts: dict = {}
_running = threading.local()


def _code_names(code) -> set:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def synchronizes(fn, seen=None) -> bool:
    """Whether kernel ``fn`` (a Python function) or a device function it calls uses a
    barrier or a warp function. Device functions are found among its globals (also as
    attributes of a module it names) and its closure."""
    if fn in _verdicts:
        return _verdicts[fn]
    seen = set() if seen is None else seen
    seen.add(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return True  # not Python code we can read: keep the simulator's threads
    names = _code_names(code)
    found = bool(names & _SYNCHRONIZING)
    if not found:
        scope = dict(getattr(fn, "__globals__", {}))
        for cell, name in zip(fn.__closure__ or (), code.co_freevars):
            try:
                scope[name] = cell.cell_contents
            except ValueError:
                continue
        called = [scope[n] for n in names if n in scope]
        for obj in list(called):
            if isinstance(obj, types.ModuleType):
                called += [getattr(obj, n) for n in names if hasattr(obj, n)]
        for obj in called:
            inner = getattr(obj, "fn", None) if isinstance(obj, sim_kernel.FakeCUDAKernel) else None
            if inner is not None and inner not in seen and synchronizes(inner, seen):
                found = True
                break
    _verdicts[fn] = found
    return found


class _SequentialThread:
    """What the simulator's kernel API reads of the running thread."""

    def __init__(self, manager, block_idx, thread_idx):
        self.blockIdx = sim_kernel.Dim3(*block_idx)
        self.threadIdx = sim_kernel.Dim3(*thread_idx)
        dim = sim_kernel.Dim3(*manager._block_dim)
        self.thread_id = self.threadIdx.x + dim.x * (self.threadIdx.y + dim.y * self.threadIdx.z)

    def syncthreads(self):
        raise RuntimeError("a kernel run thread by thread reached a barrier: "
                           "tests/sequential_cudasim.py did not see it synchronize")


class _Threading(types.ModuleType):
    """``threading`` as the kernel API sees it: the running sequential thread, if any."""

    def __getattr__(self, name):
        return getattr(threading, name)

    @staticmethod
    def current_thread():
        running = getattr(_running, "thread", None)
        return running if running is not None else threading.current_thread()


class _Block:
    """What the threads of one block share: how many still run, which wait at a barrier,
    the first to fail."""

    def __init__(self, size):
        self.changed = threading.Condition()
        self.live = size
        self.waiting = []
        self.failed = None


class _PoolThread(threading.Thread):
    """A thread kept for the blocks that synchronize: it runs one simulated thread of a
    block at a time, with the attributes the simulator's kernel API reads of its thread,
    and tells the block when it reaches a barrier or ends (so the block need not poll)."""

    def __init__(self):
        super().__init__(daemon=True)
        self._go = threading.Event()
        self.syncthreads_event = threading.Event()

    def assign(self, block, manager, fn, args, block_idx, thread_idx):
        self._block, self._manager, self._fn, self._args = block, manager, fn, args
        self.blockIdx = sim_kernel.Dim3(*block_idx)
        self.threadIdx = sim_kernel.Dim3(*thread_idx)
        dim = sim_kernel.Dim3(*manager._block_dim)
        self.thread_id = self.threadIdx.x + dim.x * (self.threadIdx.y + dim.y * self.threadIdx.z)
        self.exception = None
        self.abort = False
        self.syncthreads_event.clear()
        self._go.set()

    def run(self):
        while True:
            self._go.wait()
            self._go.clear()
            try:
                self._fn(*self._args)
            except Exception as e:  # as the simulator's threads report it
                tid, ctaid = f"tid={list(self.threadIdx)}", f"ctaid={list(self.blockIdx)}"
                msg = f"{tid} {ctaid}: {e}" if str(e) else f"{tid} {ctaid}"
                self.exception = (type(e)(msg), sys.exc_info()[2])
            block = self._block
            with block.changed:
                block.live -= 1
                if self.exception is not None and block.failed is None:
                    block.failed = self
                block.changed.notify_all()

    def syncthreads(self):
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads call")
        with self._block.changed:
            self._block.waiting.append(self)
            self._block.changed.notify_all()
        self.syncthreads_event.wait()
        self.syncthreads_event.clear()
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads clear")

    syncthreads_count = sim_kernel.BlockThread.syncthreads_count
    syncthreads_and = sim_kernel.BlockThread.syncthreads_and
    syncthreads_or = sim_kernel.BlockThread.syncthreads_or


_pool: list = []
_pool_lock = threading.Lock()  # one block at a time on the pool, whichever thread launches


def _run_threads(manager, grid_point, *args):
    """The threads of a block that synchronizes, released at each barrier once every live
    thread waits there (as the simulator releases them, without its polling loop and
    without starting a thread per simulated thread)."""
    with _pool_lock:
        _run_on_pool(manager, grid_point, args)


def _run_on_pool(manager, grid_point, args):
    points = list(np.ndindex(*manager._block_dim))
    while len(_pool) < len(points):
        _pool.append(_PoolThread())
        _pool[-1].start()
    block = _Block(len(points))
    threads = _pool[:len(points)]
    for t, block_point in zip(threads, points):
        t.assign(block, manager, manager._f, args, grid_point, block_point)
    with block.changed:
        while True:
            if block.failed is not None:
                for t in threads:
                    t.abort = True
                    t.syncthreads_event.set()
                while block.live:  # every thread back in the pool before the next block
                    block.changed.wait()
                exception, traceback = block.failed.exception
                raise exception.with_traceback(traceback)
            if block.live == 0:
                return
            if block.waiting and len(block.waiting) == block.live:
                for t in block.waiting:
                    t.syncthreads_event.set()
                block.waiting = []
            block.changed.wait()


def _run(self, grid_point, *args):
    if synchronizes(self._f):
        return _run_threads(self, grid_point, *args)
    for block_point in np.ndindex(*self._block_dim):
        _running.thread = _SequentialThread(self, grid_point, block_point)
        try:
            self._f(*args)
        except Exception as e:  # the message the simulator's threads give
            raise type(e)(f"tid={list(block_point)} ctaid={list(grid_point)}: {e}"
                          if str(e) else f"tid={list(block_point)} ctaid={list(grid_point)}"
                          ).with_traceback(sys.exc_info()[2]) from None
        finally:
            _running.thread = None


def install() -> None:
    """Run the blocks of non-synchronizing kernels thread by thread (idempotent)."""
    if sim_kernel.BlockManager.run is _run:
        return
    sim_api.threading = _Threading("threading")
    sim_kernel.BlockManager.run = _run
