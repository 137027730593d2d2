"""A table group's read-only lookup (eval, or a forward under ``torch.no_grad``) in one call
per phase: one dedup, one find, one initializer call for the keys not stored, and later one
gather and one release, whatever the number of tables. Each table's rows, counters and pins
are those its own eval lookup gives: found keys read their row, the others their table's
``eval_initializer`` row; nothing is inserted or rescored.

For the HBM_DIRECT and CACHE groups of the host kernels (:mod:`dynemb.tables.groups`); a
CACHE table's key missing from the cache reads its store's row where the store has it (the
default stores in one kernel call, a user's store by its ``find``; as alone, nothing is
loaded). On the CUDA kernels ``DeviceGroupPrefetch.lookup_batch``
(:mod:`dynemb.tables.group_device`) does the same for HBM_DIRECT groups with nothing read
back.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from dynemb.foundations.counters import COUNTER_NAMES
from dynemb.backends.protocol import Segments
from dynemb.tables.group_batch import GroupBatch, key_bounds_of, lookups_per_table
from dynemb.tables.group_storage import GroupStorage, segment_sums
from dynemb.tables.group_stores import GroupStores

_COUNTER = {name: i for i, name in enumerate(COUNTER_NAMES)}


class GroupEvalLookup:
    """Read-only lookups of the tables of a group's ``storage`` (see the module docstring);
    ``stores``: a CACHE group's stores (None in the other modes)."""

    def __init__(self, storage: GroupStorage, stores: Optional[GroupStores]):
        self.storage = storage
        self.stores = stores
        params = [t.options.eval_initializer.kernel_params() for t in storage.tables]
        self.kinds = np.asarray([p[0] for p in params], dtype=np.int64)
        self.params = [np.asarray([p[i] for p in params], dtype=np.float64)
                       for i in range(1, 5)]

    def lookup_batch(self, keys: Sequence[torch.Tensor],
                     occurrences: Sequence[Optional[torch.Tensor]]) -> GroupBatch:
        """Every table's ``keys`` (group order) found and pinned until released; the keys
        not stored get their eval rows in ``batch.fallback`` [U, dim]."""
        storage = self.storage
        key_bounds = key_bounds_of(keys)
        unique, inverse, counts, unique_bounds, given = storage.dedup(keys, key_bounds,
                                                                      occurrences)
        slots = torch.empty_like(unique)
        segments = Segments(unique_bounds)
        storage.kernels.find_group(storage.arrays, segments, storage.row_starts,
                                   storage.bucket_counts, unique, slots)
        storage.kernels.add_refcounts(storage.arrays, slots, 1)  # until the rows are read
        batch = GroupBatch(storage, unique, inverse, counts, unique_bounds.tolist(), key_bounds,
                           slots)
        batch.training = False
        for table in storage.tables:
            table.hold_group_batch(batch)
        found = slots >= 0
        batch.fallback = torch.zeros(unique.numel(), storage.dim)
        storage.kernels.init_rows_at_group(
            batch.fallback, torch.arange(unique.numel()), unique, ~found, segments, storage.dim,
            storage.seeds, storage.table_ids, self.kinds, *self.params)
        if self.stores is not None:
            try:
                self.stores.read_into(batch.keys, batch.unique_bounds, ~found,
                                      batch.fallback)
            except BaseException:  # a store failed (a disk): the pins end, nothing counted
                storage.release(batch)
                raise
        self._count(batch, found, given)
        return batch

    def _count(self, batch: GroupBatch, found: torch.Tensor,
               occurrences: Optional[torch.Tensor]) -> None:
        """Each table's lookups, unique keys, hits and misses, as its eval lookup counts."""
        hits = segment_sums(found.numpy(), batch.unique_bounds)
        unique = self.storage.unique_per_table(batch.keys, batch.unique_bounds).numpy()
        lookups = lookups_per_table(batch.key_bounds, occurrences)
        delta = np.zeros((len(self.storage.tables), len(COUNTER_NAMES)), dtype=np.int64)
        delta[:, _COUNTER["lookups"]] = lookups
        delta[:, _COUNTER["unique_keys"]] = unique
        delta[:, _COUNTER["hits"]] = hits
        delta[:, _COUNTER["misses"]] = unique - hits
        self.storage.add_counts(delta)
