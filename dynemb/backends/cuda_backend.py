"""The CUDA backend: numba-cuda kernels launched on torch tensors (see
:mod:`dynemb.backends.numba_backends`, which picks a backend per device).

The kernels (``dynemb.kernels.*_cuda``) load at the first :class:`CudaBackend`, so importing
this module does not import ``numba.cuda``. Under numba's simulator
(``NUMBA_ENABLE_CUDASIM=1``) the same kernels run on CPU tensors.
"""
from __future__ import annotations

import torch

from dynemb.bridges.numba_launch import KernelLauncher
from dynemb.backends.protocol import (EMPTY_KEY, TIER_MULTIPLIER, TOMBSTONE_KEY, TableArrays,
                                      bit_views, claim_args, f32, probe_args, rehash_args)
from dynemb.kernels.constants import cuda_simulator_enabled

_THREADS_PER_BLOCK = 256
_SIMULATED_THREADS_PER_BLOCK = 32


class CudaBackend:
    """numba-cuda kernels on CUDA tensors, launched on torch's current stream.

    Under the simulator the same kernels take CPU tensors.
    """

    name = "cuda"
    #: Slot failures are counted on the device and reported at a later call (reading them
    #: would stall the host).
    defers_failures = True
    #: The update kernel takes contiguous gradient rows.
    reads_strided_grads = False
    #: The rows are in device memory, the stores in host memory.
    moves_store_rows = False

    def __init__(self):
        from numba import cuda

        from dynemb.kernels import (dedup_cuda, groups_cuda, init_cuda, optim_cuda, pool_cuda,
                                    round_cuda, table_cuda)

        self._cuda = cuda
        self._table = table_cuda
        self._groups = groups_cuda
        self._dedup = dedup_cuda
        self._pool = pool_cuda
        self._init = init_cuda
        self._optim = optim_cuda
        self._round = round_cuda
        self._simulated = cuda_simulator_enabled()
        self._launcher = None  # made at the first launch on a GPU
        self._empty: dict = {}  # an empty int64 tensor per device (an absent optional array)
        # add_claim_counts_kernel sums a block in a shared array of COUNT_BLOCK threads
        assert groups_cuda.COUNT_BLOCK >= _THREADS_PER_BLOCK >= _SIMULATED_THREADS_PER_BLOCK

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

    def numba_launch_refusals(self) -> dict:
        """Kernels with a signature that keeps numba's launch, and why (for the GPU checks)."""
        return {} if self._launcher is None else self._launcher.refusals

    def _empty_int64(self, device: torch.device) -> torch.Tensor:
        """An empty int64 tensor on ``device``: an optional array the kernel is not given."""
        if device not in self._empty:
            self._empty[device] = torch.empty(0, dtype=torch.int64, device=device)
        return self._empty[device]

    def _no_rows(self, device: torch.device) -> torch.Tensor:
        """An empty [0, 1] float32 tensor on ``device``: ``gather_rows`` without fallback rows."""
        key = ("rows", device)
        if key not in self._empty:
            self._empty[key] = torch.empty(0, 1, dtype=torch.float32, device=device)
        return self._empty[key]

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
        self._launch(self._table.lookup_update_kernel, ukeys.numel(), *probe_args(table, a),
                     a(ukeys), a(counts), a(given), policy, clock, pin, a(out_slots),
                     a(out_prev_scores))

    def insert_missing(self, table: TableArrays, ukeys, counts, given, policy, clock,
                       allow_evict, slots, out_prev_keys, out_prev_scores, out_failed):
        a = self._arr
        self._launch(self._table.insert_missing_kernel, ukeys.numel(), *claim_args(table, a),
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
        self._launch(self._table.erase_kernel, keys.numel(), *claim_args(table, a), a(keys),
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
        self._launch(self._table.rehash_kernel, old.capacity, *rehash_args(old, new, a),
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
                     a(weights), a(slots), a(src), a(offsets), a(order), a(scale), *f32(clip),
                     *map(a, pieces), kind, dim,
                     *f32(lr, eps, beta1, beta2, weight_decay, bias1, bias2, acc0))

    def _hot_row_pieces(self, src, offsets, order, scale, clip, dim):
        """``(piece_end, piece_count, pieces)`` of ``fused_update_kernel``: the layout of
        :meth:`_hot_row_layout`, ``pieces`` [P, dim] filled by ``piece_sums_kernel``."""
        piece_row, piece_end, piece_count = self._hot_row_layout(offsets, order.numel(),
                                                                 self._optim.PIECE)
        pieces = torch.empty(piece_row.numel(), dim, dtype=torch.float32, device=src.device)
        a = self._arr
        self._launch(self._optim.piece_sums_kernel, piece_row.numel() * self._optim.WARP,
                     a(src), a(offsets), a(order), a(scale), *f32(clip), a(piece_row),
                     a(piece_end), a(piece_count), a(pieces), dim)
        return piece_end, piece_count, pieces

    def _hot_row_layout(self, offsets: torch.Tensor, occurrences: int, piece: int):
        """How the fused update cuts rows of more than ``piece`` occurrences (the CSR
        ``offsets`` [R + 1] of ``occurrences`` ids) into pieces of ``piece``, each summed by
        its own warp. Returns ``(piece_row [P], piece_end [R], piece_count [R])`` int64: per
        row, its number of pieces (0 for a row of at most ``piece``) and where they end in
        the pieces' buffer; per piece, its row (``>= R`` for the padding). ``P`` is the bound
        ``2 N / piece + 1`` (a row of ``c > piece`` occurrences has ``ceil(c / piece) <
        2 c / piece`` pieces), so nothing is read back. With no row able to pass ``piece``,
        no piece."""
        rows, device = offsets.numel() - 1, offsets.device
        if occurrences <= piece:
            none = torch.zeros(rows, dtype=torch.int64, device=device)
            return self._empty_int64(device), none, none
        a, optim = self._arr, self._optim
        piece_count = torch.empty(rows, dtype=torch.int64, device=device)
        self._launch(optim.piece_counts_kernel, rows, a(offsets), int(piece), a(piece_count))
        piece_end = torch.cumsum(piece_count, 0)
        piece_row = torch.full((2 * occurrences // piece + 1,), rows, dtype=torch.int64,
                               device=device)
        self._launch(optim.piece_rows_kernel, rows, a(piece_end), a(piece_count), a(piece_row))
        return piece_row, piece_end, piece_count

    def round_rows(self, src, out, keys, seed, table_id, step, fmt, stochastic):
        """float32 ``src`` [N, D] rounded into float16 / bfloat16 ``out`` [N, D]; one thread
        per element."""
        self._launch(self._round.round_rows_kernel, src.numel(), *bit_views(src, out, self._arr),
                     self._arr(keys), seed, table_id, step, fmt, stochastic)

    def pool_bags(self, weights, occ_slots, offsets, scale, mean, batch, cols, dim, out):
        """A table's bags into their columns of ``out`` [B, C]; one warp per bag."""
        a = self._arr
        self._launch(self._pool.pool_bags_kernel, (offsets.numel() - 1) * self._pool.WARP,
                     a(weights), a(occ_slots), a(offsets), a(scale), bool(mean), int(batch),
                     a(cols), int(dim), a(out))

    def gather_rows(self, weights, slots, index, dim, out, fallback=None, keep=False):
        """One thread per output cell (``pool_cuda.gather_rows_kernel``)."""
        a = self._arr
        if fallback is None:
            fallback = self._no_rows(out.device)
        self._launch(self._pool.gather_rows_kernel, index.numel() * int(dim), a(weights),
                     a(slots), a(index), int(dim), a(fallback.contiguous()), bool(keep),
                     a(out))

    def dedup_segments(self, keys, segments, num_buckets=None):
        """Each table's sorted unique keys at the start of its part of the output, padded
        with ``EMPTY_KEY`` (count 0) to its number of keys; ``num_buckets`` is not used.
        Sorted by key, then by table (one sort for one table), then two launches
        (``dedup_cuda``); no host sync."""
        n = keys.numel()
        unique = torch.full_like(keys, EMPTY_KEY)
        inverse = torch.empty_like(keys)
        counts = torch.zeros_like(keys)
        if n == 0:
            return unique, inverse, counts, segments
        if segments.count == 1:  # one table: one sort, no segment of each key
            sorted_keys, order = torch.sort(keys)
            sorted_seg = bounds = self._empty_int64(keys.device)
        else:  # by key, then by segment (stable: each segment's keys stay sorted)
            by_key, order = torch.sort(keys, stable=True)
            sorted_seg, by_seg = torch.sort(segments.table_of[order], stable=True)
            order, sorted_keys = order[by_seg], by_key[by_seg]
            bounds = segments.on_device
        a, dedup = self._arr, self._dedup
        starts = torch.empty_like(keys)
        self._launch(dedup.run_starts_kernel, n, a(sorted_keys), a(sorted_seg), a(starts))
        run_end = torch.cumsum(starts, 0)
        self._launch(dedup.place_runs_kernel, n, a(sorted_keys), a(sorted_seg), a(order),
                     a(run_end), a(bounds), a(unique), a(inverse), a(counts))
        return unique, inverse, counts, segments

    def find_group(self, table: TableArrays, segments, row_offset, num_buckets, ukeys,
                   out_slots):
        a = self._arr
        self._launch(self._groups.find_group_kernel, ukeys.numel(), a(table.keys),
                     a(segments.table_of), a(row_offset), a(num_buckets), table.bucket_size,
                     a(ukeys), a(out_slots))

    def find_or_insert_group(self, table: TableArrays, sizes, segments, row_offset,
                             num_buckets, ukeys, counts, given, policy, clocks, allow_evict,
                             out_slots, out_inserted, out_prev_keys, out_prev_scores,
                             out_failed, out_stats=None):
        """Look up and pin every table's keys, then claim slots for the missing ones, as
        ``find_or_insert`` with ``pin`` does for one table (two launches: every hit holds its
        pin before any key picks a victim); ``out_stats`` summed per table on the device."""
        groups_cuda, a, n = self._groups, self._arr, ukeys.numel()
        where = (a(segments.table_of), a(row_offset), a(num_buckets), table.bucket_size)
        self._launch(groups_cuda.lookup_update_group_kernel, n, a(table.keys),
                     a(table.scores), a(table.refcnt), *where, a(ukeys), a(counts), a(given),
                     policy, a(clocks), True, a(out_slots), a(out_prev_scores))
        self._launch(groups_cuda.insert_missing_group_kernel, n, a(table.keys),
                     a(table.scores), a(table.refcnt), a(sizes), *where, a(ukeys), a(counts),
                     a(given), policy, a(clocks), allow_evict, a(out_slots), a(out_prev_keys),
                     a(out_prev_scores), a(out_failed), a(out_inserted))
        if out_stats is not None:
            live = (out_prev_keys != EMPTY_KEY) & (out_prev_keys != TOMBSTONE_KEY)
            columns = torch.stack([out_inserted & ~live, out_inserted & live, out_failed], 1)
            out_stats.zero_().index_add_(0, segments.table_of, columns.to(torch.int64))

    def route_keys_group(self, segments, ukeys, first_rows, total_rows, out_first, out_second):
        """Element-wise torch ops on the device (no read back): ``hashing.routes_to_first``."""
        mixed = ukeys * TIER_MULTIPLIER
        mixed = (mixed ^ (mixed >> 31)) & 0x7FFFFFFFFFFFFFFF
        table = segments.table_of
        first = mixed % total_rows[table] < first_rows[table]
        valid = ukeys != EMPTY_KEY
        out_first.copy_(torch.where(valid & first, ukeys, EMPTY_KEY))
        out_second.copy_(torch.where(valid & ~first, ukeys, EMPTY_KEY))

    def claim_counts_group(self, segments, slots, inserted, previous_keys, out):
        """Summed per table on the device (one ``index_add_``)."""
        live = (previous_keys != EMPTY_KEY) & (previous_keys != TOMBSTONE_KEY)
        columns = torch.stack([(slots >= 0) & ~inserted, inserted, inserted & live], 1)
        out.zero_().index_add_(0, segments.table_of, columns.to(torch.int64))

    def add_claim_counts(self, segments, ukeys, slots, inserted, previous_keys, lookups, out):
        """One thread per key, summed per block in shared memory
        (``groups_cuda.add_claim_counts_kernel``)."""
        a = self._arr
        if lookups is None:  # 1 each
            lookups = self._empty_int64(ukeys.device)
        self._launch(self._groups.add_claim_counts_kernel, ukeys.numel(), a(segments.table_of),
                     a(ukeys), a(slots), a(inserted), a(previous_keys), a(lookups), a(out))

    def init_rows_at_group(self, weights, slots, keys, mask, segments, dim, seeds, table_ids,
                           kinds, p0, p1, low, high):
        """One thread per element of the rows; key ``i`` from table ``table_of[i]``'s
        initializer."""
        a = self._arr
        self._launch(self._groups.init_rows_at_group_kernel, slots.numel() * weights.shape[1],
                     a(weights), a(slots), a(keys), a(mask), a(segments.table_of), dim,
                     a(seeds), a(table_ids), a(kinds), a(p0), a(p1), a(low), a(high))

    def store_find_group(self, store_keys, store_rows, store_buckets, bucket_sizes, movable,
                         ukeys, segments, want, out_rows, out_found):
        """Not on the CUDA kernels: a CACHE group on them runs each table's store by its
        own calls (the stores are in host memory)."""
        raise NotImplementedError(_NO_GROUP_STORES)

    def store_moves_group(self, weights, wb_keys, wb_scores, wb_rows, write_backs, ld_keys,
                          ld_rows, loads, store_keys, store_scores, store_refcnt, store_size,
                          store_rows, store_buckets, bucket_sizes, max_capacities, grow_at,
                          clocks, out_slots, out_inserted, out_prev_keys, out_prev_scores,
                          out_failed, out_found, out_scores, out_stats):
        """Not on the CUDA kernels: a CACHE group on them runs each table's store by its
        own calls (the stores are in host memory)."""
        raise NotImplementedError(_NO_GROUP_STORES)

    def occurrence_csr(self, inverse, num_rows):
        """A stable sort; each row's offset where the sorted rows reach it (no host
        sync)."""
        inverse = inverse.to(torch.int64).contiguous()
        sorted_rows, order = torch.sort(inverse, stable=True)
        rows = torch.arange(num_rows + 1, dtype=torch.int64, device=inverse.device)
        return torch.searchsorted(sorted_rows, rows), order

    def copy_rows(self, src, src_slots, dst, dst_slots):
        """torch indexing."""
        both = (src_slots >= 0) & (dst_slots >= 0)
        dst.index_copy_(0, dst_slots[both], src.index_select(0, src_slots[both]))

    def remap_rows(self, old, remap, new_capacity):
        """torch indexing."""
        new = torch.zeros(new_capacity, old.shape[1], dtype=old.dtype, device=old.device)
        live = remap >= 0
        new[remap[live]] = old[live]
        return new

    def has_reserved_keys(self, keys):
        return bool(((keys == EMPTY_KEY) | (keys == TOMBSTONE_KEY)).any())


_NO_GROUP_STORES = ("the CUDA kernels have no group store kernels: a CACHE group on them runs "
                    "each table's store by its own calls (moves_in_group is False on CUDA)")
