"""Pick the CPU or CUDA kernels for a tensor's device and launch them on torch tensors.

Both backends implement :class:`~dynemb.kernel_backend.KernelBackend` over torch tensors;
``ScoredHashTable``, the initializers and the optimizers only talk to that interface. The
CUDA backend also runs under numba's simulator (``NUMBA_ENABLE_CUDASIM=1``), where it takes
CPU tensors: that is how CI exercises the CUDA kernels without a GPU.

Example::

    >>> backend = backend_for_device(torch.device("cpu"))
    >>> table = TableArrays.empty(128, 128, torch.device("cpu"))
    >>> out = torch.empty(1, dtype=torch.int64)
    >>> backend.find(table, torch.tensor([7]), out); out.tolist()
    [-1]
"""
from __future__ import annotations

import threading
from functools import lru_cache
from typing import Tuple

import numba
import numpy as np
import torch

from dynemb.bridges.numba_launch import KernelLauncher
from dynemb.kernel_backend import KernelBackend, TableArrays
from dynemb.hot_rows import hot_row_pieces
from dynemb.group_kernels import CpuGroupKernels, CudaGroupKernels
from dynemb.kernels import dedup_cpu, init_cpu, optim_cpu, pool_cpu, round_cpu, table_cpu
from dynemb.kernels.constants import EMPTY_KEY, TOMBSTONE_KEY, cuda_simulator_enabled
from dynemb.threads import apply_defaults as apply_thread_defaults

_THREADS_PER_BLOCK = 256
_SIMULATED_THREADS_PER_BLOCK = 32
_MIN_PARALLEL_KEYS = 16384
#: find_or_insert: smallest batch worth sorting by bucket.
_MIN_PARTITIONED_KEYS = 4096


