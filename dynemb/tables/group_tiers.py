"""DEFAULT tables as one group (:mod:`dynemb.tables.groups`) in two records, one
:class:`~dynemb.tables.group_storage.GroupStorage` over the tables' device tiers (it keeps the
tables' counters) and one over their host tiers, each claimed, found and filled by its own
:class:`~dynemb.tables.group_prefetch.GroupPrefetch` (the path of every other group, on
the record's kernels). Each table does what a DEFAULT table does
(:mod:`dynemb.tables.tiered`), every phase in one call for all the tables:

- prefetch: one dedup of every table's keys (padded, in the bucket order of the device
  tiers); the lookups are counted, nothing is claimed;
- forward (:meth:`TieredBatch.lookup_occurrences`, :meth:`~TieredBatch.pooling_rows`): each
  unique key goes to the tier its table's capacities route it to
  (:func:`~dynemb.foundations.key_mixing.routes_to_first`); tables with admission admit their
  own keys (stored in either tier counts as stored); the host tiers claim their keys, then
  the device tiers; a key that finds no slot is handled by its record's failure policy
  (:mod:`dynemb.tables.group_failures`): on the host kernels both claims are undone and its
  table's ``TableFullError`` raised, on CUDA the device tiers' refused keys are served zeros
  and reported at a later prefetch; new rows start from each table's initializer; the rows
  are gathered from both records. An eval forward only finds the keys; those stored in
  neither tier read their table's eval initializer row;
- backward (:meth:`TieredBatch.apply_gradients`): one fused update in each record, of the
  rows still holding the batch's keys.

The claims stay in forward, as the design of the DEFAULT mode has its lookups
(docs/architecture.md says why); on CUDA the keys routed to the host tiers cross to the
host once per group and forward, and the host record serves its rows on the module's
device (:attr:`~dynemb.tables.group_storage.GroupStorage.serves_elsewhere`).

Example::

    >>> from dynemb.options import DynamicEmbTableOptions, choose_storage_mode
    >>> from dynemb.rows.optimizers import OptimizerConfig
    >>> from dynemb.tables import build_table
    >>> options = DynamicEmbTableOptions(global_hbm_for_values=128 * 16)  # 128 device rows
    >>> def table(name):
    ...     layout = choose_storage_mode(options, name=name, num_embeddings=1024, width=4,
    ...                                  config_dtype=torch.float32)
    ...     return build_table(name, 0, 4, layout, options, OptimizerConfig(),
    ...                        torch.device("cpu"))
    >>> group = TieredGroup([table("a"), table("b")])
    >>> batch = group.prefetch([torch.tensor([1, 2, 1]), torch.tensor([5])], [None, None],
    ...                        [None, None])
    >>> [rows.shape for rows in batch.lookup_occurrences()]
    [torch.Size([3, 4]), torch.Size([1, 4])]
    >>> [t.stats()["rows_device"] + t.stats()["rows_backing"] for t in group.tables]
    [2, 1]
"""
from __future__ import annotations

from typing import List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from dynemb.backends.protocol import Segments
from dynemb.foundations.counters import COUNTER_NAMES
from dynemb.foundations.key_mixing import routes_to_first
from dynemb.rows.optimizers import OccurrenceGrads
from dynemb.tables.base import DynamicTable
from dynemb.tables.batch import TableBatch
from dynemb.tables.group_batch import key_bounds_of, shifted_slots
from dynemb.tables.group_prefetch import Claim, GroupPrefetch, unique_per_table
from dynemb.tables.group_storage import GroupStorage, per_table_sums
from dynemb.tables.group_update import live_slots, update_rows
from dynemb.tables.lookup_batch import LookupBatch, PoolingRows
from dynemb.types import EMPTY_KEY

_COUNTER = {name: i for i, name in enumerate(COUNTER_NAMES)}


