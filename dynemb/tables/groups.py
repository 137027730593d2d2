"""Table groups: tables of one shape that train as one, one kernel call per phase.

A module's tables that agree on everything the kernels read
(:func:`~dynemb.tables.grouping.group_signature`) form a :class:`TableGroup`; a table with
no partner is a group of one, on the same path. The group's tables live in one record
(:class:`~dynemb.tables.group_storage.GroupStorage`: one set of arrays, each table in its
own part; the tables' hash tables, flat tables and counters are views of their parts, so
everything read per table is unchanged). The group is the record and its training prefetch
and eval lookup, one code path on every kernel backend: one dedup, one claim, one fill and
one count for all its tables, each with the results its table alone would give, and nothing
read back on the host that a steady step does not need. A batch is a
:class:`~dynemb.tables.group_batch.GroupBatch` (its gather, its backward's fused update and
its release); keys that find no slot,
:mod:`dynemb.tables.group_failures`; a CACHE group's stores,
:mod:`dynemb.tables.group_stores`. DEFAULT tables group as two of these behind a router
(:mod:`dynemb.tables.group_tiers`).

- **Shapes.** Each table's unique keys are padded to its number of input keys (``EMPTY_KEY``,
  count 0, slot -1), so every tensor of a step has a shape set by the batch
  (``dedup_segments``).
- **Per-table values** (where each table's part starts, its buckets, clocks, seeds,
  initializers) are tensors on the group's device, made once per layout of the group; the
  clocks move on there.
- **Refused keys** are counted on the device; when that count becomes an error is
  :class:`~dynemb.tables.group_failures.GroupFailures`' one policy.
- **Counters** are added on the device, one kernel call per claim.

What the host reads, it reads because a table alone reads it: a group with a table that grows
reads its size and, where its keys could pass its load factor, how many of them it misses,
before the claim, and whether the claim evicted a live key below its ``max_capacity`` after
it (then the claim is undone, the table grown in the group, and the claim runs again). A
CACHE group's stores are in host memory: after the claim each table writes back the rows it
evicted and loads the keys it inserted (:class:`~dynemb.tables.group_stores.GroupStores`);
an eval lookup reads the keys missing from the cache from the stores the same way.

The claim and the fill are apart, so that a module's prefetch can claim every group of a batch
before it fills any, and take back what it claimed when one refuses:
:meth:`TableGroup.claim_batch` claims and pins, :meth:`~TableGroup.finish_batch` fills
the claimed rows and counts them, :meth:`~TableGroup.undo_batch` takes a claim back exactly.

Example::

    >>> from dynemb.options import DynamicEmbTableOptions, choose_storage_mode
    >>> from dynemb.rows.optimizers import OptimizerConfig
    >>> from dynemb.tables import build_table
    >>> def table(name):
    ...     layout = choose_storage_mode(DynamicEmbTableOptions(), name=name, num_embeddings=512,
    ...                                  width=4, config_dtype=torch.float32)
    ...     return build_table(name, 0, 4, layout, DynamicEmbTableOptions(), OptimizerConfig(),
    ...                        torch.device("cpu"))
    >>> group = TableGroup([table("a"), table("b")])
    >>> batch = group.prefetch([torch.tensor([3, 3, 7]), torch.tensor([5])], [None, None],
    ...                        [None, None])
    >>> [rows.shape for rows in batch.lookup_occurrences()]
    [torch.Size([3, 4]), torch.Size([1, 4])]
    >>> [t.stats()["rows_device"] for t in group.tables]
    [2, 1]
"""
from __future__ import annotations

from typing import List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch

from dynemb.backends.device_values import values_on
from dynemb.backends.protocol import Segments
from dynemb.foundations.counters import COUNTER_NAMES
from dynemb.options import StorageMode
from dynemb.tables.base import DynamicTable
from dynemb.tables.group_batch import GroupBatch, key_bounds_of
from dynemb.tables.group_failures import GroupFailures
from dynemb.tables.group_storage import GroupStorage, per_table_sums
from dynemb.tables.group_stores import GroupStores
from dynemb.types import EMPTY_KEY, TOMBSTONE_KEY, ScorePolicy

#: The counters a prefetch adds to (``add_claim_counts``), in its order: the first columns of
#: the counters.
PREFETCH_COUNTERS = ("lookups", "unique_keys", "hits", "misses", "inserts", "evictions")
assert COUNTER_NAMES[:len(PREFETCH_COUNTERS)] == PREFETCH_COUNTERS


