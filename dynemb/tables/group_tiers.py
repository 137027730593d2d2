"""DEFAULT tables as one group: two :class:`~dynemb.tables.groups.TableGroup` behind a
router, one over the tables' device tiers (its record keeps the tables' counters) and one over
their host tiers, each claiming, finding, filling, updating and releasing its tier's rows on
the path of every other group, on its record's kernels; a batch is two
:class:`~dynemb.tables.group_batch.GroupBatch` (one per tier) behind the router. Each table
does what a DEFAULT table does (:mod:`dynemb.tables.tiered`), every phase in one call for all
the tables:

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
  rows still holding the batch's keys; pins end in each record.

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

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from dynemb.backends.protocol import Segments
from dynemb.foundations.counters import COUNTER_NAMES
from dynemb.rows.optimizers import OccurrenceGrads
from dynemb.tables.base import DynamicTable
from dynemb.tables.group_batch import GroupBatch, key_bounds_of, live_slots, update_rows
from dynemb.tables.group_storage import per_table_sums
from dynemb.tables.groups import TableGroup, unique_per_table
from dynemb.tables.lookup_batch import LookupBatch, PoolingRows, TableBatch
from dynemb.types import EMPTY_KEY

_COUNTER = {name: i for i, name in enumerate(COUNTER_NAMES)}


class TieredGroup:
    """DEFAULT tables as two groups (see the module docstring): ``tiers``, the group of their
    device tiers and the group of their host tiers. A group as
    :mod:`dynemb.modules.batch_claims` runs it, whose prefetch claims nothing (the claim is
    in forward, as for a DEFAULT table alone)."""

    def __init__(self, tables: Sequence[DynamicTable], *, in_place: bool = False):
        self.tiers = (TableGroup(tables, in_place=in_place),
                      TableGroup(tables, in_place=in_place, tier="host_tier",
                                 keeps_counters=False))
        #: the device tiers' record: the tables' counters, the rows a stash moves
        self.storage = self.tiers[0].storage
        self._tier_rows_of: Optional[Tuple[int, int]] = None  # the layouts _tier_rows is of

    @property
    def names(self) -> Tuple[str, ...]:
        return self.storage.names

    @property
    def tables(self) -> List[DynamicTable]:
        return self.storage.tables

    def intact(self, tables: Mapping[str, DynamicTable]) -> bool:
        """Whether ``tables`` still holds the group's tables, both tiers of each in their
        parts of the records."""
        return all(tiers.intact(tables) for tiers in self.tiers)

    def live_batches(self) -> List["TieredBatch"]:
        return self.storage.live_batches()

    def view_parts_again(self) -> None:
        for tiers in self.tiers:
            tiers.view_parts_again()

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
        for tiers in self.tiers:
            tiers.check_failures(wait)

    def _batch(self, keys, occurrences, scores, training: bool) -> "TieredBatch":
        storage = self.storage
        key_bounds = key_bounds_of(keys)
        unique, inverse, counts, given = self.tiers[0].dedup(keys, key_bounds, occurrences)
        batch = TieredBatch(self, unique, inverse, counts, key_bounds, training)
        batch.table_scores = list(scores)
        segments = Segments(key_bounds, storage.device)
        batch.unique_counts = unique_per_table(unique, segments)
        counted = torch.zeros(len(self.tables), len(COUNTER_NAMES), dtype=torch.int64,
                              device=unique.device)
        counted[:, _COUNTER["lookups"]] = per_table_sums(given, segments)
        counted[:, _COUNTER["unique_keys"]] = batch.unique_counts
        storage.counters += counted
        storage.batch_made(batch)
        return batch

    def tier_rows(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """([T] device tier rows, [T] rows of both tiers) of each table, on the device: what
        :func:`~dynemb.foundations.key_mixing.routes_to_first` routes its keys by (made again
        when a record laid its tables out anew)."""
        layouts = tuple(tiers.storage.layouts for tiers in self.tiers)
        if self._tier_rows_of != layouts:
            rows = torch.tensor([[t.tier.hash.capacity, t.host_tier.hash.capacity]
                                 for t in self.tables], dtype=torch.int64)
            self._tier_rows = (rows[:, 0].to(self.storage.device),
                               rows.sum(1).to(self.storage.device))
            self._tier_rows_of = layouts
        return self._tier_rows

    def __repr__(self) -> str:
        return (f"TieredGroup({list(self.names)}, device rows={self.storage.row_offset[-1]}, "
                f"host rows={self.tiers[1].storage.row_offset[-1]})")


class TieredBatch(LookupBatch):
    """A :class:`TieredGroup`'s share of a batch. ``keys`` / ``counts`` [U]: each table's
    unique keys, padded, table after table (table ``t``'s ``[unique_bounds[t],
    unique_bounds[t + 1])``, its key bounds); ``inverse`` [N] as for every batch. From its
    forward on, ``tiers``: the batch of each tier's group (device, host), whose ``slots`` [U]
    hold the keys routed to that tier (-1 elsewhere); ``fallback`` [U, dim] the rows of keys
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
        self.tiers: Optional[Tuple[GroupBatch, GroupBatch]] = None
        self.fallback = None
        self.consumed = False
        self.applied: set = set()
        self.pending = None
        self._segments_on: Dict[torch.device, Segments] = {}

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

    @property
    def pinned(self) -> bool:
        """Whether a member's rows are still pinned (from the forward's claim or find)."""
        return self.tiers is not None and self.tiers[0].pinned

    def tensors(self) -> List[torch.Tensor]:
        """The tensors the module's device reads (the host slots stay on the host)."""
        tensors = [self.keys, self.inverse, self.counts, self.fallback]
        tensors += [part.slots for part in self.tiers or ()]
        return [t for t in tensors if t is not None and t.device == self.device]

    def table_tensors(self, name: str) -> List[torch.Tensor]:
        t = self.group.storage.index[name]
        u0, u1 = self.unique_bounds[t], self.unique_bounds[t + 1]
        k0, k1 = self.key_bounds[t], self.key_bounds[t + 1]
        parts = [self.keys, self.counts, self.fallback] + [p.slots for p in self.tiers or ()]
        return [self.inverse[k0:k1]] + [p[u0:u1] for p in parts if p is not None]

    def member(self, name: str) -> TableBatch:
        """Table ``name``'s part as a :class:`TableBatch` (its own slots in both tiers): a
        copy, for reading."""
        t = self.group.storage.index[name]
        u0, u1 = self.unique_bounds[t], self.unique_bounds[t + 1]
        k0, k1 = self.key_bounds[t], self.key_bounds[t + 1]
        keys = self.keys[u0:u1]
        batch = TableBatch(name, self.mode, self.training, keys, self.inverse[k0:k1] - u0,
                           self.counts[u0:u1], torch.tensor([keys.numel()]))
        if self.tiers is not None:
            batch.slots, batch.host_slots = (part.member(name).slots for part in self.tiers)
        if self.fallback is not None:
            batch.fallback = self.fallback[u0:u1]
        batch.pinned, batch.consumed = self.pinned, self.consumed
        batch.applied = name in self.applied
        return batch

    # -- forward -------------------------------------------------------------------------------
    def lookup_occurrences(self, sizes: Optional[Sequence[int]] = None
                           ) -> Tuple[torch.Tensor, ...]:
        rows = self._looked_up_rows(by_input_key=True)  # gathered per input key at once
        return rows.split(list(self._part_sizes(sizes)))

    def pooling_rows(self) -> PoolingRows:
        """The unique rows, pooled by the pooling kernel."""
        return PoolingRows(self._looked_up_rows(by_input_key=False), self.inverse)

    def _looked_up_rows(self, by_input_key: bool) -> torch.Tensor:
        """[N or U, dim] float32: the row of each input key (else each unique key), claimed
        (training) or found (eval) at the first call; an eval batch ends its pins once it has
        read them. Each tier's batch gathers its keys' rows, zeros where a key is not in its
        tier (a key is in one tier at most, so their sum is the key's row); per input key,
        the host tier writes its rows over the device tier's where it can."""
        if self.tiers is None:
            self._claim() if self.training else self._find()
        device_part, host_part = self.tiers
        if by_input_key:
            rows, index = device_part.lookup_occurrences([self.inverse.numel()])[0], self.inverse
            if not host_part.gather_over(rows):
                rows.add_(host_part.lookup_occurrences([index.numel()])[0].to(
                    self.device, non_blocking=True))
        else:
            rows, index = device_part.unique_rows(), None
            rows.add_(host_part.unique_rows().to(self.device, non_blocking=True))
        if self.fallback is not None:  # keys stored in neither tier: their fallback row
            stored = (self.tiers[0].slots >= 0) | (self.tiers[1].slots >= 0).to(self.device)
            fallback = self.fallback
            if index is not None:
                stored, fallback = stored.index_select(0, index), fallback.index_select(0, index)
            rows = torch.where(stored[:, None], rows, fallback)
        if not self.training:
            self.release()
        return rows

    def _routes(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(device keys [U], host keys [U] in host memory): each key in the tier its table
        routes it to, EMPTY_KEY in the other (on CUDA the host keys' copy waits for the
        device: one per group and forward)."""
        group = self.group
        first_rows, total_rows = group.tier_rows()
        on_device, on_host = torch.empty_like(self.keys), torch.empty_like(self.keys)
        group.storage.kernels.route_keys_group(self._segments(group.tiers[0]), self.keys,
                                               first_rows, total_rows, on_device, on_host)
        return on_device, on_host.to(group.tiers[1].storage.device)

    def _segments(self, tiers: TableGroup) -> Segments:
        """The tables' segments of the unique keys on ``tiers``' device, made once per
        device (their per-entry tables are built at first use)."""
        device = tiers.storage.device
        if device not in self._segments_on:
            self._segments_on[device] = Segments(self.unique_bounds, device)
        return self._segments_on[device]

    def _tier_batches(self, slots: Sequence[torch.Tensor]) -> None:
        """The batch of each tier's group, holding ``slots`` (device, host) pinned; the
        tables hold this batch until its pins end."""
        self.tiers = tuple(GroupBatch(tiers.storage, self.keys, self.inverse, self.counts,
                                      self.unique_bounds, self.key_bounds, tier_slots)
                           for tiers, tier_slots in zip(self.group.tiers, slots))
        for table in self.group.tables:
            table.hold_group_batch(self)

    def _count(self, hits: torch.Tensor, *columns) -> None:
        """Add each table's ``hits`` [T], its misses (its unique keys not hit) and
        ``columns`` ``(counter name, [T])`` to its counters."""
        counters = self.group.storage.counters
        counted = torch.zeros_like(counters)
        counted[:, _COUNTER["hits"]] = hits
        counted[:, _COUNTER["misses"]] = self.unique_counts - hits
        for name, values in columns:
            counted[:, _COUNTER[name]] = values
        counters += counted

    def _find(self) -> None:
        """The eval forward: find each key in its tier, pin it until the rows are read; the
        keys in neither read their table's eval initializer row."""
        device_tiers = self.group.tiers[0]
        slots = [tiers.find(keys, self._segments(tiers), pin=True)
                 for tiers, keys in zip(self.group.tiers, self._routes())]
        self._tier_batches(slots)
        stored = (slots[0] >= 0) | (slots[1] >= 0).to(self.device)
        self.fallback = device_tiers.eval_rows(self.keys, ~stored,
                                               self._segments(device_tiers))
        self._count(per_table_sums(stored & (self.keys != EMPTY_KEY),
                                   self._segments(device_tiers)))

    def _claim(self) -> None:
        """The training forward: admission, the host tiers' claim, then the device tiers'
        (see the module docstring), new rows initialized, the claims counted."""
        device_tiers = self.group.tiers[0]
        keys = self._routes()
        if device_tiers.storage.admits:  # each table admits its keys, stored in either tier
            present = [tiers.find(tier_keys, self._segments(tiers)) >= 0
                       for tiers, tier_keys in zip(self.group.tiers, keys)]
            admitted, self.fallback = device_tiers.admit(
                self.keys, self.counts, present[0] | present[1].to(self.device),
                self._segments(device_tiers))
            keys = [torch.where((admitted != EMPTY_KEY).to(k.device), k, EMPTY_KEY)
                    for k in keys]
        claims = {}
        for t in (1, 0):  # alone, a table claims its host tier first
            tiers = self.group.tiers[t]
            claims[t] = tiers.claim(self._segments(tiers), keys[t],
                                    self.counts.to(tiers.storage.device), self.table_scores)
        if any(refusing is not None for _, refusing in claims.values()):
            self._refuse(claims)
        self._tier_batches([claims[0][0].slots, claims[1][0].slots])
        hits_inserts_evictions = torch.zeros(len(self.group.tables), 3, dtype=torch.int64,
                                             device=self.device)
        for t, tiers in enumerate(self.group.tiers):
            claim, segments = claims[t][0], self._segments(tiers)
            tiers.track_changes(claim)
            tiers.initialize(claim, segments)
            counts = torch.empty(len(self.group.tables), 3, dtype=torch.int64,
                                 device=tiers.storage.device)
            tiers.storage.kernels.claim_counts_group(segments, claim.slots, claim.inserted,
                                                     claim.prev_keys, counts)
            hits_inserts_evictions += counts.to(self.device)
        self._count(hits_inserts_evictions[:, 0], ("inserts", hits_inserts_evictions[:, 1]),
                    ("evictions", hits_inserts_evictions[:, 2]))

    def _refuse(self, claims) -> None:
        """Undo both tiers' claims (``{tier: (claim, its first refusing table or None)}``)
        and raise the ``TableFullError`` a table alone raises first: the first table with a
        key that found no slot, in its host tier if one did there."""
        for t, (claim, _) in claims.items():
            tiers = self.group.tiers[t]
            tiers.undo(claim, self._segments(tiers))
        first = min((claims[t][1], order, t) for order, t in enumerate((1, 0))
                    if claims[t][1] is not None)  # by table, then the host tier first
        refusing, _, t = first
        raise self.group.tiers[t].refusal(claims[t][0], refusing)

    # -- backward ------------------------------------------------------------------------------
    def applied_to(self, name: str) -> bool:
        return name in self.applied

    def apply_gradients(self, grads: OccurrenceGrads, taking: Sequence[bool], *, lr: float,
                        steps) -> None:
        """The fused update, in each tier, of the rows of the tables ``taking`` a gradient
        that still hold the batch's keys (a batch whose pins ended counts the others as
        dropped updates), each table at its own step; then those tables' pins end."""
        counters = self.group.storage.counters
        for part in self.tiers or ():
            update_rows(part.storage, live_slots(part.storage, part.slots, part, counters),
                        part, grads, taking, lr=lr, steps=steps)
        self.applied.update(name for name, takes in zip(self.names, taking) if takes)
        for table, takes in zip(self.group.tables, taking):
            if takes and table.changes is not None and self.tiers is not None:
                table.changes.updated(self.member(table.name))
        self.end_pins([t for t, takes in enumerate(taking) if takes])

    # -- pins ----------------------------------------------------------------------------------
    def release(self) -> None:
        """End the batch's pins, for every member (once)."""
        self.end_pins()

    def end_pins(self, tables: Optional[Sequence[int]] = None) -> None:
        """End the pins of ``tables`` (indices; None: all) in both tiers, once per table."""
        if not self.pinned:
            return
        unreleased = self.tiers[0].unreleased
        ending = set(unreleased) if tables is None else unreleased.intersection(tables)
        for part in self.tiers:
            part.storage.release(part, ending)
        for t in ending:
            self.group.tables[t].drop_group_batch(self)

    def end_pins_alone(self) -> None:
        """End the pins table by table, in each table's own tiers (its group is gone)."""
        for part in self.tiers or ():
            part.end_pins_alone()
        for table in self.group.tables:
            table.drop_group_batch(self)

    def rehome(self, groups: Sequence) -> bool:
        """Its own group, or a new one of the same tables (whose records hold the tables'
        tiers where the old ones did, as they moved with them): each tier's batch moves to
        the new group's tier."""
        if any(group is self.group for group in groups):
            return True
        for group in groups:
            if isinstance(group, TieredGroup) and group.tables == self.group.tables:
                for part, tiers in zip(self.tiers or (), group.tiers):
                    part.move_to(tiers.storage)
                self.group = group
                return True
        return False

    def table_remapped(self, name: str, remap: torch.Tensor) -> None:
        """A direct ``grow`` of member ``name``'s device tier moved its rows by ``remap``."""
        if self.tiers is not None:
            self.tiers[0].table_remapped(name, remap)

    def rows_moved(self, storage, old_offsets: Sequence[int]) -> None:
        for part in self.tiers or ():
            part.rows_moved(storage, old_offsets)
