"""The backends' table-group kernels (:mod:`dynemb.tables.groups`), launched on torch
tensors: segment ``t`` of a group's keys is table ``t``'s, and table ``t`` owns its own rows
of the group's arrays (``kernels/groups_cpu.py``, ``kernels/groups_cuda.py``). Mixed into
:class:`~dynemb.backends.numba_backends.CpuBackend` and :class:`~dynemb.backends.numba_backends.CudaBackend`."""
from __future__ import annotations

import numpy as np
import torch

from dynemb.backends.protocol import TableArrays
from dynemb.kernels import group_stores_cpu, groups_cpu


class CpuGroupKernels:
    """The group kernels of the ``@njit`` backend."""

    #: Has the table-group kernels.
    runs_groups = True

    @staticmethod
    def _np(t: torch.Tensor):
        """A CPU tensor as the numpy array the kernels take (no copy)."""
        return t.numpy()

    def dedup_segments(self, keys, bounds, num_buckets=None):
        """(unique keys, inverse, counts, unique bounds [T + 1] as numpy) of each segment
        ``keys[bounds[t]:bounds[t + 1]]``, segment after segment; the inverse indexes the
        whole unique array. Each segment's unique keys in first-occurrence order, or with
        ``num_buckets`` (per segment, numpy) sorted by bucket of a table of that many
        buckets, ties in first-occurrence order."""
        n = keys.numel()
        unique, inverse, counts = (torch.empty(n, dtype=torch.int64) for _ in range(3))
        unique_bounds = np.empty(len(bounds), dtype=np.int64)
        if num_buckets is None:
            num_buckets = np.zeros(len(bounds) - 1, dtype=np.int64)
        u = groups_cpu.dedup_segments_cpu(keys.numpy(), np.asarray(bounds, dtype=np.int64),
                                          num_buckets, unique.numpy(), inverse.numpy(),
                                          counts.numpy(), unique_bounds)
        return unique[:u], inverse, counts[:u], unique_bounds

    def find_or_insert_group(self, table: TableArrays, sizes, row_offset, num_buckets, ukeys,
                             unique_bounds, counts, given, policy, clocks, allow_evict, pin,
                             out_slots, out_inserted, out_prev_keys, out_prev_scores,
                             out_failed, out_stats):
        """``groups_cpu.find_or_insert_group_cpu`` on a group's arrays; ``sizes``,
        ``row_offset``, ``num_buckets``, ``clocks`` and ``out_stats`` are numpy arrays."""
        n = self._np
        groups_cpu.find_or_insert_group_cpu(
            n(table.keys), n(table.scores), n(table.refcnt), n(sizes), row_offset, num_buckets,
            table.bucket_size, n(ukeys), unique_bounds, n(counts), n(given), policy, clocks,
            allow_evict, pin, n(out_slots), n(out_inserted), n(out_prev_keys),
            n(out_prev_scores), n(out_failed), out_stats)

    def find_group(self, table: TableArrays, row_offset, num_buckets, ukeys, unique_bounds,
                   out_slots):
        """``groups_cpu.find_group_cpu``: each table's part of ``ukeys`` found in its own rows
        (group slots, -1 where absent); ``row_offset``, ``num_buckets`` and
        ``unique_bounds`` are numpy arrays."""
        groups_cpu.find_group_cpu(self._np(table.keys), row_offset, num_buckets,
                                  table.bucket_size, self._np(ukeys), unique_bounds,
                                  self._np(out_slots))

    def store_find_group(self, store_keys, store_rows, store_buckets, bucket_sizes, movable,
                         ukeys, unique_bounds, want, out_rows, out_found):
        """``group_stores_cpu.store_find_group_cpu``: the wanted keys found in their tables'
        stores (typed lists of arrays; rows as raw bits)."""
        n = self._np
        group_stores_cpu.store_find_group_cpu(store_keys, store_rows, store_buckets,
                                              bucket_sizes, movable, n(ukeys), unique_bounds,
                                              n(want), n(out_rows), n(out_found))

    def claim_counts_group(self, unique_bounds, slots, inserted, previous_keys, out):
        """Per table: (hits, inserts, evictions) of a group claim into numpy ``out`` [T, 3]."""
        groups_cpu.claim_counts_group_cpu(unique_bounds, self._np(slots), self._np(inserted),
                                          self._np(previous_keys), out)

    def init_rows_at_group(self, weights, slots, keys, mask, unique_bounds, dim, seeds,
                           table_ids, kinds, p0, p1, low, high):
        """``init_rows_at`` with each table's initializer, seed and id (numpy arrays)."""
        n = self._np
        groups_cpu.init_rows_at_group_cpu(n(weights), n(slots), n(keys), n(mask),
                                          unique_bounds, dim, seeds, table_ids, kinds, p0, p1,
                                          low, high)

    def store_moves_group(self, weights, wb_keys, wb_scores, wb_rows, wb_seg, ld_keys, ld_rows,
                          ld_seg, store_keys, store_scores, store_refcnt, store_size,
                          store_rows, store_buckets, bucket_sizes, max_capacities, grow_at,
                          clocks, out_slots, out_inserted, out_prev_keys, out_prev_scores,
                          out_failed, out_found, out_scores, out_stats):
        """``group_stores_cpu.store_moves_group_cpu`` (torch tensors in; the store arrays as
        typed lists of numpy arrays, the per-table values numpy)."""
        n = self._np
        group_stores_cpu.store_moves_group_cpu(
            n(weights), n(wb_keys), n(wb_scores), n(wb_rows), wb_seg, n(ld_keys), n(ld_rows),
            ld_seg, store_keys, store_scores, store_refcnt, store_size, store_rows,
            store_buckets, bucket_sizes, max_capacities, grow_at, clocks, n(out_slots),
            n(out_inserted), n(out_prev_keys), n(out_prev_scores), n(out_failed),
            n(out_found), n(out_scores), out_stats)