class CpuBackend(CpuGroupKernels):
    """``@njit`` kernels on CPU tensors (viewed as numpy arrays without copying); the
    table-group kernels come from :class:`~dynemb.group_kernels.CpuGroupKernels`."""

    name = "cpu"
    #: Slot failures raise at once (reading a count costs nothing on CPU); unique keys are
    #: exact, never padded.
    defers_failures = False

    def __init__(self):
        # the process's thread defaults (dynemb.threads: idle OpenMP threads sleep, numba's
        # count): created once per process, before the first CPU kernel runs
        apply_thread_defaults()

    def check_device(self, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(f"the cpu backend needs CPU tensors, got device {device}")

    def claim_summary(self, slots, inserted, previous_keys):
        """``(hits, inserts, evictions)`` of one ``find_or_insert`` result, as ints (one numba
        pass)."""
        placed, new, evicted = table_cpu.claim_summary_cpu(
            self._np(slots), self._np(inserted), self._np(previous_keys))
        return int(placed - new), int(new), int(evicted)

    def find(self, table: TableArrays, keys, out_slots, parallel=None):
        if parallel is None:  # threads only pay off with more than one and a real batch
            parallel = numba.get_num_threads() > 1 and keys.numel() >= _MIN_PARALLEL_KEYS
        kernel = table_cpu.find_cpu if parallel else table_cpu.find_serial_cpu
        kernel(self._np(table.keys), table.num_buckets, table.bucket_size, self._np(keys),
               self._np(out_slots))

    def lookup_update(self, table: TableArrays, ukeys, counts, given, policy, clock, pin,
                      out_slots, out_prev_scores):
        n = self._np
        table_cpu.lookup_update_cpu(*_probe_args(table, n), n(ukeys), n(counts), n(given),
                                    policy, clock, pin, n(out_slots), n(out_prev_scores))

    def insert_missing(self, table: TableArrays, ukeys, counts, given, policy, clock,
                       allow_evict, slots, out_prev_keys, out_prev_scores, out_failed):
        n = self._np
        table_cpu.insert_missing_cpu(*_claim_args(table, n), n(ukeys), n(counts), n(given),
                                     policy, clock, allow_evict, n(slots), n(out_prev_keys),
                                     n(out_prev_scores), n(out_failed), numba.get_num_threads())

    def find_or_insert(self, table: TableArrays, ukeys, counts, given, policy, clock,
                       allow_evict, pin, out_slots, out_inserted, out_prev_keys, out_prev_scores,
                       out_failed, out_stats):
        n = self._np
        keys = ukeys.numel()
        # Batches large enough to revisit buckets go in bucket order, a bucket range at a time
        # (its slots stay in cache and the table is read front to back); small ones in batch
        # order.
        parts = 1
        if keys >= _MIN_PARTITIONED_KEYS:
            parts = min(table.num_buckets, keys)
        scratch = _SCRATCH.get(table_cpu.scratch_size(keys, parts, policy))
        table_cpu.find_or_insert_cpu(*_claim_args(table, n), n(ukeys), n(counts), n(given),
                                     policy, clock, allow_evict, pin, parts, scratch,
                                     n(out_slots), n(out_inserted), n(out_prev_keys),
                                     n(out_prev_scores), n(out_failed), n(out_stats))

    def erase(self, table: TableArrays, keys, out_erased, out_pinned):
        n = self._np
        table_cpu.erase_cpu(*_claim_args(table, n), n(keys), n(out_erased), n(out_pinned))

    def dedup(self, keys, num_buckets=None):
        """(unique keys, inverse, counts): in first-occurrence order, or with ``num_buckets``
        sorted by bucket of a table of that many buckets (ties in first-occurrence order),
        the order its ``find_or_insert`` claims them in."""
        n = keys.numel()
        unique, inverse, counts = (torch.empty(n, dtype=torch.int64) for _ in range(3))
        parts = dedup_cpu.dedup_parts(n)
        if num_buckets is None:
            scratch = _SCRATCH.get(dedup_cpu.dedup_scratch_size(n))
            u = dedup_cpu.dedup_cpu(keys.numpy(), parts, scratch, unique.numpy(),
                                    inverse.numpy(), counts.numpy())
        else:
            scratch = _SCRATCH.get(dedup_cpu.bucket_dedup_scratch_size(n, parts))
            chunks = numba.get_num_threads() * dedup_cpu.DEDUP_CHUNKS_PER_THREAD
            u = dedup_cpu.dedup_bucket_order_cpu(keys.numpy(), num_buckets, parts, chunks,
                                                 scratch, unique.numpy(), inverse.numpy(),
                                                 counts.numpy())
        return unique[:u], inverse, counts[:u]

    def add_refcounts(self, table: TableArrays, slots, delta):
        table_cpu.add_refcounts_cpu(self._np(table.refcnt), self._np(slots), delta)

    def export(self, table: TableArrays, start, end) -> Tuple[torch.Tensor, ...]:
        n = end - start
        keys, slots, scores = (torch.empty(n, dtype=torch.int64) for _ in range(3))
        count = table_cpu.export_cpu(self._np(table.keys), self._np(table.scores), start, end,
                                     keys.numpy(), slots.numpy(), scores.numpy())
        return keys[:count], slots[:count], scores[:count]

    def rehash(self, old: TableArrays, new: TableArrays, remap) -> int:
        return int(table_cpu.rehash_cpu(*_rehash_args(old, new, self._np), self._np(remap)))

    def init_rows(self, out, keys, seed, table_id, kind, p0, p1, low, high):
        init_cpu.init_rows_cpu(self._np(out), self._np(keys), seed, table_id, kind, p0, p1, low,
                               high)

    def init_rows_at(self, weights, slots, keys, mask, dim, seed, table_id, kind, p0, p1, low,
                     high):
        n = self._np
        init_cpu.init_rows_at_cpu(n(weights), n(slots), n(keys), n(mask), dim, seed, table_id,
                                  kind, p0, p1, low, high)

    def fused_update(self, weights, slots, src, offsets, order, scale, clip, kind, dim, lr,
                     eps, beta1, beta2, weight_decay, bias1, bias2, acc0):
        """In place on float32 ``weights`` [C, W]; see ``optim_cpu.fused_update_cpu``."""
        n = self._np
        chunks = numba.get_num_threads() * optim_cpu.CHUNKS_PER_THREAD
        optim_cpu.fused_update_cpu(n(weights), n(slots), n(src), n(offsets), n(order), n(scale),
                                   *_f32(clip), chunks, kind, dim,
                                   *_f32(lr, eps, beta1, beta2, weight_decay, bias1, bias2, acc0))

    def round_rows(self, src, out, keys, seed, table_id, step, fmt, stochastic):
        """float32 ``src`` [N, D] rounded into float16 / bfloat16 ``out`` [N, D]; see
        ``round_cpu.round_rows_cpu``."""
        round_cpu.round_rows_cpu(*_bit_views(src, out, self._np), self._np(keys), seed,
                                 table_id, step, fmt, stochastic)

    def pool_bags(self, weights, occ_slots, offsets, scale, mean, batch, cols, dim, out):
        """A table's bags into their columns of ``out`` [B, C]; see
        ``pool_cpu.pool_bags_cpu``."""
        n = self._np
        pool_cpu.pool_bags_cpu(n(weights), n(occ_slots), n(offsets), n(scale), bool(mean),
                               int(batch), n(cols), int(dim), n(out))


class _Scratch(threading.local):
    """One growing int64 buffer per thread, reused by the kernels across calls (a large batch
    would otherwise fault in fresh pages on every call)."""

    def __init__(self):
        self._buffer = np.empty(0, dtype=np.int64)

    def get(self, words: int) -> np.ndarray:
        """At least ``words`` int64 of scratch (contents undefined)."""
        if self._buffer.size < words:
            self._buffer = np.empty(max(words, self._buffer.size * 5 // 4), dtype=np.int64)
        return self._buffer


_SCRATCH = _Scratch()


class CudaBackend(CudaGroupKernels):
    """numba-cuda kernels on CUDA tensors, launched on torch's current stream.

    Under the simulator the same kernels take CPU tensors.
    """

    name = "cuda"
    #: Slot failures are counted on the device and reported at a later call (reading them
    #: would stall the host); unique keys are padded with EMPTY_KEY (slot -1).
    defers_failures = True

    def __init__(self):
        from numba import cuda

        from dynemb.kernels import groups_cuda, init_cuda, optim_cuda, round_cuda, table_cuda

        self._cuda = cuda
        self._table = table_cuda
        self._groups = groups_cuda
        self._init = init_cuda
        self._optim = optim_cuda
        self._round = round_cuda
        self._simulated = cuda_simulator_enabled()
        self._launcher = None  # made at the first launch on a GPU

    def check_device(self, device: torch.device) -> None:
        want = "cpu" if self._simulated else "cuda"
        if device.type != want:
            mode = "the CUDA simulator" if self._simulated else "a GPU"
            raise ValueError(f"the cuda backend on {mode} needs {want} tensors, got {device}")

    @staticmethod
    def claim_summary(slots, inserted, previous_keys):
        """``(hits, inserts, evictions)`` of one ``find_or_insert`` result, as 0-d device
        tensors (no host sync)."""
        hits = ((slots >= 0) & ~inserted).sum()
        evicted = inserted & (previous_keys != EMPTY_KEY) & (previous_keys != TOMBSTONE_KEY)
        return hits, inserted.sum(), evicted.sum()

    def direct_launch_signatures(self) -> int:
        """How many (kernel, argument signature) pairs this process launches without numba's
        argument conversion (see :mod:`dynemb.bridges.numba_launch`)."""
        return 0 if self._launcher is None else self._launcher.direct_signatures

    def _arr(self, t: torch.Tensor):
        """A kernel argument: the tensor itself on a GPU (``_launch`` hands it to numba),
        its numpy view under the simulator."""
        return t.numpy() if self._simulated else t

    def _launch(self, kernel, n: int, *args) -> None:
        if n <= 0:
            return
        blocks = (n + _THREADS_PER_BLOCK - 1) // _THREADS_PER_BLOCK
        if self._simulated:
            # Small blocks: the simulator runs every thread of a block as a Python thread.
            blocks = (n + _SIMULATED_THREADS_PER_BLOCK - 1) // _SIMULATED_THREADS_PER_BLOCK
            kernel[blocks, _SIMULATED_THREADS_PER_BLOCK](*args)
            return
        if self._launcher is None:
            self._launcher = KernelLauncher()
        self._launcher.launch(kernel, blocks, _THREADS_PER_BLOCK, torch.cuda.current_stream(),
                              args)

    def find(self, table: TableArrays, keys, out_slots, parallel=None):
        a = self._arr
        self._launch(self._table.find_kernel, keys.numel(), a(table.keys), table.num_buckets,
                     table.bucket_size, a(keys), a(out_slots))

    def lookup_update(self, table: TableArrays, ukeys, counts, given, policy, clock, pin,
                      out_slots, out_prev_scores):
        a = self._arr
        self._launch(self._table.lookup_update_kernel, ukeys.numel(), *_probe_args(table, a),
                     a(ukeys), a(counts), a(given), policy, clock, pin, a(out_slots),
                     a(out_prev_scores))

    def insert_missing(self, table: TableArrays, ukeys, counts, given, policy, clock,
                       allow_evict, slots, out_prev_keys, out_prev_scores, out_failed):
        a = self._arr
        self._launch(self._table.insert_missing_kernel, ukeys.numel(), *_claim_args(table, a),
                     a(ukeys), a(counts), a(given), policy, clock, allow_evict, a(slots),
                     a(out_prev_keys), a(out_prev_scores), a(out_failed))

    def find_or_insert(self, table: TableArrays, ukeys, counts, given, policy, clock,
                       allow_evict, pin, out_slots, out_inserted, out_prev_keys, out_prev_scores,
                       out_failed, out_stats):
        """Look up and pin every key, then claim slots for the missing ones: the pins keep a
        batch's slots from being claimed by its other keys; without ``pin`` they are dropped
        at the end. Stats are computed on the device (no host sync).

        Separate launches (lookup, claims, then the unpin without ``pin``): every hit must
        hold its pin before any key picks a victim, and every claim must be done before the
        pins drop; a launch has no barrier across its blocks. Nothing is read on the host
        between them."""
        self.lookup_update(table, ukeys, counts, given, policy, clock, True, out_slots,
                           out_prev_scores)
        hit = out_slots >= 0
        self.insert_missing(table, ukeys, counts, given, policy, clock, allow_evict, out_slots,
                            out_prev_keys, out_prev_scores, out_failed)
        torch.logical_and(out_slots >= 0, ~hit, out=out_inserted)
        if not pin:
            self.add_refcounts(table, out_slots, -1)
        out_stats[0] = out_failed.sum()
        out_stats[1] = (out_inserted & (out_prev_keys != EMPTY_KEY)
                        & (out_prev_keys != TOMBSTONE_KEY)).sum()

    def erase(self, table: TableArrays, keys, out_erased, out_pinned):
        a = self._arr
        self._launch(self._table.erase_kernel, keys.numel(), *_claim_args(table, a), a(keys),
                     a(out_erased), a(out_pinned))

    def dedup(self, keys, num_buckets=None):
        """(sorted unique keys, inverse, counts); ``num_buckets`` is not used (the claim
        kernels take keys in any order)."""
        return torch.unique(keys, return_inverse=True, return_counts=True)

    def add_refcounts(self, table: TableArrays, slots, delta):
        self._launch(self._table.add_refcounts_kernel, slots.numel(), self._arr(table.refcnt),
                     self._arr(slots), delta)

    def export(self, table: TableArrays, start, end):
        n = end - start
        dev = table.keys.device
        keys, slots, scores = (torch.empty(n, dtype=torch.int64, device=dev) for _ in range(3))
        counter = torch.zeros(1, dtype=torch.int64, device=dev)
        a = self._arr
        self._launch(self._table.export_kernel, n, a(table.keys), a(table.scores), start, end,
                     a(counter), a(keys), a(slots), a(scores))
        count = int(counter.item())
        order = torch.argsort(slots[:count])
        return keys[:count][order], slots[:count][order], scores[:count][order]

    def rehash(self, old: TableArrays, new: TableArrays, remap) -> int:
        lost = torch.zeros(1, dtype=torch.int64, device=old.keys.device)
        a = self._arr
        self._launch(self._table.rehash_kernel, old.capacity, *_rehash_args(old, new, a),
                     a(remap), a(lost))
        return int(lost.item())

    def init_rows(self, out, keys, seed, table_id, kind, p0, p1, low, high):
        self._launch(self._init.init_rows_kernel, out.numel(), self._arr(out), self._arr(keys),
                     seed, table_id, kind, p0, p1, low, high)

    def init_rows_at(self, weights, slots, keys, mask, dim, seed, table_id, kind, p0, p1, low,
                     high):
        a = self._arr
        self._launch(self._init.init_rows_at_kernel, slots.numel() * weights.shape[1],
                     a(weights), a(slots), a(keys), a(mask), dim, seed, table_id, kind, p0, p1,
                     low, high)

    def fused_update(self, weights, slots, src, offsets, order, scale, clip, kind, dim, lr,
                     eps, beta1, beta2, weight_decay, bias1, bias2, acc0):
        """In place on float32 ``weights`` [C, W]; one warp per row of ``slots``, the rows
        with many occurrences summed in pieces first (see ``optim_cuda``)."""
        # The kernel's shared buffer holds optim_cuda.MAX_THREADS_PER_BLOCK >= block size.
        a = self._arr
        pieces = self._hot_row_pieces(src, offsets, order, scale, clip, dim)
        self._launch(self._optim.fused_update_kernel, slots.numel() * self._optim.WARP,
                     a(weights), a(slots), a(src), a(offsets), a(order), a(scale), *_f32(clip),
                     *map(a, pieces), kind, dim,
                     *_f32(lr, eps, beta1, beta2, weight_decay, bias1, bias2, acc0))

    def _hot_row_pieces(self, src, offsets, order, scale, clip, dim):
        """``(piece_end, piece_count, pieces)`` of ``fused_update_kernel``: the layout of
        :func:`~dynemb.hot_rows.hot_row_pieces`, ``pieces`` [P, dim] filled by
        ``piece_sums_kernel``."""
        piece_row, piece_end, piece_count = hot_row_pieces(offsets, order.numel(),
                                                           self._optim.PIECE)
        pieces = torch.empty(piece_row.numel(), dim, dtype=torch.float32, device=src.device)
        a = self._arr
        self._launch(self._optim.piece_sums_kernel, piece_row.numel() * self._optim.WARP,
                     a(src), a(offsets), a(order), a(scale), *_f32(clip), a(piece_row),
                     a(piece_end), a(piece_count), a(pieces), dim)
        return piece_end, piece_count, pieces

    def round_rows(self, src, out, keys, seed, table_id, step, fmt, stochastic):
        """float32 ``src`` [N, D] rounded into float16 / bfloat16 ``out`` [N, D]; one thread
        per element."""
        self._launch(self._round.round_rows_kernel, src.numel(), *_bit_views(src, out, self._arr),
                     self._arr(keys), seed, table_id, step, fmt, stochastic)

    def pool_bags(self, weights, occ_slots, offsets, scale, mean, batch, cols, dim, out):
        """A table's bags into their columns of ``out`` [B, C]; one warp per bag."""
        from dynemb.kernels import pool_cuda
        a = self._arr
        self._launch(pool_cuda.pool_bags_kernel, (offsets.numel() - 1) * pool_cuda.WARP,
                     a(weights), a(occ_slots), a(offsets), a(scale), bool(mean), int(batch),
                     a(cols), int(dim), a(out))


def _probe_args(table: TableArrays, convert):
    """Leading kernel arguments of the kernels that probe and rescore: keys, scores, pins
    and the bucket geometry."""
    return (convert(table.keys), convert(table.scores), convert(table.refcnt),
            table.num_buckets, table.bucket_size)


def _claim_args(table: TableArrays, convert):
    """Leading kernel arguments of the kernels that claim or free slots (they also keep
    ``size`` up to date)."""
    return (convert(table.keys), convert(table.scores), convert(table.refcnt),
            convert(table.size), table.num_buckets, table.bucket_size)


def _rehash_args(old: TableArrays, new: TableArrays, convert):
    return (convert(old.keys), convert(old.scores), convert(old.refcnt), convert(new.keys),
            convert(new.scores), convert(new.refcnt), new.num_buckets, new.bucket_size)


def _bit_views(src, out, convert):
    """float32 ``src`` as int32 and 16-bit ``out`` as int16 arrays (bfloat16 has no numpy
    dtype; the kernels round on bit patterns)."""
    return convert(src.view(torch.int32)), convert(out.view(torch.int16))


def _f32(*values):
    """Kernel scalars as float32, so the kernels compute (and compile) in float32."""
    return tuple(np.float32(v) for v in values)


@lru_cache(maxsize=None)
def get_backend(name: str) -> KernelBackend:
    """The backend called ``name`` ("cpu" or "cuda"), created once per process."""
    if name == "cpu":
        return CpuBackend()
    if name == "cuda":
        return CudaBackend()
    raise ValueError(f"backend must be 'cpu' or 'cuda', got {name!r}")


def backend_for_device(device: torch.device, backend: str | None = None) -> KernelBackend:
    """The backend for ``device``; ``backend`` overrides it (e.g. "cuda" under the simulator).

    What a top-level owner (a table, a user's own ``ScoredHashTable``) calls once; the objects
    and calls below it take the result as ``kernels``."""
    chosen = get_backend(backend or ("cuda" if device.type == "cuda" else "cpu"))
    chosen.check_device(device)
    return chosen


def resolve_kernels(device: torch.device, backend: str | None = None,
                    kernels: KernelBackend | None = None) -> KernelBackend:
    """``kernels`` when the caller's owner resolved them already (passed down as they are),
    else :func:`backend_for_device` of ``device`` and the user-facing ``backend`` string: for
    the objects and functions a user may also build or call on their own.

    Example::

        >>> cpu = backend_for_device(torch.device("cpu"))
        >>> resolve_kernels(torch.device("cpu"), kernels=cpu) is cpu
        True
        >>> resolve_kernels(torch.device("cpu"), "cpu", kernels=cpu).name
        'cpu'
    """
    if kernels is None:
        return backend_for_device(device, backend)
    if backend is not None and backend != kernels.name:
        raise ValueError(f"backend {backend!r} contradicts the {kernels.name!r} kernels given")
    return kernels