class TieredGroup:
    """DEFAULT tables in two records (see the module docstring): ``storage`` over their device
    tiers, ``host`` over their host tiers. A group as :mod:`dynemb.modules.batch_claims`
    runs it, whose prefetch claims nothing (the claim is in forward, as for a DEFAULT table alone)."""

    def __init__(self, tables: Sequence[DynamicTable], *, in_place: bool = False):
        self.storage = GroupStorage(tables, in_place=in_place)
        self.host = GroupStorage(tables, tier="host_tier", keeps_counters=False,
                                 in_place=in_place)
        #: each record's claim, fill, failure policy and per-table values (device, host)
        self.claims = (GroupPrefetch(self.storage), GroupPrefetch(self.host))

    def claims_of(self, record: GroupStorage) -> GroupPrefetch:
        """The claims (and per-table values) of ``record``, one of the group's two."""
        return self.claims[0] if record is self.storage else self.claims[1]

    @property
    def names(self) -> Tuple[str, ...]:
        return self.storage.names

    @property
    def tables(self) -> List[DynamicTable]:
        return self.storage.tables

    def intact(self, tables: Mapping[str, DynamicTable]) -> bool:
        """Whether ``tables`` still holds the group's tables, both tiers of each in their
        parts of the records."""
        return self.storage.intact(tables) and self.host.intact(tables)

    def live_batches(self) -> List["TieredBatch"]:
        return self.storage.live_batches()

    def view_parts_again(self) -> None:
        self.storage.view_parts_again()
        self.host.view_parts_again()

    # -- what a module's prefetch runs over (dynemb.modules.batch_claims) ---------------------
    def claims_apart(self) -> bool:
        """False: the prefetch claims nothing, so there is nothing to take back."""
        return False

    def prefetch(self, keys: Sequence[torch.Tensor],
                 occurrences: Sequence[Optional[torch.Tensor]],
                 scores: Sequence[Optional[int]]) -> "TieredBatch":
        """A training batch: every table's ``keys`` deduplicated and counted; the rows are
        claimed by its forward."""
        return self._batch(keys, occurrences, scores, training=True)

    claim_batch = prefetch

    def finish_batch(self, batch: "TieredBatch") -> "TieredBatch":
        return batch

    def undo_batch(self, batch: "TieredBatch") -> None:
        batch.release()

    def lookup_batch(self, keys: Sequence[torch.Tensor],
                     occurrences: Sequence[Optional[torch.Tensor]]) -> "TieredBatch":
        """A read-only (eval) batch: its forward finds the keys, and ends its pins once it
        has read the rows."""
        return self._batch(keys, occurrences, [None] * len(keys), training=False)

    def check_failures(self, wait: bool = False) -> None:
        """Raise the ``TableFullError`` of keys of earlier batches that found no slot, where
        the kernels report them later (:mod:`dynemb.tables.group_failures`; ``wait``: for
        the last batch's count too)."""
        for claims in self.claims:
            claims.failures.check(wait)

    def _batch(self, keys, occurrences, scores, training: bool) -> "TieredBatch":
        storage = self.storage
        key_bounds = key_bounds_of(keys)
        unique, inverse, counts, given = self.claims[0].dedup(keys, key_bounds, occurrences)
        batch = TieredBatch(self, unique, inverse, counts, key_bounds, training)
        batch.table_scores = list(scores)
        segments = Segments(key_bounds, storage.device)
        batch.unique_counts = unique_per_table(unique, segments)
        counted = torch.zeros(len(self.tables), len(COUNTER_NAMES), dtype=torch.int64,
                              device=unique.device)
        counted[:, _COUNTER["lookups"]] = per_table_sums(given, segments)
        counted[:, _COUNTER["unique_keys"]] = batch.unique_counts
        storage.counters += counted
        return batch

    def __repr__(self) -> str:
        return (f"TieredGroup({list(self.names)}, device rows={self.storage.row_offset[-1]}, "
                f"host rows={self.host.row_offset[-1]})")


