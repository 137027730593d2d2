"""The host stores of a CACHE table group, filled in one kernel call per claim.

After a group's claim (:mod:`dynemb.tables.groups`), each CACHE table writes the rows it
evicted back to its backing store and loads the keys it inserted from there
(:class:`~dynemb.tables.cache.CacheTable`). Alone, that is a dozen small calls per table per
step. Here the tables whose store is a plain :class:`~dynemb.stores.backing_store.HostBackingStore`
behind a cache on the CPU kernels run in one call (``kernels/group_stores_cpu.py``), each
exactly as alone: same store slots, scores, clocks, evictions, counters and rows. The host
runs a table alone when the kernel cannot: its store must grow first, it is a user's store,
or the cache is on the CUDA kernels (its rows on the device, its store in host memory).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import torch
from numba.typed import List as TypedList

from dynemb.stores.backing_store import HostBackingStore
from dynemb.foundations.counters import COUNTER_NAMES
from dynemb.rows.hash_table_images import restore_scores_at
from dynemb.tables.group_storage import GroupStorage, per_table_sums
from dynemb.backends.protocol import STORE_STAT_LEFT, STORE_STATS, Segments, TableArrays
from dynemb.types import EMPTY_KEY, TOMBSTONE_KEY

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_COUNTER = {name: i for i, name in enumerate(COUNTER_NAMES)}


def moves_in_group(table) -> bool:
    """Whether the group kernel can move ``table``'s rows: its store is a
    :class:`HostBackingStore` (no method changed by a subclass) of the table's row dtype,
    behind a cache on kernels that read host memory (``moves_store_rows``)."""
    store = getattr(table, "store", None)
    return (type(store) is HostBackingStore and table.kernels.moves_store_rows
            and store.row_table.weights.dtype == table.tier.flat.weights.dtype)


class GroupStores:
    """The stores of the tables of a group's ``storage`` (see the module docstring).

    The kernel reads each store's arrays through typed lists, rebuilt when a store's arrays
    were replaced (it grew) since the last call."""

    def __init__(self, storage: GroupStorage):
        self.storage = storage
        self._movable = np.asarray([moves_in_group(t) for t in storage.tables], dtype=np.bool_)
        self._sources: Optional[List[tuple]] = None
        self._lists = None
        self._empty = None

    def __getstate__(self) -> dict:
        """Without the kernel's typed lists (numba objects that do not pickle): they are
        derived from the stores and rebuilt at the next call."""
        state = self.__dict__.copy()
        state.update(_sources=None, _lists=None, _empty=None)
        return state

    def _store_arrays(self):
        """Typed lists of every store's (keys, scores, pins, size, rows as bits), plus
        (buckets, bucket size, max capacity, grow-at load factor) per store as numpy."""
        sources = [(t.store.hash_table.arrays, t.store.row_table.weights) if movable else None
                   for t, movable in zip(self.storage.tables, self._movable)]
        if self._sources is not None and all(map(_same_source, sources, self._sources)):
            return self._lists
        lists = [TypedList() for _ in range(5)]
        shape = np.zeros((len(sources), 4), dtype=np.float64)
        bits = _BITS[self.storage.weights.element_size()]
        for t, source in enumerate(sources):
            if source is None:
                source = self._placeholder()
            else:
                store = self.storage.tables[t].store.hash_table
                shape[t] = (store.num_buckets, store.bucket_size,
                            -1 if store.max_capacity is None else store.max_capacity,
                            store.grow_at_load_factor)
            arrays, weights = source
            for out, array in zip(lists, (arrays.keys, arrays.scores, arrays.refcnt,
                                          arrays.size, weights.view(bits))):
                out.append(array.numpy())
        ints = np.ascontiguousarray(shape[:, :3].T, dtype=np.int64)  # one layout: one compile
        self._sources = sources
        self._lists = (*lists, ints[0], ints[1], ints[2], shape[:, 3].copy())
        return self._lists

    def _placeholder(self):
        """Empty arrays of the right types for a table the kernel skips."""
        if self._empty is None:
            self._empty = (TableArrays.empty(0, 1, torch.device("cpu")),
                           torch.empty(0, self.storage.weights.shape[1],
                                       dtype=self.storage.weights.dtype))
        return self._empty

    def fill(self, claim, segments: Segments, undo, initialize) -> None:
        """Write back and load the rows of ``claim`` (the group's, as
        :class:`~dynemb.tables.groups.Claim` holds it; ``segments``: its tables'
        entries) for the tables that inserted a key: in one kernel call where it can (keys
        not in the store: ``initialize(slots, keys, mask, segments)``), the rest each
        alone. If a table alone fails (its store raised), ``undo(tables)`` is
        called with it and the tables after it, whose rows were not filled, and the error
        goes on."""
        inserting = [t for t, n in enumerate(per_table_sums(claim.inserted, segments).tolist())
                     if n]  # one read of the device
        storage = self.storage
        keys, slots, inserted, prev_keys, prev_scores, unique_bounds = claim
        run = np.zeros(len(storage.tables), dtype=np.bool_)
        run[list(inserting)] = True
        run &= self._movable
        alone = [t for t in inserting if not run[t]]
        if run.any():
            alone += self._fill_in_kernel(claim, segments, run, initialize)
        alone = sorted(alone)
        for i, t in enumerate(alone):
            result = storage.table_claim(claim, t)
            try:
                storage.tables[t].fill_claimed_rows(result.keys, result)
            except BaseException:
                undo(alone[i:])
                raise

    def _fill_in_kernel(self, claim, segments: Segments, run: np.ndarray,
                        initialize) -> List[int]:
        """The kernel's share; returns the tables it left to the host."""
        storage = self.storage
        keys, slots, inserted, prev_keys, prev_scores, unique_bounds = claim
        bounds = np.asarray(unique_bounds, dtype=np.int64)
        evicted = inserted & (prev_keys != EMPTY_KEY) & (prev_keys != TOMBSTONE_KEY)
        wb_at = self._entries_of(evicted, bounds, run)
        ld_at = self._entries_of(inserted, bounds, run)
        wb_seg = np.searchsorted(wb_at.numpy(), bounds)
        ld_seg = np.searchsorted(ld_at.numpy(), bounds)
        wb_keys, wb_scores = prev_keys[wb_at], prev_scores[wb_at]
        ld_keys, ld_slots = keys[ld_at], slots[ld_at]
        writing = np.flatnonzero(np.diff(wb_seg) > 0)
        stores = [storage.tables[t].store.hash_table for t in writing.tolist()]
        clocks = np.zeros(len(storage.tables), dtype=np.int64)
        clocks[writing] = [s.clock + 1 for s in stores]
        n, m = wb_keys.numel(), ld_keys.numel()
        scratch = [torch.empty(n, dtype=torch.int64) for _ in range(3)]
        flags = [torch.empty(n, dtype=torch.bool) for _ in range(2)]
        found, scores = torch.empty(m, dtype=torch.bool), torch.empty(m, dtype=torch.int64)
        stats = np.zeros((len(storage.tables), STORE_STATS), dtype=np.int64)
        bits = _BITS[storage.weights.element_size()]
        storage.kernels.store_moves_group(
            storage.weights.view(bits), wb_keys, wb_scores, slots[wb_at], Segments(wb_seg),
            ld_keys, ld_slots, Segments(ld_seg), *self._store_arrays(), clocks, scratch[0],
            flags[0], scratch[1], scratch[2], flags[1], found, scores, stats)
        left = stats[:, STORE_STAT_LEFT].astype(bool) & run
        for t, store in zip(writing.tolist(), stores):
            if not left[t]:
                store.tick()
        if left.any():  # their loads were not made: the host makes them, with the rest
            found &= torch.from_numpy(~np.repeat(left, np.diff(ld_seg)))
        restore_scores_at(storage.arrays.scores, storage.policy, ld_slots[found], scores[found])
        counts = torch.from_numpy(stats[:, :3].copy())
        for name, column in (("write_backs", 0), ("store_evictions", 1), ("loads", 2)):
            storage.counters[:, _COUNTER[name]] += counts[:, column]
        fresh = inserted & torch.from_numpy(np.repeat(run & ~left, np.diff(bounds)))
        fresh[ld_at[found]] = False
        initialize(slots, keys, fresh, segments)
        for t in np.flatnonzero(run & ~left).tolist():
            changes = storage.tables[t].changes
            if changes is not None and wb_seg[t + 1] > wb_seg[t]:
                changes.written_back(wb_keys[wb_seg[t]:wb_seg[t + 1]])
        return np.flatnonzero(left).tolist()

    def read_into(self, keys: torch.Tensor, unique_bounds: Sequence[int],
                  missing: torch.Tensor, fallback: torch.Tensor) -> None:
        """The stored rows of the ``missing`` keys (of ``keys``, table ``t``'s at
        ``unique_bounds[t]:unique_bounds[t + 1]``) into ``fallback`` [U, dim] float32, where
        their table's store has them (the other rows stay), without changing the stores: the
        default stores of CPU tables in one kernel call, the others (a user's store, a
        store behind CUDA rows) by their own ``find``."""
        storage = self.storage
        bounds = np.asarray(unique_bounds, dtype=np.int64)
        if self._movable.any():
            store_keys, _, _, _, store_rows, buckets, bucket_sizes, _, _ = self._store_arrays()
            bits = _BITS[storage.weights.element_size()]
            out = torch.zeros(keys.numel(), storage.weights.shape[1], dtype=bits)
            found = torch.zeros(keys.numel(), dtype=torch.bool)  # the kernel skips the others
            storage.kernels.store_find_group(store_keys, store_rows, buckets, bucket_sizes,
                                             self._movable, keys, Segments(bounds), missing,
                                             out, found)
            rows = out.view(storage.weights.dtype)[:, :storage.dim].float()
            fallback[found] = rows[found]
        if self._movable.all():
            return
        on_host = missing.cpu().numpy()
        before = np.concatenate([[0], np.cumsum(on_host)])
        for t in np.flatnonzero(~self._movable).tolist():
            lo, hi = bounds[t], bounds[t + 1]
            if before[hi] == before[lo]:
                continue
            where = torch.from_numpy(lo + np.flatnonzero(on_host[lo:hi])).to(keys.device)
            rows, stored, _ = storage.tables[t].store.find(keys[where])
            stored = stored.to(fallback.device)
            fallback[where[stored]] = rows.to(fallback.device)[stored, :storage.dim].float()

    @staticmethod
    def _entries_of(mask: torch.Tensor, bounds: np.ndarray, run: np.ndarray) -> torch.Tensor:
        """Positions of ``mask``'s true entries that belong to the tables ``run``."""
        if not run.all():
            mask = mask & torch.from_numpy(np.repeat(run, np.diff(bounds)))
        return mask.nonzero().flatten()


def _same_source(a: Optional[tuple], b: Optional[tuple]) -> bool:
    """Whether two (hash arrays, rows) pairs are the same objects (None: a skipped table)."""
    if a is None or b is None:
        return a is b
    return a[0] is b[0] and a[1] is b[1]
