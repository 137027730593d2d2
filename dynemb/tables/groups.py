"""Table groups: tables of one shape that train as one, one kernel call per phase.

A module's HBM_DIRECT (or CACHE) tables that agree on everything the kernels read (mode,
device and kernels, dtype, dim and row width, optimizer, score policy, bucket size, no
growth, no admission, no stashing) form a :class:`TableGroup`; such a table with no partner
is a group of one, so that it trains on the same path. The group allocates one set of arrays (hash keys,
scores, pins, rows, counters) and each table moves into its own contiguous part of them:
table ``t`` owns rows ``[row_offset[t], row_offset[t] + capacity[t])`` and the buckets over
them, so a key of one table never meets, or evicts, another table's. The tables stay whole
tables: their hash tables, flat tables and counters are views of their parts, and everything
read per table (``read_rows``, ``stats``, checkpoints, exports) is unchanged.

A training batch of the group is one :class:`GroupBatch`: one dedup, one claim, one
initialization, one gather, one fused update and one release for all its tables, each with
the results its table alone would give (the claim is the single-table kernel run on each
table's part, see ``kernels/groups_cpu.py``). CACHE tables then write their evicted rows
back to their own stores and load their new rows, table by table. Eval batches go table by
table over the same storage. On the CUDA kernels (HBM_DIRECT groups) the prefetch reads
nothing back on the host (:mod:`dynemb.tables.group_device`). Which tables group:
:func:`~dynemb.tables.group_signature.group_signature`.

Example::

    >>> from dynemb.options import DynamicEmbTableOptions, choose_storage_mode
    >>> from dynemb.rows.optimizers import OptimizerConfig
    >>> from dynemb.tables import build_table
    >>> def table(name):
    ...     layout = choose_storage_mode(DynamicEmbTableOptions(), name=name, num_embeddings=512,
    ...                                  width=4, config_dtype=torch.float32)
    ...     return build_table(name, 0, 4, layout, DynamicEmbTableOptions(), OptimizerConfig(),
    ...                        torch.device("cpu"))
    >>> tables = {name: table(name) for name in ("a", "b")}
    >>> [group.names for group in group_tables(tables)]
    [('a', 'b')]
"""
from __future__ import annotations

from typing import Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from dynemb.foundations.counters import COUNTER_NAMES
from dynemb.backends.protocol import Segments, TableArrays
from dynemb.options import StorageMode
from dynemb.tables.base import DynamicTable
from dynemb.tables.group_batch import GroupBatch, given_counts, key_bounds_of
from dynemb.tables.group_device import DeviceGroupPrefetch
from dynemb.tables.group_eval import GroupEvalLookup
from dynemb.tables.group_signature import group_signature, rounds_with_noise
from dynemb.tables.group_stores import GroupStores
from dynemb.tables.group_update import GroupUpdates
from dynemb.tables.units import LoneTable
from dynemb.types import EMPTY_KEY, FindOrInsertResult, ScorePolicy

__all__ = ["GroupBatch", "TableGroup", "group_signature", "group_tables"]

_COUNTER = {name: i for i, name in enumerate(COUNTER_NAMES)}


def group_tables(tables: Mapping[str, DynamicTable]) -> List["TableGroup"]:
    """The groups of ``tables``, in table order: every table that can group is in one, a
    table with no partner in a group of one; a table that cannot group (see
    :func:`group_signature`) is in none and trains alone.

    A table with no partner is a group of one only where that is measured to cost no more
    than its own path: HBM_DIRECT on the host kernels. A CACHE table alone writes back and
    loads its rows faster than a group of one does (1.11-1.18x on bench_collection's
    workload), and on the CUDA kernels the group's sync-free path has not been measured for
    one table (the table's own path was, benchmarks/results/gpu_h100)."""
    by_signature: Dict[Hashable, List[DynamicTable]] = {}
    for table in tables.values():
        signature = group_signature(table)
        if signature is not None:
            by_signature.setdefault(signature, []).append(table)
    return [TableGroup(members) for members in by_signature.values()
            if len(members) > 1 or _one_is_a_group(members[0])]


def _one_is_a_group(table: DynamicTable) -> bool:
    return table.mode is StorageMode.HBM_DIRECT and not table.kernels.defers_failures


