"""A table group's training prefetch on a backend that must not wait for the device (CUDA):
the same one dedup, one claim and one initialization per group as ``TableGroup.prefetch``,
with nothing read back on the host.

What the host cannot know without waiting, it does not need:

- **Sizes.** Each table's unique keys are padded to its number of input keys (``EMPTY_KEY``,
  count 0, slot -1), so the unique bounds are the key bounds, known from the input.
- **Failures.** A key that finds no slot (its bucket full of pinned rows, or NO_EVICTION) is
  served zeros and not trained, as a CUDA table alone does; each table's count of them is
  copied to the host without waiting and raised at a later prefetch
  (:class:`GroupFailures`).
- **Per-table values** (bounds, clocks) go to the device through pinned memory
  (:func:`dynemb.backends.device_values.values_on`).

A group with a table that grows reads back what that table alone reads back: its size and,
where its keys could pass its load factor, how many of them it misses, before the claim; and
whether the claim evicted a live key below its ``max_capacity`` after it (then the claim is
undone, the table grown in the group, and the claim runs again). A CACHE group's stores are
in host memory: after the group's one claim each table writes back the rows it evicted and
loads the keys it inserted by its own calls (:class:`~dynemb.tables.group_stores.GroupStores`),
reading back what the table alone reads back; an eval lookup reads the keys missing from
the cache from the stores the same way.

Within a table, the unique keys come sorted (as ``dedup.padded_unique`` sorts a table's own),
each at its table's position in the key bounds.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from dynemb.foundations.counters import COUNTER_NAMES
from dynemb.backends.device_values import values_on
from dynemb.backends.protocol import Segments
from dynemb.tables.group_batch import GroupBatch, key_bounds_of
from dynemb.tables.group_storage import GroupStorage, given_counts
from dynemb.tables.group_stores import GroupStores
from dynemb.types import EMPTY_KEY, ScorePolicy, TableFullError

#: The counters a prefetch adds to (``add_claim_counts``), in its order: the first columns of
#: the counters.
PREFETCH_COUNTERS = ("lookups", "unique_keys", "hits", "misses", "inserts", "evictions")
assert COUNTER_NAMES[:len(PREFETCH_COUNTERS)] == PREFETCH_COUNTERS


class GroupFailures:
    """Per table of a group, the keys that found no slot, counted on the device and copied to
    the host without waiting; :meth:`check` raises at a later prefetch once the copy is in."""

    def __init__(self, names: Sequence[str], device: torch.device):
        self.names = list(names)
        self.total = torch.zeros(len(names), dtype=torch.int64, device=device)
        self._on_gpu = device.type == "cuda"
        self.host = torch.zeros(len(names), dtype=torch.int64, pin_memory=self._on_gpu)
        self._event = None

    def record(self, per_table: torch.Tensor) -> None:
        self.total += per_table
        self.host.copy_(self.total, non_blocking=self._on_gpu)
        if self._on_gpu:
            self._event = torch.cuda.Event()
            self._event.record()

    def check(self) -> None:
        if self._event is not None and not self._event.query():
            return
        counts = self.host.tolist()
        if not any(counts):
            return
        self.total.zero_()
        self.host.zero_()
        named = ", ".join(f"{name!r}: {n}" for name, n in zip(self.names, counts) if n)
        raise TableFullError(
            f"tables {named} keys of earlier batches found no slot (buckets full of pinned "
            f"rows or NO_EVICTION) and were served zeros without being trained",
            torch.empty(0, dtype=torch.int64), None)


class DeviceGroupPrefetch:
    """A group's training prefetch and eval lookup without host reads, over its
    ``storage``, for a group on the CUDA kernels; ``stores``: a CACHE group's stores (None
    in the other modes)."""

    def __init__(self, storage: GroupStorage, stores: Optional[GroupStores] = None):
        self.storage = storage
        self.stores = stores
        device = storage.device
        self.device = device
        self._place_tables()
        self.seeds = values_on(storage.seeds.tolist(), torch.int64, device)
        self.table_ids = values_on(storage.table_ids.tolist(), torch.int64, device)
        self.init_kinds = values_on(storage.init_kinds.tolist(), torch.int64, device)
        self.init_params = [values_on(p.tolist(), torch.float64, device)
                            for p in storage.init_params]
        evals = [t.options.eval_initializer.kernel_params() for t in storage.tables]
        self.eval_kinds = values_on([p[0] for p in evals], torch.int64, device)
        self.eval_params = [values_on([p[i] for p in evals], torch.float64, device)
                            for i in range(1, 5)]
        self.failures = GroupFailures(storage.names, device)

    _placed = None  # the storage's layout the device copies below are of

    def _place_tables(self) -> None:
        """Where each table's part starts, and its buckets, on the device (again after a
        growth laid the group out anew, in a claim or by a direct ``grow``)."""
        storage = self.storage
        self._row_offset = values_on(storage.row_offset[:-1], torch.int64, self.device)
        self._num_buckets = values_on(storage.bucket_counts.tolist(), torch.int64, self.device)
        self._placed = storage.layouts

    @property
    def row_offset(self) -> torch.Tensor:
        """[T] where each table's part starts, on the device, for the storage's layout now."""
        if self._placed != self.storage.layouts:
            self._place_tables()
        return self._row_offset

    @property
    def num_buckets(self) -> torch.Tensor:
        """[T] each table's buckets, on the device, for the storage's layout now."""
        if self._placed != self.storage.layouts:
            self._place_tables()
        return self._num_buckets

    def _dedup(self, keys: Sequence[torch.Tensor],
               occurrences: Sequence[Optional[torch.Tensor]]):
        """(key bounds, every table's segment of the keys, unique keys padded per table,
        inverse, counts, the given occurrences or None) of every table's keys."""
        key_bounds = key_bounds_of(keys)
        segments = Segments(key_bounds, self.device)
        all_keys = torch.cat(list(keys)) if len(keys) > 1 else keys[0]
        unique, inverse, counts, _ = self.storage.kernels.dedup_segments(all_keys, segments)
        counts, given = given_counts(keys, occurrences, inverse, counts)
        return key_bounds, segments, unique, inverse, counts, given

    def lookup_batch(self, keys: Sequence[torch.Tensor],
                     occurrences: Sequence[Optional[torch.Tensor]]) -> GroupBatch:
        """A read-only (eval) lookup of every table's ``keys``, as
        :mod:`dynemb.tables.group_eval` does on the host kernels, with nothing read back:
        found keys pinned until released, the others' eval rows in ``batch.fallback``."""
        storage = self.storage
        key_bounds, segments, unique, inverse, counts, given = self._dedup(keys, occurrences)
        seg = segments.table_of
        slots = torch.empty_like(unique)
        storage.kernels.find_group(storage.arrays, segments, self.row_offset, self.num_buckets,
                                   unique, slots)
        storage.kernels.add_refcounts(storage.arrays, slots, 1)
        batch = GroupBatch(storage, unique, inverse, counts, list(key_bounds), key_bounds, slots)
        batch.seg, batch.training = seg, False
        for table in storage.tables:
            table.hold_group_batch(batch)
        real = unique != EMPTY_KEY
        found = slots >= 0
        batch.fallback = torch.zeros(unique.numel(), storage.dim, device=self.device)
        storage.kernels.init_rows_at_group(
            batch.fallback, torch.arange(unique.numel(), device=self.device), unique,
            real & ~found, segments, storage.dim, self.seeds, self.table_ids, self.eval_kinds,
            *self.eval_params)
        if self.stores is not None:
            try:
                self.stores.read_into(unique, key_bounds, real & ~found, batch.fallback)
            except BaseException:  # a store failed (a disk): the pins end, nothing counted
                storage.release(batch)
                raise
        nothing = torch.zeros_like(found)  # an eval lookup inserts nothing: hits are finds
        self._count(segments, unique, slots, nothing, unique, given)
        return batch

    def prefetch(self, keys: Sequence[torch.Tensor], occurrences: Sequence[Optional[torch.Tensor]],
                 scores: Sequence[Optional[int]]) -> GroupBatch:
        """Claim and pin the rows of every table's ``keys`` (see ``TableGroup.prefetch``)."""
        storage = self.storage
        self.failures.check()
        key_bounds, segments, unique, inverse, counts, given = self._dedup(keys, occurrences)
        seg = segments.table_of
        claim_keys, fallback = unique, None
        if storage.admits:  # each table admits its keys as alone (the others: fallback rows)
            claim_keys, fallback = storage.admit(unique, counts, segments, self.row_offset,
                                                 self.num_buckets)
        if storage.growing:
            self._grow_before(claim_keys, key_bounds)
        slots, inserted, prev_keys, prev_scores = self.claim(segments, claim_keys, counts,
                                                             scores)
        batch = GroupBatch(storage, unique, inverse, counts, list(key_bounds), key_bounds, slots)
        batch.seg, batch.fallback = seg, fallback
        for table in storage.tables:
            table.hold_group_batch(batch)
        claim = (claim_keys, slots, inserted, prev_keys, prev_scores, key_bounds)
        undone = []

        def undo(tables) -> None:  # their rows could not be filled (a store raised)
            storage.undo_table_claims(batch, claim, tables)
            undone.extend(tables)
        try:
            storage.track_changes(claim)
            if self.stores is not None:  # each table writes back and loads, as alone
                self.stores.fill(claim, range(len(storage.tables)), undo)
            else:
                self.initialize(slots, claim_keys, inserted, segments)
        except Exception:
            if undone:  # the other tables' claims stand, filled: they count
                self._count(segments, unique, slots, inserted, prev_keys, given, undone)
            storage.release(batch)
            raise
        self._count(segments, unique, slots, inserted, prev_keys, given)
        return batch

    def initialize(self, slots, keys, inserted, segments: Segments) -> None:
        """Rows of the claimed ``keys`` where ``inserted`` start from their table's
        initializer (one launch; float16 / bfloat16 rows table by table)."""
        storage = self.storage
        if storage.row_dtype == torch.float32:
            storage.write_new_rows(lambda flat: storage.kernels.init_rows_at_group(
                flat.weights, slots, keys, inserted, segments, storage.dim, self.seeds,
                self.table_ids, self.init_kinds, *self.init_params), (slots, keys, inserted))
        else:
            storage.initialize_rows(slots, keys, inserted, segments.bounds)

    def _grow_before(self, unique, key_bounds) -> None:
        storage = self.storage
        storage.grow_before_claim(unique, key_bounds)  # (the parts are placed again lazily)

    def claim(self, segments, unique, counts, scores):
        """(slots, inserted, previous keys, previous scores) of one pinning claim of every
        table's ``unique`` keys (``EMPTY_KEY``: none; ``scores``: per table, the CUSTOMIZED
        score), each table at its next clock; the keys that found no slot go to
        :attr:`failures`. A table that grows and evicted a live key grows and the claim runs
        again (see the module docstring)."""
        storage = self.storage
        slots, prev_keys, prev_scores = (torch.empty_like(unique) for _ in range(3))
        inserted = torch.empty(unique.shape, dtype=torch.bool, device=self.device)
        failed = torch.empty_like(inserted)
        if storage.policy is ScorePolicy.CUSTOMIZED:  # each table's score, for its keys
            given = values_on(list(scores), torch.int64, self.device)[segments.table_of]
        else:
            given = unique.new_zeros(1).expand(unique.shape)
        stats = (torch.empty(len(storage.tables), 3, dtype=torch.int64, device=self.device)
                 if storage.growing else None)
        while True:
            clocks = self._ticked_clocks()
            storage.kernels.find_or_insert_group(
                storage.arrays, storage.arrays.size, segments, self.row_offset,
                self.num_buckets, unique, counts, given, storage.policy.code, clocks,
                storage.allows_eviction, slots, inserted, prev_keys, prev_scores, failed, stats)
            growth = [] if stats is None else storage.growth_after_claim(
                stats, grow_on_failure=False)  # failures are reported later, as alone
            if not growth:
                break
            storage.undo_claim(slots, inserted, prev_keys, prev_scores, stats[:, 0])
            storage.grow_tables(growth)
        self.failures.record(torch.zeros(len(storage.tables), dtype=torch.int64,
                                         device=self.device)
                             .index_add_(0, segments.table_of, failed.to(torch.int64)))
        return slots, inserted, prev_keys, prev_scores

    _clocks: Optional[torch.Tensor] = None  # the tables' clocks on the device
    _clock_values: Optional[list] = None  # what _clocks holds

    def _ticked_clocks(self) -> torch.Tensor:
        """Every table's clock after its tick, on the device. Where every clock moved by one
        since the last claim (each claim ticks them all), the device copy moves on there,
        nothing is sent; a clock moved otherwise (a load, a reset) is sent again."""
        ticked = [t.tier.hash.tick() for t in self.storage.tables]
        if self._clock_values is not None and ticked == [c + 1 for c in self._clock_values]:
            self._clocks = self._clocks + 1  # a new tensor: a launch may still read the old
        else:
            self._clocks = values_on(ticked, torch.int64, self.device)
        self._clock_values = ticked
        return self._clocks

    def _count(self, segments, unique, slots, inserted, prev_keys, given,
               skip: Sequence[int] = ()) -> None:
        """Every table's (but ``skip``'s) lookups, unique keys, hits, misses, inserts and
        evictions, added to its counters on the device in one launch."""
        counters = self.storage.counters
        if skip:
            counters = torch.zeros_like(counters)
        self.storage.kernels.add_claim_counts(segments, unique, slots, inserted, prev_keys,
                                              given, counters)
        if skip:
            counters[list(skip)] = 0
            self.storage.counters += counters