def given_counts(keys: Sequence[torch.Tensor], occurrences: Sequence[Optional[torch.Tensor]],
                 inverse: torch.Tensor, counts: torch.Tensor):
    """(counts, the occurrences concatenated): where ids were deduplicated upstream, each
    stands for its given number of occurrences (None for a table: 1 each); with no
    occurrences at all, ``(counts, None)`` unchanged."""
    if all(o is None for o in occurrences):
        return counts, None
    given = torch.cat([o if o is not None else torch.ones_like(k)
                       for o, k in zip(occurrences, keys)])
    return torch.zeros_like(counts).index_add_(0, inverse, given), given


def unique_per_table(keys: torch.Tensor, segments: Segments) -> torch.Tensor:
    """[T] int64, on ``keys``' device: each table's unique keys among ``keys`` [U] of
    :meth:`TableGroup.dedup` (``EMPTY_KEY`` pads; no host read)."""
    return per_table_sums(keys != EMPTY_KEY, segments)


class Claim(NamedTuple):
    """One pinning claim of a group's keys, entry by entry: ``slots`` (-1: none),
    ``inserted`` (a slot taken for the key), what the slot held before (``prev_keys``,
    ``prev_scores``), and the tables' ``bounds`` of the entries."""
    keys: torch.Tensor
    slots: torch.Tensor
    inserted: torch.Tensor
    prev_keys: torch.Tensor
    prev_scores: torch.Tensor
    bounds: Sequence[int]