def _owns_its_arrays(table: DynamicTable) -> bool:
    """Whether the table's arrays are whole tensors, not views into an earlier group's (a
    group of one that kept those would keep the earlier group's memory alive)."""
    tensors = (table.tier.hash.arrays.keys, table.tier.flat.weights, table.counters.values)
    return all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors)


class TableGroup(GroupUpdates):
    """Tables of one :func:`group_signature` in one set of arrays (see the module
    docstring). Building it copies each table into its part of the group's arrays."""

    def __init__(self, tables: Sequence[DynamicTable]):
        first = tables[0]
        self.mode = first.mode
        self.tables = list(tables)
        self.names = tuple(t.name for t in tables)
        self.index = {name: t for t, name in enumerate(self.names)}
        self.kernels = first.kernels
        self.device = first.tier.device
        self.dim = first.dim
        self.optimizer = first.optimizer
        self.policy = first.tier.hash.policy
        self.bucket_size = first.tier.hash.bucket_size
        capacities = [t.tier.hash.capacity for t in tables]
        self.row_offset = [0]
        for capacity in capacities:
            self.row_offset.append(self.row_offset[-1] + capacity)
        if len(tables) == 1 and _owns_its_arrays(first):  # works on them: nothing is copied
            self.arrays, self.weights = first.tier.hash.arrays, first.tier.flat.weights
            self.counters = first.counters.values.unsqueeze(0)
        else:
            self._allocate_and_move_in()
        self._storage = [self._storage_of(t) for t in tables]
        self.row_starts = np.asarray(self.row_offset[:-1], dtype=np.int64)  # numpy, for the kernels
        self.bucket_counts = np.asarray([c // self.bucket_size for c in capacities],
                                       dtype=np.int64)
        init = [t.options.initializer.kernel_params() for t in tables]
        self.init_kinds = np.asarray([p[0] for p in init], dtype=np.int64)
        self.init_params = [np.asarray([p[i] for p in init], dtype=np.float64)
                             for i in range(1, 5)]
        self.seeds = np.asarray([t.options.seed for t in tables], dtype=np.int64)
        self.table_ids = np.asarray([t.table_id for t in tables], dtype=np.int64)
        #: how the fused update rounds float16 / bfloat16 rows: with noise only in a group of
        #: one (group_signature), drawn from its table's seed and id as the table alone does
        self.rounding = (dict(stochastic_rounding=True, seed=first.options.seed,
                              table_id=first.table_id)
                         if rounds_with_noise(first) else dict(stochastic_rounding=False))
        self._stores = GroupStores(self) if self.mode is StorageMode.CACHE else None
        self._on_device = DeviceGroupPrefetch(self) if self.kernels.defers_failures else None
        self._eval = None  # the eval lookups of the whole group, made at the first one

    def __setstate__(self, state: Dict) -> None:
        """Unpickling a group pickled by an earlier version: what it lacks is derived."""
        self.__dict__.update(state)
        if "rounding" not in state:  # groups held no rows rounded with noise then
            self.rounding = dict(stochastic_rounding=False)
        if "row_starts" not in state:
            self.row_starts = np.asarray(self.row_offset[:-1], dtype=np.int64)
        self.__dict__.setdefault("_eval", None)  # made at the first eval lookup

    def _allocate_and_move_in(self) -> None:
        """The group's arrays, each table copied into its part of them."""
        rows = self.row_offset[-1]
        first = self.tables[0]
        weights = first.tier.flat.weights
        self.arrays = TableArrays(
            torch.full((rows,), EMPTY_KEY, dtype=torch.int64, device=self.device),
            torch.zeros(rows, dtype=torch.int64, device=self.device),
            torch.zeros(rows, dtype=torch.int32, device=self.device),
            torch.zeros(len(self.tables), dtype=torch.int64, device=self.device),
            rows // self.bucket_size, self.bucket_size)
        self.weights = torch.zeros(rows, weights.shape[1], dtype=weights.dtype,
                                   device=self.device)
        self.counters = torch.zeros(len(self.tables), len(COUNTER_NAMES), dtype=torch.int64,
                                    device=first.counters.values.device)
        for t in range(len(self.tables)):
            self._move_into_part(t)

    def _move_into_part(self, t: int) -> None:
        """Copy table ``t`` into its part of the group's arrays and make its arrays views
        of that part."""
        table = self.tables[t]
        lo, hi = self.row_offset[t], self.row_offset[t + 1]
        table.tier.hash.use_storage(TableArrays(
            self.arrays.keys[lo:hi], self.arrays.scores[lo:hi], self.arrays.refcnt[lo:hi],
            self.arrays.size[t:t + 1], (hi - lo) // self.bucket_size, self.bucket_size))
        table.tier.flat.use_storage(self.weights[lo:hi])
        table.counters.use_storage(self.counters[t])

    def view_parts_again(self) -> None:
        """After unpickling: plain ``pickle`` copies every tensor on its own (``torch.save``
        and ``copy.deepcopy`` keep views), so a table's arrays may no longer be views of the
        group's. Such a table's arrays (equal to its part) become views of its part again."""
        for t, table in enumerate(self.tables):
            lo = self.row_offset[t]
            apart = (table.tier.hash.arrays.keys.data_ptr() != self.arrays.keys[lo:].data_ptr()
                     or table.tier.flat.weights.data_ptr() != self.weights[lo:].data_ptr()
                     or table.counters.values.data_ptr() != self.counters[t].data_ptr())
            if apart:
                self._move_into_part(t)
                self._storage[t] = self._storage_of(table)

    @property
    def allows_eviction(self) -> bool:
        return self.policy is not ScorePolicy.NO_EVICTION

    @staticmethod
    def _storage_of(table: DynamicTable):
        return (table.tier.hash.arrays, table.tier.flat.weights, table.counters.values)

    def intact(self, tables: Mapping[str, DynamicTable]) -> bool:
        """Whether ``tables`` still holds the group's tables, each still in its part of the
        group's arrays (a checkpoint load or reset may have replaced a table, a direct call
        of its hash table's ``grow`` its arrays)."""
        for name, table, (arrays, weights, counters) in zip(self.names, self.tables,
                                                             self._storage):
            if (tables.get(name) is not table or table.tier.hash.arrays is not arrays
                    or table.tier.flat.weights is not weights
                    or table.counters.values is not counters):
                return False
        return True

    # -- prefetch ------------------------------------------------------------------------------
    def read_stores(self, keys: torch.Tensor, unique_bounds, want: torch.Tensor):
        """A CACHE group's stores read for the ``want``-ed keys (see
        :meth:`~dynemb.tables.group_stores.GroupStores.read`)."""
        return self._stores.read(keys, unique_bounds, want, self.dim)

    def lookup_batch(self, keys: Sequence[torch.Tensor],
                     occurrences: Sequence[Optional[torch.Tensor]]) -> GroupBatch:
        """A read-only (eval) lookup of every table's ``keys`` (:mod:`dynemb.tables.group_eval`;
        on the CUDA kernels, :mod:`dynemb.tables.group_device`)."""
        if self._eval is None:
            self._eval = self._on_device or GroupEvalLookup(self)
        return self._eval.lookup_batch(keys, occurrences)

    def prefetch(self, keys: Sequence[torch.Tensor], occurrences: Sequence[Optional[torch.Tensor]],
                 scores: Sequence[Optional[int]]) -> Optional[GroupBatch]:
        """:meth:`claim_batch` then :meth:`finish_batch`."""
        batch = self.claim_batch(keys, occurrences, scores)
        return None if batch is None else self.finish_batch(batch)

    def claims_apart(self) -> bool:
        """Whether :meth:`claim_batch` only claims (:meth:`undo_batch` takes it back
        exactly): on the host kernels. The CUDA path does all of the prefetch at once."""
        return self._on_device is None

    def check_failures(self) -> None:
        """Raise the ``TableFullError`` of keys of earlier batches that found no slot on the
        CUDA path (once their count has reached the host), the group's, then those of its
        tables from before they were grouped."""
        if self._on_device is not None:
            self._on_device.failures.check()
        for table in self.tables:
            table.check_failures()

    def alone(self) -> List[LoneTable]:
        """The group's tables as units of their own (a :class:`~dynemb.tables.units` unit),
        for a batch the group could not claim as one."""
        return [LoneTable(table) for table in self.tables]

    def claim_batch(self, keys: Sequence[torch.Tensor],
                    occurrences: Sequence[Optional[torch.Tensor]],
                    scores: Sequence[Optional[int]]) -> Optional[GroupBatch]:
        """Claim and pin the rows of every table's ``keys`` (one tensor per table, group
        order) for training. ``occurrences``: per table, what each id stands for (None: 1);
        ``scores``: per table, the CUSTOMIZED score (None for other policies).

        None when a key finds no slot (its bucket full of pinned rows): the whole claim is
        undone, the group unchanged, and the caller runs the tables one by one (which
        raises the error a table alone raises, where a table alone raises it). On the CUDA
        kernels nothing is read back (:mod:`dynemb.tables.group_device`): a key without a
        slot is served zeros and its table raises at a later prefetch, as alone.

        On the host kernels the rows are claimed but neither filled nor counted yet:
        :meth:`finish_batch` does that, or :meth:`undo_batch` takes the claim back."""
        if self._on_device is not None:
            return self._on_device.prefetch(keys, occurrences, scores)
        key_bounds = key_bounds_of(keys)
        unique, inverse, counts, unique_bounds = self.dedup(keys, key_bounds)
        counts, given_occurrences = given_counts(keys, occurrences, inverse, counts)
        ub = unique_bounds.tolist()
        given = self._given_scores(scores, ub, unique)
        claimed = self._claim(unique, counts, given, unique_bounds)
        if claimed is None:
            return None
        slots, inserted, prev_keys, prev_scores, stats = claimed
        batch = GroupBatch(self, unique, inverse, counts, ub, key_bounds, slots)
        for table in self.tables:
            table.hold_group_batch(batch)
        claim = (unique, slots, inserted, prev_keys, prev_scores, unique_bounds)
        batch.pending = (claim, stats, given_occurrences)
        return batch

    def undo_batch(self, batch: GroupBatch) -> None:
        """Take back a :meth:`claim_batch` that :meth:`finish_batch` did not follow: keys, scores,
        sizes, clocks and pins as before it. A finished batch's pins just end."""
        if batch.pending is None:
            self.release(batch)
            return
        (_, slots, inserted, prev_keys, prev_scores, _), stats, _ = batch.pending
        batch.pending = None
        self._rollback(slots, inserted, prev_keys, prev_scores, stats)
        for table in self.tables:
            table.drop_group_batch(batch)
        batch.unreleased = set()
        batch.pinned = False

    def finish_batch(self, batch: GroupBatch) -> GroupBatch:
        """Fill the rows :meth:`claim_batch` claimed (CACHE: write-backs and loads, else the
        initializers) and count them."""
        if batch.pending is None:
            return batch
        claim, stats, occurrences = batch.pending
        batch.pending = None
        unique, slots, inserted, prev_keys, prev_scores, unique_bounds = claim
        undone: List[int] = []

        def undo(tables: List[int]) -> None:  # their rows could not be filled
            self._undo_tables(batch, claim, stats, tables)
            undone.extend(tables)
        try:
            self.track_changes(claim)
            if self.mode is StorageMode.CACHE:  # a store may raise (a full disk, say)
                self._stores.fill(claim, np.flatnonzero(stats[:, 0] + stats[:, 1]).tolist(),
                                  undo)
            else:
                self.initialize_rows(slots, unique, inserted, unique_bounds)
        except Exception:
            if undone:  # the other tables' claims stand, filled: they count
                self._count_prefetch(batch, inserted, prev_keys, occurrences, skip=undone)
            self.release(batch)
            raise
        self._count_prefetch(batch, inserted, prev_keys, occurrences)
        return batch

    def _undo_tables(self, batch: GroupBatch, claim, stats, tables: List[int]) -> None:
        """Undo the claim of ``tables`` (whose rows were not filled: the keys it evicted are
        back with their rows, which nothing overwrote); their pins end."""
        keys, slots, inserted, prev_keys, prev_scores, unique_bounds = claim
        chosen = np.zeros(len(self.tables), dtype=np.bool_)
        chosen[tables] = True
        mine = torch.from_numpy(np.repeat(chosen, np.diff(np.asarray(unique_bounds))))
        a = self.arrays
        back = inserted & mine
        a.keys[slots[back]] = prev_keys[back]
        placed = (slots >= 0) & mine
        a.scores[slots[placed]] = prev_scores[placed]
        a.size.sub_(torch.from_numpy(np.where(chosen, stats[:, 0], 0)))
        self.kernels.add_refcounts(a, torch.where(mine, slots, -1), -1)
        for t in tables:
            self.tables[t].tier.hash.untick()
            self.tables[t].drop_group_batch(batch)
        batch.unreleased -= set(tables)
        batch.pinned = bool(batch.unreleased)

    def dedup(self, keys: Sequence[torch.Tensor], key_bounds: List[int]):
        """(unique keys, inverse, counts, unique bounds [T + 1]) of every table's keys."""
        all_keys = torch.cat(list(keys)) if len(keys) > 1 else keys[0]
        # in bucket order, the order of the slots: the claim and the update walk each
        # table's rows front to back
        unique, inverse, counts, segments = self.kernels.dedup_segments(
            all_keys, Segments(key_bounds), self.bucket_counts)
        return unique, inverse, counts, segments.bounds

    def _given_scores(self, scores, bounds: List[int], unique: torch.Tensor) -> torch.Tensor:
        if self.policy is not ScorePolicy.CUSTOMIZED:
            return unique.new_zeros(1).expand(unique.shape)
        sizes = np.diff(np.asarray(bounds))
        return torch.from_numpy(np.repeat(np.asarray(scores, dtype=np.int64), sizes))

    def _claim(self, unique, counts, given, unique_bounds) -> Optional[tuple]:
        """(slots, inserted, previous keys, previous scores, per-table stats) of one
        pinning claim of every table's keys; None, the claim undone, if a key found no
        slot."""
        clocks = np.asarray([t.tier.hash.tick() for t in self.tables], dtype=np.int64)
        u = unique.numel()
        slots, prev_keys, prev_scores = (torch.empty(u, dtype=torch.int64) for _ in range(3))
        inserted = torch.empty(u, dtype=torch.bool)
        failed = torch.empty(u, dtype=torch.bool)
        stats = np.empty((len(self.tables), 3), dtype=np.int64)
        self.kernels.find_or_insert_group(
            self.arrays, self.arrays.size, Segments(unique_bounds), self.row_starts,
            self.bucket_counts, unique, counts, given, self.policy.code, clocks,
            self.allows_eviction, slots, inserted, prev_keys, prev_scores, failed, stats)
        if stats[:, 2].any():
            self._rollback(slots, inserted, prev_keys, prev_scores, stats)
            return None
        return slots, inserted, prev_keys, prev_scores, stats

    def table_claim(self, claim, t: int) -> FindOrInsertResult:
        """Table ``t``'s part of a group claim, in its own slots."""
        keys, slots, inserted, prev_keys, prev_scores, unique_bounds = claim
        lo, hi = int(unique_bounds[t]), int(unique_bounds[t + 1])
        part = slots[lo:hi]
        local = torch.where(part >= 0, part - self.row_offset[t], -1)
        return FindOrInsertResult(keys[lo:hi], None, local, inserted[lo:hi], prev_keys[lo:hi],
                                  prev_scores[lo:hi], None, None)

    def track_changes(self, claim) -> None:
        """Tables tracking their changes for checkpoint deltas mark the slots claimed."""
        for t, table in enumerate(self.tables):
            if table.changes is not None:
                table.changes.claimed(table.tier, self.table_claim(claim, t))

    def _rollback(self, slots, inserted, prev_keys, prev_scores, stats) -> None:
        """Undo a claim: keys, scores, sizes, pins and clocks as before it."""
        a = self.arrays
        a.keys[slots[inserted]] = prev_keys[inserted]
        a.size.sub_(torch.from_numpy(stats[:, 0].copy()))
        placed = slots >= 0
        a.scores[slots[placed]] = prev_scores[placed]
        self.kernels.add_refcounts(a, slots, -1)
        for table in self.tables:
            table.tier.hash.untick()

    def initialize_rows(self, slots, keys, inserted, unique_bounds) -> None:
        """Rows of the claim's keys where ``inserted`` start from their table's
        initializer."""
        if self.weights.dtype == torch.float32:
            self.kernels.init_rows_at_group(
                self.weights, slots, keys, inserted, Segments(unique_bounds), self.dim,
                self.seeds, self.table_ids, self.init_kinds, *self.init_params)
            return
        for t, table in enumerate(self.tables):  # float16 / bfloat16 rows: table by table
            lo, hi = int(unique_bounds[t]), int(unique_bounds[t + 1])
            local = torch.where(slots[lo:hi] >= 0, slots[lo:hi] - self.row_offset[t], -1)
            table.tier.flat.initialize_where(local, keys[lo:hi], inserted[lo:hi],
                                             table.options.initializer, seed=table.options.seed,
                                             table_id=table.table_id)

    def _count_prefetch(self, batch: GroupBatch, inserted, prev_keys, occurrences,
                        skip: Sequence[int] = ()) -> None:
        """Count the claim (lookups, hits, inserts, evictions) of every table but ``skip``."""
        per_table = np.empty((len(self.tables), 3), dtype=np.int64)
        self.kernels.claim_counts_group(Segments(batch.unique_bounds), batch.slots, inserted,
                                        prev_keys, per_table)
        unique = np.diff(np.asarray(batch.unique_bounds, dtype=np.int64))
        if occurrences is None:
            lookups = np.diff(np.asarray(batch.key_bounds, dtype=np.int64))
        else:
            total = np.concatenate([[0], np.cumsum(occurrences.numpy())])
            bounds = np.asarray(batch.key_bounds)
            lookups = total[bounds[1:]] - total[bounds[:-1]]
        delta = np.zeros((len(self.tables), len(COUNTER_NAMES)), dtype=np.int64)
        delta[:, _COUNTER["lookups"]] = lookups
        delta[:, _COUNTER["unique_keys"]] = unique
        delta[:, _COUNTER["hits"]] = per_table[:, 0]
        delta[:, _COUNTER["misses"]] = unique - per_table[:, 0]
        delta[:, _COUNTER["inserts"]] = per_table[:, 1]
        delta[:, _COUNTER["evictions"]] = per_table[:, 2]
        delta[list(skip)] = 0
        self.counters += torch.from_numpy(delta)

    # -- forward and backward ------------------------------------------------------------------
    def lookup_occurrences(self, batch: GroupBatch,
                           sizes: Optional[Sequence[int]] = None) -> Tuple[torch.Tensor, ...]:
        """Every input key's row (float32), views of one gather split into ``sizes`` (None:
        one tensor per table; a collection passes one size per feature of each table)."""
        if batch.fallback is not None:  # eval: a key not stored reads its eval initializer row
            rows = self.unique_rows(batch).index_select(0, batch.inverse)
            return rows.split(self._sizes(batch, sizes))
        slots = batch.slots.index_select(0, batch.inverse)
        if self._on_device is None:  # every key has its row
            rows = self.weights[:, :self.dim].index_select(0, slots).float()
        else:  # a key without a slot reads zeros (group_device)
            rows = self.weights[:, :self.dim].index_select(0, slots.clamp(min=0)).float()
            rows = torch.where((slots >= 0)[:, None], rows, 0.0)
        return rows.split(self._sizes(batch, sizes))

    @staticmethod
    def _sizes(batch: GroupBatch, sizes: Optional[Sequence[int]]) -> Sequence[int]:
        """``sizes``, or one part per table when None."""
        return np.diff(np.asarray(batch.key_bounds)).tolist() if sizes is None else sizes

    def unique_rows(self, batch: GroupBatch) -> torch.Tensor:
        """[U, dim] float32: each unique key's row; an eval batch's keys not stored read
        their eval initializer's row."""
        slots = batch.slots
        rows = self.weights[:, :self.dim].index_select(0, slots.clamp(min=0)).float()
        if batch.fallback is not None:
            rows = torch.where((slots >= 0)[:, None], rows, batch.fallback)
        return rows

    def release(self, batch: GroupBatch, tables: Optional[Sequence[int]] = None) -> None:
        """End the batch's pins of ``tables`` (indices; None: all), once per table."""
        if not batch.pinned:
            return
        ending = (set(batch.unreleased) if tables is None
                  else batch.unreleased.intersection(tables))
        if not ending:
            return
        if len(ending) == len(self.tables):
            slots = batch.slots
        else:
            slots = torch.cat([batch.slots[batch.unique_bounds[t]:batch.unique_bounds[t + 1]]
                               for t in sorted(ending)])
        self.kernels.add_refcounts(self.arrays, slots, -1)
        batch.unreleased -= ending
        for t in ending:
            self.tables[t].drop_group_batch(batch)
        batch.pinned = bool(batch.unreleased)

    def __repr__(self) -> str:
        return f"TableGroup({list(self.names)}, rows={self.row_offset[-1]})"
