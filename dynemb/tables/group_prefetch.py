"""A table group's training prefetch on the host kernels (:mod:`dynemb.tables.groups`), over
its :class:`~dynemb.tables.group_storage.GroupStorage`: one dedup, one claim, one fill and
one count for all its tables, each with the results its table alone would give (the claim is
the single-table kernel run on each table's part, see ``kernels/groups_cpu.py``).

The claim and the fill are apart, so that a module's prefetch can claim every unit of a batch
before it fills any, and take back what it claimed when one fails:
:meth:`HostGroupPrefetch.claim_batch` claims and pins, :meth:`~HostGroupPrefetch.finish_batch`
fills the claimed rows (CACHE: write-backs and loads through the group's
:class:`~dynemb.tables.group_stores.GroupStores`, else the initializers) and counts them,
:meth:`~HostGroupPrefetch.undo_batch` takes a claim back exactly.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import torch

from dynemb.backends.protocol import Segments
from dynemb.foundations.counters import COUNTER_NAMES
from dynemb.tables.group_batch import GroupBatch, key_bounds_of, lookups_per_table
from dynemb.tables.group_storage import GroupStorage
from dynemb.tables.group_stores import GroupStores
from dynemb.types import ScorePolicy

_COUNTER = {name: i for i, name in enumerate(COUNTER_NAMES)}


class HostGroupPrefetch:
    """The training prefetch of the tables of a group's ``storage`` (see the module
    docstring); ``stores``: a CACHE group's stores (None in the other modes)."""

    def __init__(self, storage: GroupStorage, stores: Optional[GroupStores]):
        self.storage = storage
        self.stores = stores

    def claim_batch(self, keys: Sequence[torch.Tensor],
                    occurrences: Sequence[Optional[torch.Tensor]],
                    scores: Sequence[Optional[int]]) -> GroupBatch:
        """Claim and pin the rows of every table's ``keys`` (see
        ``TableGroup.claim_batch``); the rows are neither filled nor counted yet. Where a
        key finds no slot the claim of every table is undone and the ``TableFullError`` the
        first table that refused it raises alone is raised (its message reads the table as
        it is after the undo, as alone).

        Tables with admission claim only the keys they admit (the others read their
        ``fallback`` row, as alone); their admission counts stay."""
        storage = self.storage
        key_bounds = key_bounds_of(keys)
        unique, inverse, counts, unique_bounds, given_occurrences = storage.dedup(
            keys, key_bounds, occurrences)
        ub = unique_bounds.tolist()
        given = self._given_scores(scores, ub, unique)
        claim_keys, fallback = (
            storage.admit(unique, counts, Segments(ub), storage.row_starts,
                          storage.bucket_counts)
            if storage.admits else (unique, None))
        claimed, refused = self._claim(claim_keys, counts, given, unique_bounds)
        if claimed is None:
            t, failed_keys = refused
            raise storage.tables[t].full_error(failed_keys)
        slots, inserted, prev_keys, prev_scores, stats = claimed
        batch = GroupBatch(storage, unique, inverse, counts, ub, key_bounds, slots)
        batch.fallback = fallback
        for table in storage.tables:
            table.hold_group_batch(batch)
        claim = (claim_keys, slots, inserted, prev_keys, prev_scores, unique_bounds)
        batch.pending = (claim, stats, given_occurrences)
        return batch

    def prefetch(self, keys: Sequence[torch.Tensor],
                 occurrences: Sequence[Optional[torch.Tensor]],
                 scores: Sequence[Optional[int]]) -> GroupBatch:
        """:meth:`claim_batch` then :meth:`finish_batch`, for tables with admission (whose
        claim cannot be taken back; a key without a slot raises)."""
        return self.finish_batch(self.claim_batch(keys, occurrences, scores))

    def undo_batch(self, batch: GroupBatch) -> None:
        """Take back a :meth:`claim_batch` that :meth:`finish_batch` did not follow: keys,
        scores, sizes, clocks and pins as before it. A finished batch's pins just end."""
        if batch.pending is None:
            self.storage.release(batch)
            return
        (_, slots, inserted, prev_keys, prev_scores, _), stats, _ = batch.pending
        batch.pending = None
        self._rollback(slots, inserted, prev_keys, prev_scores, stats)
        for table in self.storage.tables:
            table.drop_group_batch(batch)
        batch.unreleased = set()
        batch.pinned = False

    def finish_batch(self, batch: GroupBatch) -> GroupBatch:
        """Fill the rows :meth:`claim_batch` claimed (CACHE: write-backs and loads, else the
        initializers) and count them."""
        if batch.pending is None:
            return batch
        storage = self.storage
        claim, stats, occurrences = batch.pending
        batch.pending = None
        unique, slots, inserted, prev_keys, prev_scores, unique_bounds = claim
        undone: List[int] = []

        def undo(tables: List[int]) -> None:  # their rows could not be filled
            storage.undo_table_claims(batch, claim, tables)
            undone.extend(tables)
        try:
            storage.track_changes(claim)
            if self.stores is not None:  # a store may raise (a full disk, say)
                self.stores.fill(claim, np.flatnonzero(stats[:, 0] + stats[:, 1]).tolist(),
                                 undo)
            else:
                storage.initialize_rows(slots, unique, inserted, unique_bounds)
        except Exception:
            if undone:  # the other tables' claims stand, filled: they count
                self._count(batch, inserted, prev_keys, occurrences, skip=undone)
            storage.release(batch)
            raise
        self._count(batch, inserted, prev_keys, occurrences)
        return batch

    def _given_scores(self, scores, bounds: List[int], unique: torch.Tensor) -> torch.Tensor:
        if self.storage.policy is not ScorePolicy.CUSTOMIZED:
            return unique.new_zeros(1).expand(unique.shape)
        sizes = np.diff(np.asarray(bounds))
        return torch.from_numpy(np.repeat(np.asarray(scores, dtype=np.int64), sizes))

    def _claim(self, unique, counts, given, unique_bounds):
        """``(claim, None)``: the (slots, inserted, previous keys, previous scores,
        per-table stats) of one pinning claim of every table's keys; or, the claim undone,
        ``(None, (table, its keys that found no slot))`` of the first table where a key
        found none. A table that grows grows where its claim alone would: before the claim,
        where the keys it misses would pass its load factor, and where the claim evicted a
        key or missed a slot (the claim is undone, the table grown in the group, and the
        claim runs again): so below its ``max_capacity`` it never evicts or misses a slot."""
        storage = self.storage
        bounds = unique_bounds.tolist()
        storage.grow_before_claim(unique, bounds)
        while True:
            slots, inserted, prev_keys, prev_scores, failed, stats = self._claim_once(
                unique, counts, given, unique_bounds)
            growth = storage.growth_after_claim(stats, grow_on_failure=True)
            if not growth and not stats[:, 2].any():
                return (slots, inserted, prev_keys, prev_scores, stats), None
            self._rollback(slots, inserted, prev_keys, prev_scores, stats)
            if not growth:
                t = int(np.flatnonzero(stats[:, 2])[0])
                lo, hi = bounds[t], bounds[t + 1]
                return None, (t, unique[lo:hi][failed[lo:hi]])
            storage.grow_tables(growth)

    def _claim_once(self, unique, counts, given, unique_bounds) -> tuple:
        """One claim of every table's keys (see :meth:`_claim`)."""
        storage = self.storage
        clocks = np.asarray([storage.tier_of(t).hash.tick() for t in storage.tables],
                            dtype=np.int64)
        u = unique.numel()
        slots, prev_keys, prev_scores = (torch.empty(u, dtype=torch.int64) for _ in range(3))
        inserted = torch.empty(u, dtype=torch.bool)
        failed = torch.empty(u, dtype=torch.bool)
        stats = np.empty((len(storage.tables), 3), dtype=np.int64)
        storage.kernels.find_or_insert_group(
            storage.arrays, storage.arrays.size, Segments(unique_bounds), storage.row_starts,
            storage.bucket_counts, unique, counts, given, storage.policy.code, clocks,
            storage.allows_eviction, slots, inserted, prev_keys, prev_scores, failed, stats)
        return slots, inserted, prev_keys, prev_scores, failed, stats

    def _rollback(self, slots, inserted, prev_keys, prev_scores, stats) -> None:
        """Undo a claim: keys, scores, sizes, pins and clocks as before it."""
        self.storage.undo_claim(slots, inserted, prev_keys, prev_scores,
                                torch.from_numpy(stats[:, 0].copy()))

    def _count(self, batch: GroupBatch, inserted, prev_keys, occurrences,
               skip: Sequence[int] = ()) -> None:
        """Count the claim (lookups, hits, inserts, evictions) of every table but ``skip``."""
        storage = self.storage
        per_table = np.empty((len(storage.tables), 3), dtype=np.int64)
        storage.kernels.claim_counts_group(Segments(batch.unique_bounds), batch.slots, inserted,
                                           prev_keys, per_table)
        unique = storage.unique_per_table(batch.keys, batch.unique_bounds).numpy()
        lookups = lookups_per_table(batch.key_bounds, occurrences)
        delta = np.zeros((len(storage.tables), len(COUNTER_NAMES)), dtype=np.int64)
        delta[:, _COUNTER["lookups"]] = lookups
        delta[:, _COUNTER["unique_keys"]] = unique
        delta[:, _COUNTER["hits"]] = per_table[:, 0]
        delta[:, _COUNTER["misses"]] = unique - per_table[:, 0]
        delta[:, _COUNTER["inserts"]] = per_table[:, 1]
        delta[:, _COUNTER["evictions"]] = per_table[:, 2]
        delta[list(skip)] = 0
        storage.add_counts(delta)
