"""``GroupStorage``: where a table group's tables live (:mod:`dynemb.tables.groups`).

One set of arrays (hash keys, scores, pins, sizes, rows, counters) holds every table of the
group, each in its own contiguous part: table ``t`` owns rows
``[row_offset[t], row_offset[t] + capacity[t])`` and the buckets over them, so a key of one
table never meets, or evicts, another table's. The tables stay whole tables: their hash
tables, flat tables and counters are views of their parts. The record is a record: the
arrays, each table's part of them (laid out again when a table grows), the group's batches
(weakly) and the end of their pins. The phases (the prefetch and eval lookup with their
admission, growth and undo, :mod:`dynemb.tables.groups`; the gather,
:mod:`dynemb.tables.group_batch`, with the update; the CACHE stores) are objects or functions over it, and it knows none of them.

Example::

    >>> from dynemb.options import DynamicEmbTableOptions, choose_storage_mode
    >>> from dynemb.rows.optimizers import OptimizerConfig
    >>> from dynemb.tables import build_table
    >>> def table(name):
    ...     layout = choose_storage_mode(DynamicEmbTableOptions(), name=name, num_embeddings=512,
    ...                                  width=4, config_dtype=torch.float32)
    ...     return build_table(name, 0, 4, layout, DynamicEmbTableOptions(), OptimizerConfig(),
    ...                        torch.device("cpu"))
    >>> a, b = table("a"), table("b")
    >>> storage = GroupStorage([a, b])
    >>> storage.row_offset == [0, a.tier.hash.capacity, a.tier.hash.capacity * 2]
    True
    >>> b.tier.flat.weights.data_ptr() == storage.weights[storage.row_offset[1]:].data_ptr()
    True
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from dynemb.backends.protocol import Segments, TableArrays
from dynemb.foundations.counters import COUNTER_NAMES
from dynemb.tables.base import DynamicTable
from dynemb.tables.tier import Tier
from dynemb.types import EMPTY_KEY, FindOrInsertResult, ScorePolicy

def per_table_sums(values: Optional[torch.Tensor], segments: Segments) -> torch.Tensor:
    """[T] int64 on the segments' device: ``values`` [N] summed over each table's segment
    (None: the segments' sizes), with no host read.

    >>> per_table_sums(torch.tensor([1, 0, 1, 1, 1]), Segments([0, 2, 2, 5])).tolist()
    [1, 0, 3]
    """
    if values is None:
        return segments.on_device.diff()
    values = values.to(device=segments.device, dtype=torch.int64)
    if segments.count == 1:
        return values.sum().reshape(1)
    return torch.zeros(segments.count, dtype=torch.int64, device=segments.device).index_add_(
        0, segments.table_of, values)


class GroupStorage:
    """The arrays of a group's ``tables`` and each table's part of them (see the module
    docstring). Building it moves each table into its part, copying it, unless the group
    is one table that owns its arrays (then it works on them as they are).

    ``tier``: the tables' tier the record holds, by attribute (``"tier"``, each table's own;
    ``"host_tier"``, a DEFAULT table's host tier, :mod:`dynemb.tables.group_tiers`).
    ``keeps_counters``: the tables' counters are views of the record's :attr:`counters` (one
    record per table keeps them; the other's ``counters`` is None). ``in_place``: a group of
    one works on its table's arrays as they are, even where they are views of another
    group's (:func:`~dynemb.tables.grouping.group_of_one`)."""

    def __init__(self, tables: Sequence[DynamicTable], tier: str = "tier",
                 keeps_counters: bool = True, in_place: bool = False):
        first = tables[0]
        self._in_place = in_place
        #: how many times the record laid its tables out (a phase that keeps where the parts
        #: start, on the device, places them again when it changes)
        self.layouts = 0
        self.tier_name = tier
        self.keeps_counters = keeps_counters
        self.tables: List[DynamicTable] = list(tables)
        self.names: Tuple[str, ...] = tuple(t.name for t in tables)
        self.index: Dict[str, int] = {name: t for t, name in enumerate(self.names)}
        self.mode = first.mode
        first_tier = self.tier_of(first)
        self.kernels = first_tier.kernels
        self.device = first_tier.device
        #: where the module reads the rows and the optimizer updates them, by which kernels:
        #: the record's own device and kernels, but for HOST_ONLY tables of a module on CUDA
        #: (their record in host memory, by the host kernels; see :attr:`serves_elsewhere`)
        self.serve_device = first.device
        self.serve_kernels = first.kernels
        self.dim = first.dim
        self.optimizer = first.optimizer
        self.policy = first_tier.hash.policy
        self.bucket_size = first_tier.hash.bucket_size
        #: the tables that grow (``grow_at_load_factor``): a claim checks whether they must
        self.growing: Tuple[int, ...] = tuple(
            t for t, table in enumerate(tables)
            if self.tier_of(table).hash.grow_at_load_factor is not None)
        #: the tables admit keys by count (all or none of a group's do, group_signature)
        self.admits = first.admission is not None
        self._lay_out()
        #: how the fused update rounds float16 / bfloat16 rows: with noise only in a group of
        #: one (group_signature), drawn from its table's seed and id as the table alone does
        self.rounding = (dict(stochastic_rounding=True, seed=first.options.seed,
                              table_id=first.table_id)
                         if first.rounds_with_noise else dict(stochastic_rounding=False))

    @property
    def serves_elsewhere(self) -> bool:
        """Whether the module reads the rows on another device, or updates them by other
        kernels, than the record's: each gather copies the rows to :attr:`serve_device`, and
        the update runs there (:func:`~dynemb.tables.group_batch.fused_update`)."""
        return (self.serve_device != self.device
                or self.serve_kernels.name != self.kernels.name)

    def tier_of(self, table: DynamicTable) -> Tier:
        """The tier of ``table`` this record holds (see the class docstring)."""
        return getattr(table, self.tier_name)

    @property
    def row_dtype(self) -> torch.dtype:
        """The rows' dtype."""
        return self.tables[0].row_layout.dtype

    def write_new_rows(self, write, tensors: Sequence[torch.Tensor]) -> None:
        """``write(self)`` initializes new rows of :attr:`weights` (reading ``tensors``) now;
        or, while :attr:`weights` is empty (whoever holds the rows let their memory go for a
        while), once they are back: :meth:`take_held_writes` hands it over."""
        if self.weights.shape[0] == 0:
            self.__dict__.setdefault("_held_writes", []).append((write, tuple(tensors)))
        else:
            write(self)

    def take_held_writes(self) -> List:
        """The row initializations :meth:`write_new_rows` held, oldest first, as
        ``(write, tensors)``: ``write(self)`` makes one; they are forgotten here."""
        return self.__dict__.pop("_held_writes", [])

    def _lay_out(self) -> None:
        """Place every table in its part of the group's arrays, by the tables' capacities."""
        first = self.tables[0]
        capacities = [self.tier_of(t).hash.capacity for t in self.tables]
        self.row_offset = [0]
        for capacity in capacities:
            self.row_offset.append(self.row_offset[-1] + capacity)
        tier = self.tier_of(first)
        if len(self.tables) == 1 and (self._in_place
                                      or _owns_its_arrays(tier, first.counters)):  # no copy
            self.arrays, self.weights = tier.hash.arrays, tier.flat.weights
            self.counters = (first.counters.values.unsqueeze(0) if self.keeps_counters
                             else None)
        else:
            self._allocate_and_move_in()
        self._parts = [self._parts_of(t) for t in self.tables]
        self.bucket_counts = np.asarray([c // self.bucket_size for c in capacities],
                                        dtype=np.int64)
        self.layouts += 1
        self._place_tables()

    def _place_tables(self) -> None:
        """Tell each table whose tier this record holds that a direct ``grow`` of it grows
        here (:meth:`DynamicTable.grow <dynemb.tables.base.DynamicTable.grow>`); not a
        record over a table's arrays as they are (``in_place``: a visitor, such as a fill's
        group of one), nor one of a DEFAULT table's host tier (``grow`` grows the device
        tier)."""
        if self.tier_name == "tier" and not self._in_place:
            for table in self.tables:
                table.placed_in(self)

    def grow_tables(self, growth: Sequence[Tuple[int, int]]) -> List[torch.Tensor]:
        """Grow each table ``t`` of ``growth`` ``[(t, new capacity)]`` (its rows rehashed, as
        alone: see :meth:`DynamicTable.rehash <dynemb.tables.base.DynamicTable.rehash>`),
        then lay the group out again, once: every table is copied into its part of new arrays
        (a group of one keeps the table's grown arrays). The group's batches follow: their
        slots are renumbered to the new parts. Returns each table's remap (its old slot ->
        new), in the order of ``growth``.

        A record over a table's arrays as they are (``in_place``, a visitor) grows the table
        where it lives (:meth:`DynamicTable.grow <dynemb.tables.base.DynamicTable.grow>`: in
        its module's group, whose batches follow too), then reads its arrays again."""
        old_offsets = list(self.row_offset)
        visitor = self._in_place
        remaps = [(self.tables[t].grow if visitor else self.tables[t].rehash)(new_capacity)
                  for t, new_capacity in growth]
        self._lay_out()
        batches = {id(b): b for table in self.tables for b in table.held_batches()}
        batches.update((id(b), b) for b in self.__dict__.get("_batches", ()))
        for batch in batches.values():
            batch.rows_moved(self, old_offsets)
        return remaps

    def holds(self, table: DynamicTable) -> bool:
        """Whether ``table`` is one of the record's and its tier still lives in its part of
        the record's arrays (see :meth:`intact`)."""
        t = self.position(table)
        return t is not None and self._in_its_part(t)

    def position(self, table: DynamicTable) -> Optional[int]:
        """``table``'s index in the record (by identity), None if it is none of its."""
        return next((t for t, mine in enumerate(self.tables) if mine is table), None)

    def batch_made(self, batch) -> None:
        """Keep (weakly) each batch of the group: a batch whose pins ended may still see a
        late backward, which updates the rows still at its slots, as a table alone does; so
        its slots follow the group's new layouts (:meth:`grow_tables`), and the module moves
        it to the group that holds its tables next (a regroup)."""
        self.__dict__.setdefault("_batches", weakref.WeakSet()).add(batch)

    def live_batches(self) -> List:
        """The group's batches still referenced anywhere (pinned or not), see
        :meth:`batch_made`."""
        return list(self.__dict__.get("_batches", ()))

    def __getstate__(self) -> Dict:
        state = dict(self.__dict__)
        state.pop("_batches", None)  # weak references do not pickle
        state.pop("_held_writes", None)  # (nor do closures; none while the rows are there)
        return state

    def _parts_of(self, table: DynamicTable):
        """The table's arrays, as the group placed them (to tell whether they were
        replaced)."""
        tier = self.tier_of(table)
        counters = table.counters.values if self.keeps_counters else None
        return tier.hash.arrays, tier.flat.weights, counters

    def _allocate_and_move_in(self) -> None:
        """The group's arrays, each table copied into its part of them."""
        rows = self.row_offset[-1]
        first = self.tables[0]
        weights = self.tier_of(first).flat.weights
        self.arrays = TableArrays(
            torch.full((rows,), EMPTY_KEY, dtype=torch.int64, device=self.device),
            torch.zeros(rows, dtype=torch.int64, device=self.device),
            torch.zeros(rows, dtype=torch.int32, device=self.device),
            torch.zeros(len(self.tables), dtype=torch.int64, device=self.device),
            rows // self.bucket_size, self.bucket_size)
        self.weights = torch.zeros(rows, weights.shape[1], dtype=weights.dtype,
                                   device=self.device,
                                   pin_memory=weights.is_pinned())
        self.counters = (torch.zeros(len(self.tables), len(COUNTER_NAMES), dtype=torch.int64,
                                     device=first.counters.values.device)
                         if self.keeps_counters else None)
        for t in range(len(self.tables)):
            self._move_into_part(t)

    def _move_into_part(self, t: int) -> None:
        """Copy table ``t`` into its part of the group's arrays and make its arrays views
        of that part."""
        table = self.tables[t]
        tier = self.tier_of(table)
        lo, hi = self.row_offset[t], self.row_offset[t + 1]
        tier.hash.use_storage(TableArrays(
            self.arrays.keys[lo:hi], self.arrays.scores[lo:hi], self.arrays.refcnt[lo:hi],
            self.arrays.size[t:t + 1], (hi - lo) // self.bucket_size, self.bucket_size))
        tier.flat.use_storage(self.weights[lo:hi])
        if self.keeps_counters:
            table.counters.use_storage(self.counters[t])

    def view_parts_again(self) -> None:
        """After unpickling: plain ``pickle`` copies every tensor on its own (``torch.save``
        and ``copy.deepcopy`` keep views), so a table's arrays may no longer be views of the
        group's. Such a table's arrays (equal to its part) become views of its part again."""
        for t, table in enumerate(self.tables):
            lo = self.row_offset[t]
            tier = self.tier_of(table)
            apart = (tier.hash.arrays.keys.data_ptr() != self.arrays.keys[lo:].data_ptr()
                     or tier.flat.weights.data_ptr() != self.weights[lo:].data_ptr()
                     or (self.keeps_counters and table.counters.values.data_ptr()
                         != self.counters[t].data_ptr()))
            if apart:
                self._move_into_part(t)
                self._parts[t] = self._parts_of(table)
        self._place_tables()  # (a table does not pickle its record's weak reference)

    def intact(self, tables: Mapping[str, DynamicTable]) -> bool:
        """Whether ``tables`` still holds the group's tables, each still in its part of the
        group's arrays (a checkpoint load or reset may have replaced a table, a direct call
        of its hash table's ``grow`` its arrays)."""
        return all(tables.get(name) is table and self._in_its_part(t)
                   for t, (name, table) in enumerate(zip(self.names, self.tables)))

    def _in_its_part(self, t: int) -> bool:
        """Whether table ``t``'s arrays are still those the record placed."""
        table = self.tables[t]
        arrays, weights, counters = self._parts[t]
        return (self.tier_of(table).hash.arrays is arrays
                and self.tier_of(table).flat.weights is weights
                and not (self.keeps_counters and table.counters.values is not counters))

    @property
    def allows_eviction(self) -> bool:
        return self.policy is not ScorePolicy.NO_EVICTION

    def table_claim(self, claim, t: int) -> FindOrInsertResult:
        """Table ``t``'s part of a group claim ``(keys, slots, inserted, previous keys,
        previous scores, unique bounds)``, in its own slots."""
        keys, slots, inserted, prev_keys, prev_scores, unique_bounds = claim
        lo, hi = int(unique_bounds[t]), int(unique_bounds[t + 1])
        part = slots[lo:hi]
        local = torch.where(part >= 0, part - self.row_offset[t], -1)
        return FindOrInsertResult(keys[lo:hi], None, local, inserted[lo:hi], prev_keys[lo:hi],
                                  prev_scores[lo:hi], None, None)

    def release(self, batch, tables: Optional[Sequence[int]] = None) -> None:
        """End ``batch``'s pins of ``tables`` (indices; None: all), once per table: one pin
        of each of its slots (-1: none) of those tables."""
        if not batch.pinned:
            return
        ending = (set(batch.unreleased) if tables is None
                  else batch.unreleased.intersection(tables))
        if not ending:
            return
        slots, bounds = batch.slots, batch.unique_bounds
        if len(ending) < len(self.tables):
            slots = torch.cat([slots[bounds[t]:bounds[t + 1]] for t in sorted(ending)])
        self.kernels.add_refcounts(self.arrays, slots, -1)
        batch.unreleased -= ending
        for t in ending:
            self.tables[t].drop_group_batch(batch)
        batch.pinned = bool(batch.unreleased)

    def __repr__(self) -> str:
        return f"GroupStorage({list(self.names)}, rows={self.row_offset[-1]})"


def _owns_its_arrays(tier: Tier, counters) -> bool:
    """Whether a tier's arrays and its table's ``counters`` are whole tensors, not views
    into an earlier group's (a group of one that kept those would keep the earlier group's
    memory alive)."""
    tensors = (tier.hash.arrays.keys, tier.flat.weights, counters.values)
    return all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors)