class TieredBatch(LookupBatch):
    """A :class:`TieredGroup`'s share of a batch. ``keys`` / ``counts`` [U]: each table's
    unique keys, padded, table after table (table ``t``'s ``[unique_bounds[t],
    unique_bounds[t + 1])``, its key bounds); ``inverse`` [N] as for every batch. From its forward on:
    ``slots`` [U] rows of the device record, ``host_slots`` [U] rows of the host record (-1:
    the key is in the other tier, or not stored); ``fallback`` [U, dim] the rows of keys
    stored in neither (eval, admission), else None."""

    def __init__(self, group: TieredGroup, keys, inverse, counts, key_bounds: List[int],
                 training: bool):
        self.group = group
        self.mode = group.storage.mode
        self.keys, self.inverse, self.counts = keys, inverse, counts
        self.unique_bounds = self.key_bounds = key_bounds
        self.training = training
        self.table_scores: List[Optional[int]] = [None] * len(group.tables)
        self.unique_counts: Optional[torch.Tensor] = None  # [T] each table's unique keys
        self.slots = self.host_slots = self.fallback = None
        self.pinned = False
        self.unreleased: set = set()
        self.consumed = False
        self.applied: set = set()
        self.pending = None
        group.storage.batch_made(self)

    # -- members -------------------------------------------------------------------------------
    @property
    def names(self) -> Tuple[str, ...]:
        return self.group.names

    @property
    def dim(self) -> int:
        return self.group.storage.dim

    @property
    def device(self) -> torch.device:
        return self.group.storage.device

    @property
    def kernels(self):
        return self.group.storage.kernels

    def tensors(self) -> List[torch.Tensor]:
        """The tensors the module's device reads (the host slots stay on the host)."""
        return [t for t in (self.keys, self.inverse, self.counts, self.slots, self.host_slots,
                            self.fallback) if t is not None and t.device == self.device]

    def table_tensors(self, name: str) -> List[torch.Tensor]:
        t = self.group.storage.index[name]
        u0, u1 = self.unique_bounds[t], self.unique_bounds[t + 1]
        k0, k1 = self.key_bounds[t], self.key_bounds[t + 1]
        parts = [self.keys[u0:u1], self.inverse[k0:k1], self.counts[u0:u1]]
        return parts + [s[u0:u1] for s in (self.slots, self.host_slots, self.fallback)
                        if s is not None]

    def member(self, name: str) -> TableBatch:
        """Table ``name``'s part as a :class:`TableBatch` (its own slots in both tiers): a
        copy, for reading."""
        t = self.group.storage.index[name]
        u0, u1 = self.unique_bounds[t], self.unique_bounds[t + 1]
        k0, k1 = self.key_bounds[t], self.key_bounds[t + 1]
        keys = self.keys[u0:u1]
        batch = TableBatch(name, self.mode, self.training, keys, self.inverse[k0:k1] - u0,
                           self.counts[u0:u1], torch.tensor([keys.numel()]))
        if self.slots is not None:
            batch.slots = _local(self.slots[u0:u1], self.group.storage.row_offset[t])
            batch.host_slots = _local(self.host_slots[u0:u1], self.group.host.row_offset[t])
        if self.fallback is not None:
            batch.fallback = self.fallback[u0:u1]
        batch.pinned, batch.consumed = self.pinned, self.consumed
        batch.applied = name in self.applied
        return batch

    # -- forward -------------------------------------------------------------------------------
    def lookup_occurrences(self, sizes: Optional[Sequence[int]] = None
                           ) -> Tuple[torch.Tensor, ...]:
        rows = self._looked_up_rows(self.inverse)  # gathered per input key at once
        return rows.split(list(self._part_sizes(sizes)))

    def pooling_rows(self) -> PoolingRows:
        """The unique rows, pooled by the pooling kernel."""
        return PoolingRows(self._looked_up_rows(), self.inverse)

    def _looked_up_rows(self, index: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[len(index), dim] float32: the row of the unique key at each of ``index`` (None:
        every unique key's), claimed (training) or found (eval) at the first call; an eval
        batch ends its pins once it has read them. Each tier's float32 rows are gathered by
        the kernel (a key without a slot there: zeros), the host tier's on the host."""
        if self.slots is None:
            self._claim() if self.training else self._find()
        group = self.group
        storage, host, dim = group.storage, group.host, self.dim
        if index is None:
            index = torch.arange(self.keys.numel(), device=self.device)
        if storage.weights.dtype == torch.float32 and host.weights.dtype == torch.float32:
            # a key without a device row: its fallback row (eval, admission), else zeros;
            # the host tier's rows replace those of the keys it holds
            rows = torch.empty(index.numel(), dim, device=self.device)
            storage.kernels.gather_rows(storage.weights, self.slots, index, dim, rows,
                                        self.fallback)
            if not host.serves_elsewhere:  # over them in place: one pass over the keys each
                host.kernels.gather_rows(host.weights, self.host_slots, index, dim, rows,
                                         keep=True)
            else:
                host_rows = torch.empty(index.numel(), dim, device=host.device)
                host.kernels.gather_rows(host.weights, self.host_slots, index.to(host.device),
                                         dim, host_rows)
                on_host = (self.host_slots >= 0).to(self.device).index_select(0, index)
                rows = torch.where(on_host[:, None], host_rows.to(self.device,
                                                                  non_blocking=True), rows)
        else:  # float16 / bfloat16 rows
            on_host = (self.host_slots >= 0).to(self.device).index_select(0, index)[:, None]
            slots = self.slots.index_select(0, index)
            host_slots = self.host_slots.index_select(0, index.to(host.device))
            device_rows = storage.weights[:, :dim].index_select(0, slots.clamp(min=0))
            host_rows = host.weights[:, :dim].index_select(0, host_slots.clamp(min=0))
            rows = torch.where(on_host, host_rows.to(self.device, non_blocking=True),
                               torch.where((slots >= 0)[:, None], device_rows, 0)).float()
            if self.fallback is not None:  # keys stored in neither tier: their fallback row
                stored = on_host | (slots >= 0)[:, None]
                rows = torch.where(stored, rows, self.fallback.index_select(0, index))
        if not self.training:
            self.release()
        return rows

    def _routes(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(device keys [U], host keys [U] in host memory): each key in the tier its table
        routes it to, EMPTY_KEY in the other (on CUDA the host keys' copy waits for the
        device: one per group and forward)."""
        group = self.group
        device = self.keys.device
        sizes = torch.from_numpy(np.diff(np.asarray(self.unique_bounds, dtype=np.int64)))
        capacities = torch.tensor([[t.tier.hash.capacity, t.host_tier.hash.capacity]
                                   for t in group.tables], dtype=torch.int64)
        n = self.keys.numel()
        per_key = torch.repeat_interleave(capacities, sizes, dim=0, output_size=n).to(device)
        first, total = per_key[:, 0], per_key[:, 0] + per_key[:, 1]
        valid = self.keys != EMPTY_KEY
        on_device = valid & routes_to_first(self.keys, first, total)
        return (torch.where(on_device, self.keys, EMPTY_KEY),
                torch.where(valid & ~on_device, self.keys, EMPTY_KEY).to(group.host.device))

    def _segments(self, record: GroupStorage) -> Segments:
        return Segments(self.unique_bounds, record.device)

    def _find_in(self, record: GroupStorage, keys: torch.Tensor) -> torch.Tensor:
        """[U] the slots of ``keys`` (on ``record``'s device) in ``record``, or -1."""
        slots = torch.empty_like(keys)
        claims = self.group.claims_of(record)
        record.kernels.find_group(record.arrays, self._segments(record), claims.row_offset,
                                  claims.num_buckets, keys, slots)
        return slots

    def _per_table(self, values: torch.Tensor) -> torch.Tensor:
        """[T] ``values`` [U] summed per table, on the counters' device."""
        return per_table_sums(values, self._segments(self.group.storage))

    def _find(self) -> None:
        """The eval forward: find each key in its tier, pin it until the rows are read; the
        keys in neither read their table's eval initializer row."""
        group = self.group
        storage = group.storage
        dev_keys, host_keys = self._routes()
        slots, host_slots = self._find_in(storage, dev_keys), self._find_in(group.host,
                                                                            host_keys)
        storage.kernels.add_refcounts(storage.arrays, slots, 1)
        group.host.kernels.add_refcounts(group.host.arrays, host_slots, 1)
        self.slots, self.host_slots = slots, host_slots
        self._hold()
        stored = (slots >= 0) | (host_slots >= 0).to(self.device)
        self.fallback = group.claims_of(storage).eval_rows(self.keys, ~stored,
                                                           self._segments(storage))
        hits = self._per_table(stored & (self.keys != EMPTY_KEY))
        counted = torch.zeros_like(storage.counters)
        counted[:, _COUNTER["hits"]] = hits
        counted[:, _COUNTER["misses"]] = self.unique_counts - hits
        storage.counters += counted

    def _claim(self) -> None:
        """The training forward: admission, the host tiers' claim, then the device tiers'
        (see the module docstring), new rows initialized, the claims counted."""
        group = self.group
        storage, host = group.storage, group.host
        dev_keys, host_keys = self._routes()
        if storage.admits:
            present = ((self._find_in(storage, dev_keys) >= 0)
                       | (self._find_in(host, host_keys) >= 0).to(self.device))
            admitted, fallback = [], []
            for t, table in enumerate(group.tables):
                lo, hi = self.unique_bounds[t], self.unique_bounds[t + 1]
                yes, rows = table.admit(self.keys[lo:hi], self.counts[lo:hi], present[lo:hi])
                admitted.append(yes)
                fallback.append(rows)
            admitted = torch.cat(admitted)
            self.fallback = torch.cat(fallback).to(torch.float32)
            dev_keys = torch.where(admitted, dev_keys, EMPTY_KEY)
            host_keys = torch.where(admitted.to(host.device), host_keys, EMPTY_KEY)
        host_claim, host_refusing = group.claims_of(host).claim(
            self._segments(host), host_keys, self.counts.to(host.device), self.table_scores)
        device_claim, device_refusing = group.claims_of(storage).claim(
            self._segments(storage), dev_keys, self.counts, self.table_scores)
        if host_refusing is not None or device_refusing is not None:
            self._refuse(((host, host_claim, host_refusing),
                          (storage, device_claim, device_refusing)))
        self.slots, self.host_slots = device_claim.slots, host_claim.slots
        self._hold()
        hits_inserts_evictions = torch.zeros(len(group.tables), 3, dtype=torch.int64,
                                             device=self.device)
        for record, claim in ((storage, device_claim), (host, host_claim)):
            segments = self._segments(record)
            group.claims_of(record).track_changes(claim)
            group.claims_of(record).initialize(claim, segments)
            counts = torch.empty(len(group.tables), 3, dtype=torch.int64, device=record.device)
            record.kernels.claim_counts_group(segments, claim.slots, claim.inserted,
                                              claim.prev_keys, counts)
            hits_inserts_evictions += counts.to(self.device)
        hits = hits_inserts_evictions[:, 0]
        counted = torch.zeros_like(storage.counters)
        counted[:, _COUNTER["hits"]] = hits
        counted[:, _COUNTER["misses"]] = self.unique_counts - hits
        counted[:, _COUNTER["inserts"]] = hits_inserts_evictions[:, 1]
        counted[:, _COUNTER["evictions"]] = hits_inserts_evictions[:, 2]
        storage.counters += counted

    def _refuse(self, claims: Sequence[Tuple[GroupStorage, Claim, Optional[int]]]) -> None:
        """Undo the claims (``(record, claim, its first refusing table or None)``, host
        first) and raise the ``TableFullError`` a table alone raises first: the first table
        with a key that found no slot, in its host tier if one did there (alone, a table
        claims its host tier first)."""
        first = None
        for record, claim, refusing in claims:
            self.group.claims_of(record).undo(claim, self._segments(record))
            if refusing is not None and (first is None or refusing < first[0]):
                lo, hi = self.unique_bounds[refusing], self.unique_bounds[refusing + 1]
                keys, slots = claim.keys[lo:hi], claim.slots[lo:hi]
                first = (refusing, record, keys[(slots < 0) & (keys != EMPTY_KEY)])
        t, record, failed_keys = first
        table = record.tables[t]
        raise table.full_error(failed_keys, record.tier_of(table))

    # -- backward ------------------------------------------------------------------------------
    def applied_to(self, name: str) -> bool:
        return name in self.applied

    def apply_gradients(self, grads: OccurrenceGrads, taking: Sequence[bool], *, lr: float,
                        steps) -> None:
        """The fused update, in each record, of the rows of the tables ``taking`` a gradient
        that still hold the batch's keys (a batch whose pins ended counts the others as
        dropped updates), each table at its own step; then those tables' pins end."""
        group = self.group
        if self.slots is not None:
            for record, slots in ((group.storage, self.slots), (group.host, self.host_slots)):
                slots = live_slots(record, slots, self, group.storage.counters)
                update_rows(record, slots, self, grads, taking, lr=lr, steps=steps)
        self.applied.update(name for name, takes in zip(group.names, taking) if takes)
        for table, takes in zip(group.tables, taking):
            if takes and table.changes is not None and self.slots is not None:
                table.changes.updated(self.member(table.name))
        self.end_pins([t for t, takes in enumerate(taking) if takes])

    # -- pins ----------------------------------------------------------------------------------
    def _hold(self) -> None:
        self.pinned = True
        self.unreleased = set(range(len(self.group.tables)))
        for table in self.group.tables:
            table.hold_group_batch(self)

    def release(self) -> None:
        """End the batch's pins, for every member (once)."""
        self.end_pins()

    def end_pins(self, tables: Optional[Sequence[int]] = None) -> None:
        """End the pins of ``tables`` (indices; None: all) in both records, once per table."""
        if not self.pinned:
            return
        ending = set(self.unreleased) if tables is None else self.unreleased.intersection(tables)
        if not ending:
            return
        group = self.group
        group.storage.unpin(self.slots, self.unique_bounds, ending)
        group.host.unpin(self.host_slots, self.unique_bounds, ending)
        self.unreleased -= ending
        for t in ending:
            group.tables[t].drop_group_batch(self)
        self.pinned = bool(self.unreleased)

    def end_pins_alone(self) -> None:
        """End the pins table by table, in each table's own tiers (its group is gone)."""
        group = self.group
        for t in sorted(self.unreleased):
            table = group.tables[t]
            lo, hi = self.unique_bounds[t], self.unique_bounds[t + 1]
            table.tier.hash.release(_local(self.slots[lo:hi], group.storage.row_offset[t]))
            table.host_tier.hash.release(_local(self.host_slots[lo:hi],
                                                group.host.row_offset[t]))
            table.drop_group_batch(self)
        self.unreleased = set()
        self.pinned = False

    def rehome(self, groups: Sequence) -> bool:
        """Its own group, or a new one of the same tables (whose records hold the tables'
        tiers where the old ones did, as they moved with them): the slots are renumbered."""
        if any(group is self.group for group in groups):
            return True
        for group in groups:
            if isinstance(group, TieredGroup) and group.tables == self.group.tables:
                if self.slots is not None:
                    self.slots = shifted_slots(self.slots, self.unique_bounds,
                                          self.group.storage.row_offset,
                                          group.storage.row_offset)
                    self.host_slots = shifted_slots(self.host_slots, self.unique_bounds,
                                               self.group.host.row_offset, group.host.row_offset)
                self.group = group
                return True
        return False

    def table_remapped(self, name: str, remap: torch.Tensor) -> None:
        """A direct ``grow`` of member ``name``'s device tier moved its rows by ``remap``."""
        if self.slots is None:
            return
        t = self.group.storage.index[name]
        lo, hi = self.unique_bounds[t], self.unique_bounds[t + 1]
        start = self.group.storage.row_offset[t]
        part = self.slots[lo:hi]
        moved = torch.where(part >= 0, remap[(part - start).clamp(min=0)] + start, -1)
        self.slots = torch.cat([self.slots[:lo], moved, self.slots[hi:]])

    def rows_moved(self, storage, old_offsets: Sequence[int]) -> None:
        if self.slots is None:
            return
        if storage is self.group.storage:
            self.slots = shifted_slots(self.slots, self.unique_bounds, old_offsets,
                                  storage.row_offset)
        elif storage is self.group.host:
            self.host_slots = shifted_slots(self.host_slots, self.unique_bounds, old_offsets,
                                       storage.row_offset)


def _local(slots: torch.Tensor, start: int) -> torch.Tensor:
    """Record slots as a table's own (its part starts at ``start``); -1 stays."""
    return torch.where(slots >= 0, slots - start, -1)