class CudaGroupKernels:
    """The group kernels of the CUDA backend: every argument a device tensor, nothing read
    back (``seg[i]``: the table of key ``i``; per-table values as device tensors). Needs the
    backend's ``_launch``, ``_arr`` and ``_groups`` (``kernels/groups_cuda.py``)."""

    #: Has the table-group kernels.
    runs_groups = True

    def find_or_insert_group(self, table: TableArrays, sizes, seg, row_offset, num_buckets,
                             ukeys, counts, given, policy, clocks, allow_evict, out_slots,
                             out_inserted, out_prev_keys, out_prev_scores, out_failed):
        """Look up and pin every table's keys, then claim slots for the missing ones, as
        ``find_or_insert`` with ``pin`` does for one table (two launches: every hit holds its
        pin before any key picks a victim)."""
        groups_cuda, a, n = self._groups, self._arr, ukeys.numel()
        where = (a(seg), a(row_offset), a(num_buckets), table.bucket_size)
        self._launch(groups_cuda.lookup_update_group_kernel, n, a(table.keys),
                     a(table.scores), a(table.refcnt), *where, a(ukeys), a(counts), a(given),
                     policy, a(clocks), True, a(out_slots), a(out_prev_scores))
        hit = out_slots >= 0
        self._launch(groups_cuda.insert_missing_group_kernel, n, a(table.keys),
                     a(table.scores), a(table.refcnt), a(sizes), *where, a(ukeys), a(counts),
                     a(given), policy, a(clocks), allow_evict, a(out_slots), a(out_prev_keys),
                     a(out_prev_scores), a(out_failed))
        torch.logical_and(out_slots >= 0, ~hit, out=out_inserted)

    def find_group_device(self, table: TableArrays, seg, row_offset, num_buckets, ukeys,
                          out_slots):
        """Each key found in its table's rows (group slots, -1 where absent)."""
        a = self._arr
        self._launch(self._groups.find_group_kernel, ukeys.numel(), a(table.keys), a(seg),
                     a(row_offset), a(num_buckets), table.bucket_size, a(ukeys), a(out_slots))

    def init_rows_at_group_device(self, weights, slots, keys, mask, seg, dim, seeds, table_ids,
                                  kinds, p0, p1, low, high):
        """``init_rows_at`` with key ``i`` starting from table ``seg[i]``'s initializer
        (per-table values as device tensors)."""
        a = self._arr
        self._launch(self._groups.init_rows_at_group_kernel, slots.numel() * weights.shape[1],
                     a(weights), a(slots), a(keys), a(mask), a(seg), dim, a(seeds),
                     a(table_ids), a(kinds), a(p0), a(p1), a(low), a(high))
