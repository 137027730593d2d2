"""Pick the CPU or CUDA kernels for a tensor's device; the CPU backend.

Both backends implement :class:`~dynemb.backends.protocol.KernelBackend` over torch tensors:
:class:`CpuBackend` here (``@njit`` kernels on numpy views of CPU tensors) and
:class:`~dynemb.backends.cuda_backend.CudaBackend`. Everything above them launches kernels through
that protocol only. The CUDA backend also runs under numba's simulator
(``NUMBA_ENABLE_CUDASIM=1``), where it takes CPU tensors: that is how CI exercises the CUDA
kernels without a GPU.

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

from dynemb.backends.cuda_backend import CudaBackend
from dynemb.backends.protocol import (EMPTY_KEY, TOMBSTONE_KEY, KernelBackend,
                                   TableArrays, bit_views, claim_args, f32, probe_args,
                                   rehash_args)
from dynemb.kernels import (dedup_cpu, group_stores_cpu, groups_cpu, init_cpu, optim_cpu,
                            pool_cpu, round_cpu, rows_cpu, table_cpu)
from dynemb.kernels.cpu_compile import compile_once_per_machine
from dynemb.backends.threads import apply_defaults as apply_thread_defaults

# the ranks of a job (and the workers of a test run) share each kernel's compilation
compile_once_per_machine(dedup_cpu, group_stores_cpu, groups_cpu, init_cpu, optim_cpu, pool_cpu,
                         round_cpu, rows_cpu, table_cpu)

__all__ = ["CpuBackend", "CudaBackend", "backend_for_device", "get_backend", "resolve_kernels"]

_MIN_PARALLEL_KEYS = 16384
#: find_or_insert: smallest batch worth sorting by bucket.
_MIN_PARTITIONED_KEYS = 4096
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NO_LOOKUPS = np.empty(0, dtype=np.int64)  # add_claim_counts without lookups: 1 per key
_NO_ROWS = np.empty((0, 1), dtype=np.float32)  # gather_rows without fallback rows: zeros


class CpuBackend:
    """``@njit`` kernels on CPU tensors (viewed as numpy arrays without copying)."""

    name = "cpu"
    #: Slot failures raise at once (reading a count costs nothing on CPU).
    defers_failures = False
    #: The update kernel reads gradient rows through strided views.
    reads_strided_grads = True
    #: Rows and stores are both in host memory.
    moves_store_rows = True

    @staticmethod
    def _np(t: torch.Tensor):
        """A CPU tensor as the numpy array the kernels take (no copy)."""
        return t.numpy()

    @staticmethod
    def _dense(t: torch.Tensor):
        """An input tensor as a C-contiguous numpy array: a strided or broadcast one (a
        score expanded over the keys) is copied, so that each kernel compiles for one
        array layout (numba compiles a kernel once per layout it is called with)."""
        return np.ascontiguousarray(t.numpy())

    @staticmethod
    def _host(values):
        """Per-table values (numpy arrays or CPU tensors) as numpy arrays, without a copy."""
        return values.numpy() if isinstance(values, torch.Tensor) else np.asarray(values)

    def __init__(self):
        # the process's thread defaults (dynemb.backends.threads: idle OpenMP threads sleep,
        # numba's count): created once per process, before the first CPU kernel runs
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
        table_cpu.lookup_update_cpu(*probe_args(table, n), n(ukeys), self._dense(counts),
                                    self._dense(given), policy, clock, pin, n(out_slots),
                                    n(out_prev_scores))

    def insert_missing(self, table: TableArrays, ukeys, counts, given, policy, clock,
                       allow_evict, slots, out_prev_keys, out_prev_scores, out_failed):
        n = self._np
        table_cpu.insert_missing_cpu(*claim_args(table, n), n(ukeys), self._dense(counts),
                                     self._dense(given), policy, clock, allow_evict, n(slots),
                                     n(out_prev_keys), n(out_prev_scores), n(out_failed),
                                     numba.get_num_threads())

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
        table_cpu.find_or_insert_cpu(*claim_args(table, n), n(ukeys), self._dense(counts),
                                     self._dense(given), policy, clock, allow_evict, pin, parts,
                                     scratch,
                                     n(out_slots), n(out_inserted), n(out_prev_keys),
                                     n(out_prev_scores), n(out_failed), n(out_stats))

    def erase(self, table: TableArrays, keys, out_erased, out_pinned):
        n = self._np
        table_cpu.erase_cpu(*claim_args(table, n), n(keys), n(out_erased), n(out_pinned))

    def dedup(self, keys, num_buckets=None):
        """(unique keys, inverse, counts): in first-occurrence order, or with ``num_buckets``
        sorted by bucket of a table of that many buckets (ties in first-occurrence order),
        the order its ``find_or_insert`` claims them in."""
        unique, inverse, counts, u = self._dedup_into(keys, num_buckets)
        return unique[:u], inverse, counts[:u]

    def _dedup_into(self, keys, num_buckets):
        """:meth:`dedup` into arrays of the keys' length: (unique, inverse, counts, how many
        unique keys lead ``unique`` and ``counts``)."""
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
        return unique, inverse, counts, u

    def add_refcounts(self, table: TableArrays, slots, delta):
        table_cpu.add_refcounts_cpu(self._np(table.refcnt), self._np(slots), delta)

    def export(self, table: TableArrays, start, end) -> Tuple[torch.Tensor, ...]:
        n = end - start
        keys, slots, scores = (torch.empty(n, dtype=torch.int64) for _ in range(3))
        count = table_cpu.export_cpu(self._np(table.keys), self._np(table.scores), start, end,
                                     keys.numpy(), slots.numpy(), scores.numpy())
        return keys[:count], slots[:count], scores[:count]

    def rehash(self, old: TableArrays, new: TableArrays, remap) -> int:
        return int(table_cpu.rehash_cpu(*rehash_args(old, new, self._np), self._np(remap)))

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
                                   *f32(clip), chunks, kind, dim,
                                   *f32(lr, eps, beta1, beta2, weight_decay, bias1, bias2, acc0))

    def round_rows(self, src, out, keys, seed, table_id, step, fmt, stochastic):
        """float32 ``src`` [N, D] rounded into float16 / bfloat16 ``out`` [N, D]; see
        ``round_cpu.round_rows_cpu``."""
        round_cpu.round_rows_cpu(*bit_views(src, out, self._np), self._np(keys), seed,
                                 table_id, step, fmt, stochastic)

    def pool_bags(self, weights, occ_slots, offsets, scale, mean, batch, cols, dim, out):
        """A table's bags into their columns of ``out`` [B, C]; see
        ``pool_cpu.pool_bags_cpu``."""
        n = self._np
        pool_cpu.pool_bags_cpu(n(weights), n(occ_slots), n(offsets), n(scale), bool(mean),
                               int(batch), n(cols), int(dim), n(out))

    def gather_rows(self, weights, slots, index, dim, out, fallback=None, keep=False):
        n = self._np
        rows = _NO_ROWS if fallback is None else self._dense(fallback)
        pool_cpu.gather_rows_cpu(n(weights), n(slots), n(index), int(dim), rows, bool(keep),
                                 n(out))

    def dedup_segments(self, keys, segments, num_buckets=None):
        """Each table's unique keys in first-occurrence order, or with ``num_buckets`` sorted
        by bucket (see ``groups_cpu.dedup_segments_cpu``), at the start of its part of the
        output, padded with ``EMPTY_KEY`` (count 0) to its number of keys: the CUDA dedup's
        form (there sorted by key)."""
        n = keys.numel()
        if segments.count == 1 and n:  # a group of one: the table's own (parallel) dedup
            buckets = None if num_buckets is None else int(self._host(num_buckets)[0])
            unique, inverse, counts, u = self._dedup_into(keys, buckets or None)
            unique[u:] = EMPTY_KEY  # padded in place
            counts[u:] = 0
            return unique, inverse, counts, segments
        unique, inverse, counts = (torch.empty(n, dtype=torch.int64) for _ in range(3))
        unique_bounds = np.empty(segments.count + 1, dtype=np.int64)
        if num_buckets is None:
            num_buckets = np.zeros(segments.count, dtype=np.int64)
        groups_cpu.dedup_segments_cpu(keys.numpy(), segments.bounds, self._host(num_buckets),
                                      True, unique.numpy(), inverse.numpy(), counts.numpy(),
                                      unique_bounds)
        return unique, inverse, counts, segments

    def find_group(self, table: TableArrays, segments, row_offset, num_buckets, ukeys,
                   out_slots):
        h = self._host
        groups_cpu.find_group_cpu(self._np(table.keys), h(row_offset), h(num_buckets),
                                  table.bucket_size, self._np(ukeys), segments.bounds,
                                  self._np(out_slots))

    def find_or_insert_group(self, table: TableArrays, sizes, segments, row_offset,
                             num_buckets, ukeys, counts, given, policy, clocks, allow_evict,
                             out_slots, out_inserted, out_prev_keys, out_prev_scores,
                             out_failed, out_stats=None):
        """One call, threads split the tables (``groups_cpu.find_or_insert_group_cpu``); a
        group of one claims as its table alone, threads splitting its buckets."""
        n, h = self._np, self._host
        if out_stats is None:
            out_stats = np.empty((segments.count, 3), dtype=np.int64)
        if (segments.count == 1 and int(h(row_offset)[0]) == 0
                and int(h(num_buckets)[0]) == table.num_buckets and sizes is table.size):
            before = int(sizes[0])
            failed_evicted = torch.empty(2, dtype=torch.int64)
            self.find_or_insert(table, ukeys, counts, given, policy, int(h(clocks)[0]),
                                allow_evict, True, out_slots, out_inserted, out_prev_keys,
                                out_prev_scores, out_failed, failed_evicted)
            failed, evicted = failed_evicted.tolist()
            h(out_stats)[0] = (int(sizes[0]) - before, evicted, failed)
            return
        groups_cpu.find_or_insert_group_cpu(
            n(table.keys), n(table.scores), n(table.refcnt), n(sizes), h(row_offset),
            h(num_buckets), table.bucket_size, n(ukeys), segments.bounds, self._dense(counts),
            self._dense(given),
            policy, h(clocks), allow_evict, True, n(out_slots), n(out_inserted),
            n(out_prev_keys), n(out_prev_scores), n(out_failed), h(out_stats))

    def route_keys_group(self, segments, ukeys, first_rows, total_rows, out_first, out_second):
        n = self._np
        groups_cpu.route_keys_group_cpu(segments.bounds, n(ukeys), n(first_rows), n(total_rows),
                                        n(out_first), n(out_second))

    def claim_counts_group(self, segments, slots, inserted, previous_keys, out):
        groups_cpu.claim_counts_group_cpu(segments.bounds, self._np(slots), self._np(inserted),
                                          self._np(previous_keys), self._host(out))

    def add_claim_counts(self, segments, ukeys, slots, inserted, previous_keys, lookups, out):
        n = self._np
        given = _NO_LOOKUPS if lookups is None else n(lookups)
        groups_cpu.add_claim_counts_cpu(segments.bounds, n(ukeys), n(slots), n(inserted),
                                        n(previous_keys), given, n(out))

    def init_rows_at_group(self, weights, slots, keys, mask, segments, dim, seeds, table_ids,
                           kinds, p0, p1, low, high):
        n, h = self._np, self._host
        if segments.count == 1:  # a group of one: the table's own kernel
            self.init_rows_at(weights, slots, keys, mask, dim, int(h(seeds)[0]),
                              int(h(table_ids)[0]), int(h(kinds)[0]), *(float(h(p)[0])
                                                                       for p in (p0, p1, low, high)))
            return
        groups_cpu.init_rows_at_group_cpu(n(weights), n(slots), n(keys), n(mask),
                                          segments.bounds, dim, h(seeds), h(table_ids),
                                          h(kinds), h(p0), h(p1), h(low), h(high))

    def store_find_group(self, store_keys, store_rows, store_buckets, bucket_sizes, movable,
                         ukeys, segments, want, out_rows, out_found):
        """``group_stores_cpu.store_find_group_cpu`` (the stores as numba typed lists)."""
        n = self._np
        group_stores_cpu.store_find_group_cpu(store_keys, store_rows, store_buckets,
                                              bucket_sizes, movable, n(ukeys), segments.bounds,
                                              n(want), n(out_rows), n(out_found))

    def store_moves_group(self, weights, wb_keys, wb_scores, wb_rows, write_backs, ld_keys,
                          ld_rows, loads, store_keys, store_scores, store_refcnt, store_size,
                          store_rows, store_buckets, bucket_sizes, max_capacities, grow_at,
                          clocks, out_slots, out_inserted, out_prev_keys, out_prev_scores,
                          out_failed, out_found, out_scores, out_stats):
        """``group_stores_cpu.store_moves_group_cpu`` (the stores as numba typed lists; the
        thread count passed in, so that the kernel stays cacheable)."""
        n = self._np
        group_stores_cpu.store_moves_group_cpu(
            n(weights), n(wb_keys), n(wb_scores), n(wb_rows), write_backs.bounds, n(ld_keys),
            n(ld_rows), loads.bounds, store_keys, store_scores, store_refcnt, store_size,
            store_rows, store_buckets, bucket_sizes, max_capacities, grow_at, clocks,
            n(out_slots), n(out_inserted), n(out_prev_keys), n(out_prev_scores),
            n(out_failed), n(out_found), n(out_scores), out_stats, numba.get_num_threads())

    def occurrence_csr(self, inverse, num_rows):
        """A counting sort (``optim_cpu.occurrence_csr_cpu``)."""
        inverse = inverse.to(torch.int64).contiguous()
        offsets = torch.empty(num_rows + 1, dtype=torch.int64)
        order = torch.empty_like(inverse)
        optim_cpu.occurrence_csr_cpu(inverse.numpy(), num_rows, offsets.numpy(), order.numpy())
        return offsets, order

    def copy_rows(self, src, src_slots, dst, dst_slots):
        """Each row copied once, as raw bits (``rows_cpu.copy_rows_cpu``)."""
        rows_cpu.copy_rows_cpu(_bits(src), src_slots.contiguous().numpy(), _bits(dst),
                               dst_slots.contiguous().numpy())

    def remap_rows(self, old, remap, new_capacity):
        """Each new row written once (``rows_cpu.remap_rows_cpu``)."""
        new = torch.empty(new_capacity, old.shape[1], dtype=old.dtype)
        rows_cpu.remap_rows_cpu(_bits(old), remap.contiguous().numpy(), _bits(new))
        return new

    def has_reserved_keys(self, keys):
        """One pass over contiguous keys (``table_cpu.count_reserved_cpu``) instead of four
        torch ops."""
        if not keys.is_contiguous():
            return bool(((keys == EMPTY_KEY) | (keys == TOMBSTONE_KEY)).any())
        return table_cpu.count_reserved_cpu(keys.numpy()) > 0


def _bits(rows: torch.Tensor):
    """The rows' bytes as a numpy array of same-size integers (no copy; bfloat16 included)."""
    return rows.view(_BITS[rows.element_size()]).numpy()


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