class TableGroup:
    """Tables of one :func:`~dynemb.tables.grouping.group_signature` in one record, a
    :class:`~dynemb.tables.group_storage.GroupStorage` (building it copies each table into
    its part of it; ``tier``, ``keeps_counters``, ``in_place``: see the record), and its
    training prefetch and eval lookup (see the module docstring); through the batches it
    makes, the update and the release."""

    def __init__(self, tables: Sequence[DynamicTable], *, in_place: bool = False,
                 tier: str = "tier", keeps_counters: bool = True):
        self.storage = storage = GroupStorage(tables, tier=tier, keeps_counters=keeps_counters,
                                              in_place=in_place)
        #: a CACHE group's stores (None in the other modes)
        self.stores = GroupStores(storage) if storage.mode is StorageMode.CACHE else None
        self.device = device = storage.device
        tables = storage.tables
        self.seeds = values_on([t.options.seed for t in tables], torch.int64, device)
        self.table_ids = values_on([t.table_id for t in tables], torch.int64, device)
        self.init_kinds, self.init_params = _initializers(
            [t.options.initializer for t in tables], device)
        self.eval_kinds, self.eval_params = _initializers(
            [t.options.eval_initializer for t in tables], device)
        self.failures = GroupFailures(storage.names, storage.kernels, device)
        self._place_tables()

    _placed = None  # the storage's layout the device values below are of
    _clocks: Optional[torch.Tensor] = None  # the tables' clocks on the device
    _clock_values: Optional[list] = None  # what _clocks holds

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

    @property
    def names(self) -> Tuple[str, ...]:
        return self.storage.names

    @property
    def tables(self) -> List[DynamicTable]:
        return self.storage.tables

    def intact(self, tables: Mapping[str, DynamicTable]) -> bool:
        """Whether ``tables`` still holds the group's tables, each in its part of the group's
        arrays (see :meth:`GroupStorage.intact`)."""
        return self.storage.intact(tables)

    def live_batches(self) -> List[GroupBatch]:
        """The group's batches still referenced anywhere, their pins ended or not: a late
        backward of one updates the rows still holding its keys."""
        return self.storage.live_batches()

    def view_parts_again(self) -> None:
        """After unpickling (see :meth:`GroupStorage.view_parts_again`)."""
        self.storage.view_parts_again()

    def claims_apart(self) -> bool:
        """Whether :meth:`claim_batch` only claims (:meth:`undo_batch` takes it back
        exactly): for tables without admission (which counts keys before it claims)."""
        return not self.storage.admits

    def check_failures(self, wait: bool = False) -> None:
        """Raise the ``TableFullError`` of keys of earlier batches that found no slot, where
        the kernels report them later (:mod:`dynemb.tables.group_failures`; ``wait``: for
        the last batch's count too)."""
        self.failures.check(wait)

    def __repr__(self) -> str:
        return f"TableGroup({list(self.names)}, rows={self.storage.row_offset[-1]})"

    # -- training ------------------------------------------------------------------------------
    def claim_batch(self, keys: Sequence[torch.Tensor],
                    occurrences: Sequence[Optional[torch.Tensor]],
                    scores: Sequence[Optional[int]]) -> GroupBatch:
        """Claim and pin the rows of every table's ``keys`` (one tensor per table, group
        order; ``occurrences``: per table, what each id stands for, None: 1; ``scores``: per
        table, the CUSTOMIZED score). The rows are neither filled nor counted yet.

        A key that finds no slot: at once (host kernels), the claim is undone and the first
        refusing table's ``TableFullError`` raised, the group unchanged; later (CUDA), the
        key is served zeros and its table raises at a later prefetch. Tables with admission
        claim only the keys they admit (the others read their ``fallback`` row, as alone);
        their admission counts stay."""
        storage = self.storage
        self.failures.check()
        key_bounds = key_bounds_of(keys)
        segments = Segments(key_bounds, self.device)
        unique, inverse, counts, given = self.dedup(keys, key_bounds, occurrences)
        claim_keys, fallback = unique, None
        if storage.admits:  # each table admits its keys as alone (the others: fallback rows)
            present = self.find(unique, segments) >= 0
            claim_keys, fallback = self.admit(unique, counts, present, segments)
        self._grow_before_claim(claim_keys, key_bounds)
        claim, refusing = self.claim(segments, claim_keys, counts, scores)
        if refusing is not None:
            self.undo(claim, segments)
            raise self.refusal(claim, refusing)
        batch = GroupBatch(storage, unique, inverse, counts, key_bounds, key_bounds,
                           claim.slots)
        batch.fallback = fallback
        storage.batch_made(batch)
        for table in storage.tables:
            table.hold_group_batch(batch)
        batch.pending = (claim, segments, given)
        return batch

    def finish_batch(self, batch: GroupBatch) -> GroupBatch:
        """Fill the rows :meth:`claim_batch` claimed (CACHE: write-backs and loads, else the
        initializers) and count them. If a store fails, the tables it could not fill give
        their claims back, the others count theirs, and every pin ends."""
        if batch.pending is None:
            return batch
        storage = self.storage
        claim, segments, given = batch.pending
        batch.pending = None
        undone = []

        def undo(tables) -> None:  # their rows could not be filled (a store raised)
            self.undo(claim, segments, tables, batch)
            undone.extend(tables)
        try:
            self.track_changes(claim)
            if self.stores is not None:  # each table writes back and loads, as alone
                self.stores.fill(claim, segments, undo, self.initialize_rows)
            else:
                self.initialize(claim, segments)
        except Exception:
            if undone:  # the other tables' claims stand, filled: they count
                self._count(segments, batch.keys, claim, given, undone)
            storage.release(batch)
            raise
        self._count(segments, batch.keys, claim, given)
        return batch

    def undo_batch(self, batch: GroupBatch) -> None:
        """Take back a :meth:`claim_batch` that :meth:`finish_batch` did not follow: keys,
        scores, sizes, clocks and pins as before it. A finished batch's pins just end."""
        if batch.pending is None:
            self.storage.release(batch)
            return
        claim, segments, _ = batch.pending
        batch.pending = None
        self.undo(claim, segments, batch=batch)

    def prefetch(self, keys: Sequence[torch.Tensor], occurrences: Sequence[Optional[torch.Tensor]],
                 scores: Sequence[Optional[int]]) -> GroupBatch:
        """:meth:`claim_batch` then :meth:`finish_batch`."""
        return self.finish_batch(self.claim_batch(keys, occurrences, scores))

    def claim(self, segments: Segments, keys: torch.Tensor, counts: torch.Tensor,
              scores: Sequence[Optional[int]]) -> Tuple[Claim, Optional[int]]:
        """One pinning claim of every table's ``keys`` (``EMPTY_KEY``: none; ``scores``: per
        table, the CUSTOMIZED score), each table at its next clock, and the table that
        refuses it at once (:class:`GroupFailures`; then the caller undoes the claim), or
        None. A table that grows and evicted a live key (or, failing at once, found no slot
        for one) grows and the claim runs again (see the module docstring)."""
        storage = self.storage
        slots, prev_keys, prev_scores = (torch.empty_like(keys) for _ in range(3))
        inserted = torch.empty(keys.shape, dtype=torch.bool, device=self.device)
        failed = torch.empty_like(inserted)
        if storage.policy is ScorePolicy.CUSTOMIZED:  # each table's score, for its keys
            given = values_on(list(scores), torch.int64, self.device)[segments.table_of]
        else:
            given = keys.new_zeros(1).expand(keys.shape)
        stats = (torch.empty(len(storage.tables), 3, dtype=torch.int64, device=self.device)
                 if storage.growing else None)
        claim = Claim(keys, slots, inserted, prev_keys, prev_scores, segments.bounds)
        while True:
            clocks = self._ticked_clocks()
            storage.kernels.find_or_insert_group(
                storage.arrays, storage.arrays.size, segments, self.row_offset,
                self.num_buckets, keys, counts, given, storage.policy.code, clocks,
                storage.allows_eviction, slots, inserted, prev_keys, prev_scores, failed, stats)
            growth = [] if stats is None else self._growth_after_claim(stats)
            if not growth:
                break
            self.undo(claim, segments)
            storage.grow_tables(growth)
        return claim, self.failures.first_refusing(per_table_sums(failed, segments))

    def initialize(self, claim: Claim, segments: Segments) -> None:
        """Rows of the claimed keys where ``inserted`` start from their table's initializer."""
        self.initialize_rows(claim.slots, claim.keys, claim.inserted, segments)

    def initialize_rows(self, slots, keys, mask, segments: Segments) -> None:
        """Rows ``slots`` of ``keys`` where ``mask`` start from their table's initializer
        (one call; float16 / bfloat16 rows table by table)."""
        storage = self.storage
        if storage.row_dtype == torch.float32:
            storage.write_new_rows(lambda flat: storage.kernels.init_rows_at_group(
                flat.weights, slots, keys, mask, segments, storage.dim, self.seeds,
                self.table_ids, self.init_kinds, *self.init_params), (slots, keys, mask))
            return
        bounds = segments.bounds
        for t, table in enumerate(storage.tables):  # float16 / bfloat16 rows: table by table
            lo, hi = int(bounds[t]), int(bounds[t + 1])
            local = torch.where(slots[lo:hi] >= 0, slots[lo:hi] - storage.row_offset[t], -1)
            storage.tier_of(table).flat.initialize_where(
                local, keys[lo:hi], mask[lo:hi], table.options.initializer,
                seed=table.options.seed, table_id=table.table_id)

    def undo(self, claim: Claim, segments: Segments, tables: Optional[Sequence[int]] = None,
             batch=None) -> None:
        """Undo the part of a pinning ``claim`` (``segments``: its tables' entries) of
        ``tables`` (indices; None: all): the keys it evicted are back with their rows, which
        nothing overwrote; sizes, scores, pins and clocks as before it, and ``batch``'s pins
        of those tables (if given) end. The other tables keep their claims."""
        storage = self.storage
        table_of = segments.table_of
        if tables is None:
            tables = range(len(storage.tables))
            mine = torch.ones_like(claim.inserted)
        else:
            chosen = torch.zeros(len(storage.tables), dtype=torch.bool)
            chosen[list(tables)] = True
            mine = chosen.to(self.device)[table_of]
        a = storage.arrays
        slots, prev_keys = claim.slots, claim.prev_keys
        back = claim.inserted & mine
        a.keys[slots[back]] = prev_keys[back]
        placed = (slots >= 0) & mine
        a.scores[slots[placed]] = claim.prev_scores[placed]
        added = back & ((prev_keys == EMPTY_KEY) | (prev_keys == TOMBSTONE_KEY))
        a.size.sub_(torch.zeros_like(a.size).index_add_(0, table_of, added.to(a.size.dtype)))
        storage.kernels.add_refcounts(a, torch.where(mine, slots, -1), -1)
        for t in tables:
            storage.tier_of(storage.tables[t]).hash.untick()
        if batch is not None:
            for t in tables:
                storage.tables[t].drop_group_batch(batch)
            batch.unreleased -= set(tables)
            batch.pinned = bool(batch.unreleased)

    def track_changes(self, claim: Claim) -> None:
        """Tables tracking their changes for checkpoint deltas mark the slots claimed."""
        storage = self.storage
        for t, table in enumerate(storage.tables):
            if table.changes is not None:
                table.changes.claimed(storage.tier_of(table), storage.table_claim(claim, t))

    # -- what a claim reads first ----------------------------------------------------------
    def dedup(self, keys: Sequence[torch.Tensor], key_bounds: List[int],
              occurrences: Sequence[Optional[torch.Tensor]]):
        """(unique keys, inverse, counts, the occurrences given or None, see
        :func:`given_counts`) of every table's keys: table ``t``'s unique keys at
        ``key_bounds[t]:``, padded with ``EMPTY_KEY`` to its number of keys (the kernels'
        ``dedup_segments``); the inverse on the module's device, the rest on the record's.
        Each table's keys come in the order of its slots where the kernels order them (the
        host kernels: by bucket), so the claim and the update walk its rows front to back.

        Rows served elsewhere dedup where the module is, as each table alone there does,
        and cross to the record once."""
        storage = self.storage
        all_keys = torch.cat(list(keys)) if len(keys) > 1 else keys[0]
        kernels, device = ((storage.serve_kernels, storage.serve_device)
                           if storage.serves_elsewhere else (storage.kernels, self.device))
        unique, inverse, counts, _ = kernels.dedup_segments(
            all_keys, Segments(key_bounds, device), storage.bucket_counts)
        counts, given = given_counts(keys, occurrences, inverse, counts)
        if storage.serves_elsewhere:
            unique, counts = unique.to(self.device), counts.to(self.device)
            given = None if given is None else given.to(self.device)
        return unique, inverse, counts, given

    def admit(self, unique: torch.Tensor, counts: torch.Tensor, present: torch.Tensor,
              segments: Segments):
        """Admission of a training batch's unique keys (``present``: those stored already):
        ``(the keys to claim, the others EMPTY_KEY; every key's fallback row [U, dim])``.
        Each table admits its own keys through its own counter, as alone."""
        bounds = segments.bounds.tolist()
        admitted, fallback = [], []
        for t, table in enumerate(self.storage.tables):  # on the table's device, as alone
            lo, hi = bounds[t], bounds[t + 1]
            yes, rows = table.admit(*(x[lo:hi].to(table.device) for x in (unique, counts,
                                                                           present)))
            admitted.append(yes.to(unique.device))
            fallback.append(rows)
        if len(admitted) > 1:  # (a copy: not for a group of one)
            admitted, fallback = [torch.cat(admitted)], [torch.cat(fallback)]
        return torch.where(admitted[0], unique, EMPTY_KEY), fallback[0].to(torch.float32)

    def find(self, keys: torch.Tensor, segments: Segments, pin: bool = False) -> torch.Tensor:
        """[U] the slots of ``keys`` (``EMPTY_KEY``: none), or -1 where a table does not
        hold its key; ``pin``: the found rows stay pinned until the batch's pins end."""
        slots = torch.empty_like(keys)
        self.storage.kernels.find_group(self.storage.arrays, segments, self.row_offset,
                                        self.num_buckets, keys, slots)
        if pin:
            self.storage.kernels.add_refcounts(self.storage.arrays, slots, 1)
        return slots

    def refusal(self, claim: Claim, t: int):
        """The ``TableFullError`` of table ``t``'s keys of ``claim`` that found no slot (the
        claim undone), as the table alone raises it."""
        lo, hi = int(claim.bounds[t]), int(claim.bounds[t + 1])
        keys, slots = claim.keys[lo:hi], claim.slots[lo:hi]
        table = self.storage.tables[t]
        return table.full_error(keys[(slots < 0) & (keys != EMPTY_KEY)],
                                self.storage.tier_of(table))

    def _grow_before_claim(self, keys: torch.Tensor, bounds: Sequence[int]) -> None:
        """Grow the tables that grow whose keys of a claim (``keys``, table ``t``'s at
        ``bounds[t]:bounds[t + 1]``; ``EMPTY_KEY`` padding claims nothing) missing from
        them would pass their load factor, as each would alone before its claim. Only a
        table whose size and keys together could pass it looks its keys up (reading back
        from the device, as the table alone does)."""
        storage = self.storage
        if not storage.growing:
            return
        sizes = storage.arrays.size.tolist()
        growth = []
        for t in storage.growing:
            hash_table = storage.tier_of(storage.tables[t]).hash
            lo, hi = bounds[t], bounds[t + 1]
            if sizes[t] + hi - lo > hash_table.grow_at_load_factor * hash_table.capacity:
                capacity = hash_table.capacity_to_claim(keys[lo:hi])
                if capacity is not None:
                    growth.append((t, capacity))
        if growth:
            storage.grow_tables(growth)

    def _growth_after_claim(self, stats: torch.Tensor) -> List[Tuple[int, int]]:
        """``[(table, capacity)]`` of the tables that grow where a claim (its per-table
        ``stats``: keys added, live keys evicted, keys failed; read back from the device)
        evicted a live key (or, where refused keys raise at once, found no slot for one)
        below their ``max_capacity``: one doubling, as each table alone grows (the load
        factor was settled before the claim)."""
        storage = self.storage
        per_table = stats.tolist()
        growth = []
        for t in storage.growing:
            _, evicted, failed = per_table[t]
            displaced = evicted + (failed if self.failures.at_once else 0)
            capacity = storage.tier_of(storage.tables[t]).hash.capacity_to_grow_to(
                0, displaced > 0)
            if capacity is not None:
                growth.append((t, capacity))
        return growth

    def _ticked_clocks(self) -> torch.Tensor:
        """Every table's clock after its tick, on the device. Where every clock moved by one
        since the last claim (each claim ticks them all), the device copy moves on there,
        nothing is sent; a clock moved otherwise (a load, a reset, an undo) is sent again."""
        storage = self.storage
        ticked = [storage.tier_of(t).hash.tick() for t in storage.tables]
        if self._clock_values is not None and ticked == [c + 1 for c in self._clock_values]:
            self._clocks = self._clocks + 1  # a new tensor: a launch may still read the old
        else:
            self._clocks = values_on(ticked, torch.int64, self.device)
        self._clock_values = ticked
        return self._clocks

    def _count(self, segments: Segments, unique: torch.Tensor, claim: Claim,
               given: Optional[torch.Tensor], skip: Sequence[int] = ()) -> None:
        """Every table's (but ``skip``'s) lookups, unique keys, hits, misses, inserts and
        evictions, added to its counters on the device in one call."""
        counters = self.storage.counters
        if skip:
            counters = torch.zeros_like(counters)
        self.storage.kernels.add_claim_counts(segments, unique, claim.slots, claim.inserted,
                                              claim.prev_keys, given, counters)
        if skip:
            counters[list(skip)] = 0
            self.storage.counters += counters

    # -- eval ----------------------------------------------------------------------------------
    def lookup_batch(self, keys: Sequence[torch.Tensor],
                     occurrences: Sequence[Optional[torch.Tensor]]) -> GroupBatch:
        """A read-only (eval) lookup of every table's ``keys``: each table's rows, counters
        and pins are those its own eval lookup gives: found keys pinned until released, the
        others read their table's ``eval_initializer`` row (a CACHE table's key missing from
        the cache: its store's row where the store has it), in ``batch.fallback``; nothing
        is inserted or rescored."""
        storage = self.storage
        key_bounds = key_bounds_of(keys)
        segments = Segments(key_bounds, self.device)
        unique, inverse, counts, given = self.dedup(keys, key_bounds, occurrences)
        slots = self.find(unique, segments, pin=True)  # pinned until the rows are read
        batch = GroupBatch(storage, unique, inverse, counts, key_bounds, key_bounds, slots)
        batch.training = False
        storage.batch_made(batch)
        for table in storage.tables:
            table.hold_group_batch(batch)
        missing = (unique != EMPTY_KEY) & (slots < 0)
        batch.fallback = self.eval_rows(unique, missing, segments)
        if self.stores is not None:
            try:
                self.stores.read_into(unique, key_bounds, missing, batch.fallback)
            except BaseException:  # a store failed (a disk): the pins end, nothing counted
                storage.release(batch)
                raise
        nothing = torch.zeros_like(missing)  # an eval lookup inserts nothing: hits are finds
        self._count(segments, unique, Claim(unique, slots, nothing, unique, unique, key_bounds),
                    given)
        return batch

    def eval_rows(self, keys: torch.Tensor, where: torch.Tensor,
                  segments: Segments) -> torch.Tensor:
        """[U, dim] float32: the eval initializer's rows of ``keys`` where ``where``, each from
        its own table's. The other rows are not written (a key with a row reads its row: see
        the fallback of the kernels' ``gather_rows``), so that a batch's padding costs no
        memory traffic."""
        rows = torch.empty(keys.numel(), self.storage.dim, device=self.device)
        self.storage.kernels.init_rows_at_group(
            rows, torch.arange(keys.numel(), device=self.device), keys, where, segments,
            self.storage.dim, self.seeds, self.table_ids, self.eval_kinds, *self.eval_params)
        return rows


def _initializers(initializers, device: torch.device):
    """(kinds [T], [p0, p1, low, high] each [T]) of the tables' initializers, on ``device``."""
    params = [init.kernel_params() for init in initializers]
    kinds = values_on([p[0] for p in params], torch.int64, device)
    return kinds, [values_on([p[i] for p in params], torch.float64, device)
                   for i in range(1, 5)]
