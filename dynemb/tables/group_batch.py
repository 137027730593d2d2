"""``GroupBatch``: a table group's share of a prefetched batch (see
:mod:`dynemb.tables.groups`), from prefetch to backward; the many-member case of
:class:`~dynemb.tables.lookup_batch.LookupBatch`. Its backward is one fused update of the rows
of every table that took a gradient, each table at its own step (the gradients of every input
key's row come in one :class:`~dynemb.rows.optimizers.OccurrenceGrads`, see
:meth:`~dynemb.tables.lookup_batch.LookupBatch.occurrence_grads`)."""
from __future__ import annotations

from typing import List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from dynemb.backends.protocol import Segments
from dynemb.foundations.counters import COUNTER_NAMES
from dynemb.rows.optimizers import OccurrenceGrads
from dynemb.rows.optimizers import fused_update as update_rows_in_place
from dynemb.tables.group_storage import GroupStorage, per_table_sums
from dynemb.tables.lookup_batch import LookupBatch, PoolingRows, TableBatch

_DROPPED = COUNTER_NAMES.index("dropped_updates")


def key_bounds_of(keys: Sequence[torch.Tensor]) -> List[int]:
    """[T + 1] where each table's keys start in their concatenation, and their total.

    >>> key_bounds_of([torch.ones(2), torch.ones(0), torch.ones(3)])
    [0, 2, 2, 5]
    """
    bounds = [0]
    for part in keys:
        bounds.append(bounds[-1] + part.numel())
    return bounds


def shifted_slots(slots: torch.Tensor, unique_bounds: Sequence[int],
                  old_offsets: Sequence[int], new_offsets: Sequence[int]) -> torch.Tensor:
    """Each table's ``slots`` renumbered from its part's old start to its new one (-1
    stays)."""
    device = slots.device
    shift = torch.tensor([new - was for new, was in zip(new_offsets, old_offsets)][:-1],
                         dtype=torch.int64, device=device)
    sizes = torch.tensor(np.diff(np.asarray(unique_bounds)), dtype=torch.int64, device=device)
    delta = torch.repeat_interleave(shift, sizes, output_size=slots.numel())
    return torch.where(slots >= 0, slots + delta, -1)


class GroupBatch(LookupBatch):
    """A group's share of a prefetched batch, for all its tables at once.

    ``keys`` / ``counts`` [U]: each table's unique keys (in bucket order), table after
    table; table ``t``'s are ``[unique_bounds[t], unique_bounds[t + 1])``. ``inverse`` [N]:
    the unique index of each input key (the tables' keys concatenated in group order, table
    ``t``'s ``[key_bounds[t], key_bounds[t + 1])``). ``slots`` [U]: rows of the group's
    ``storage``. ``applied``: the tables whose backward ran.
    """

    training = True
    fallback = None

    def __init__(self, storage: GroupStorage, keys, inverse, counts, unique_bounds, key_bounds,
                 slots):
        self.storage = storage
        self.mode = storage.mode
        self.keys, self.counts, self.slots = keys, counts, slots
        self.inverse = inverse.to(storage.serve_device)  # where the module reads the rows
        self.unique_bounds: List[int] = unique_bounds
        self.key_bounds: List[int] = key_bounds
        self.pinned = True
        self.unreleased = set(range(len(storage.names)))  # tables whose pins have not ended
        self.consumed = False
        self.applied: set = set()
        #: between ``TableGroup.claim_batch`` and ``finish_batch``: the claim whose rows are
        #: not filled
        self.pending = None

    @property
    def names(self) -> Tuple[str, ...]:
        return self.storage.names

    def tensors(self) -> List[torch.Tensor]:
        """The tensors the module's device reads (the others stay with the record)."""
        return [t for t in (self.keys, self.inverse, self.counts, self.slots)
                if t.device == self.device]

    # -- LookupBatch ---------------------------------------------------------------------------
    @property
    def dim(self) -> int:
        return self.storage.dim

    @property
    def device(self) -> torch.device:
        return self.storage.serve_device

    @property
    def kernels(self):
        """The kernels of the gradients and the update (``serve_kernels``; a record in host
        memory served on CUDA claims by the host kernels)."""
        return self.storage.serve_kernels

    def key_range(self, name: str) -> Tuple[int, int]:
        t = self.storage.index[name]
        return self.key_bounds[t], self.key_bounds[t + 1]

    def lookup_occurrences(self, sizes: Optional[Sequence[int]] = None
                           ) -> Tuple[torch.Tensor, ...]:
        """Every input key's row (float32), views of one gather split into ``sizes`` (None:
        one tensor per table; a collection passes one size per feature of each table)."""
        storage = self.storage
        if sizes is None:
            sizes = np.diff(np.asarray(self.key_bounds)).tolist()
        if storage.serves_elsewhere:  # the rows cross to the module once per unique key
            return self.unique_rows().index_select(0, self.inverse).split(sizes)
        weights, dim = storage.weights, storage.dim
        if weights.dtype == torch.float32:
            # one launch; a key without a slot: its fallback row (eval, admission), else zeros
            rows = torch.empty(self.inverse.numel(), dim, device=weights.device)
            storage.kernels.gather_rows(weights, self.slots, self.inverse, dim, rows,
                                        self.fallback)
            return rows.split(sizes)
        slots = self.slots.index_select(0, self.inverse)
        rows = weights[:, :dim].index_select(0, slots.clamp(min=0)).float()
        # eval, admission: a key not stored reads its fallback row; else zeros
        missing = 0.0 if self.fallback is None else self.fallback.index_select(0, self.inverse)
        return torch.where((slots >= 0)[:, None], rows, missing).split(sizes)

    def gather_over(self, rows: torch.Tensor) -> bool:
        """Write the row of each input key that has a slot here over ``rows`` [N, dim]
        float32, in place, the others left as they are (a DEFAULT group's host tier over its
        device tier's rows: one pass over the input keys each). False, and nothing written,
        where the rows are not read where the module reads them or are not float32."""
        storage = self.storage
        if storage.serves_elsewhere or storage.weights.dtype != torch.float32:
            return False
        storage.kernels.gather_rows(storage.weights, self.slots, self.inverse, storage.dim,
                                    rows, keep=True)
        return True

    def unique_rows(self) -> torch.Tensor:
        """[U, dim] float32 on the module's device: each unique key's row; an eval batch's
        keys not stored read their eval initializer's row, other keys without a slot
        zeros. Rows served elsewhere cross to the module's device here."""
        storage = self.storage
        rows = storage.weights[:, :storage.dim].index_select(0, self.slots.clamp(min=0))
        if storage.serves_elsewhere:
            rows = rows.to(storage.serve_device, non_blocking=True)  # host -> device: safe
        rows = rows.float()
        stored = (self.slots >= 0).to(rows.device)[:, None]
        if self.fallback is not None:
            return torch.where(stored, rows, self.fallback.to(rows.device))
        return torch.where(stored, rows, 0.0)  # a key without a slot: zeros

    def pooling_rows(self) -> PoolingRows:
        """Straight from the group's float32 rows, by the slot of each input key (a key
        without a slot pools nothing); else (an eval or admission batch's keys not stored
        pool their ``fallback`` rows, float16 / bfloat16 rows their float32 copies, rows
        served on another device their copies there) from the unique keys' rows."""
        storage = self.storage
        if self.fallback is None and not storage.serves_elsewhere and \
                storage.row_dtype == torch.float32:
            return PoolingRows(storage.weights, self.slots.index_select(0, self.inverse))
        return PoolingRows(self.unique_rows().contiguous(), self.inverse)

    def applied_to(self, name: str) -> bool:
        return name in self.applied

    def apply_gradients(self, grads: OccurrenceGrads, taking: Sequence[bool], *, lr: float,
                        steps) -> None:
        """The fused update of the rows of the tables ``taking`` a gradient, each at its own
        ``steps``; then those tables' pins end (the others' at the next training lookup, as
        a table alone keeps them until its backward or that lookup)."""
        storage = self.storage
        slots = live_slots(storage, self.slots, self, storage.counters)
        update_rows(storage, slots, self, grads, taking, lr=lr, steps=steps)
        self.applied.update(name for name, takes in zip(storage.names, taking) if takes)
        for table, takes in zip(storage.tables, taking):  # tracking began after the prefetch
            if takes and table.changes is not None:
                table.changes.updated(self.member(table.name))
        storage.release(self, [t for t, takes in enumerate(taking) if takes])

    def release(self) -> None:
        self.storage.release(self)

    def rehome(self, groups: Sequence) -> bool:
        storages = [group.storage for group in groups]
        if any(self.storage is storage for storage in storages):
            return True
        return any(self.move_to(storage) for storage in storages)

    def table_tensors(self, name: str) -> List[torch.Tensor]:
        """The parts of the batch's tensors that are table ``name``'s."""
        t = self.storage.index[name]
        u0, u1 = self.unique_bounds[t], self.unique_bounds[t + 1]
        k0, k1 = self.key_bounds[t], self.key_bounds[t + 1]
        return [self.keys[u0:u1], self.inverse[k0:k1], self.counts[u0:u1], self.slots[u0:u1]]

    def member(self, name: str) -> TableBatch:
        """Table ``name``'s part as a :class:`TableBatch` of its own (slots of its table,
        inverse into its keys): a copy, for reading."""
        t = self.storage.index[name]
        u0 = self.unique_bounds[t]
        keys, inverse, counts, slots = self.table_tensors(name)
        local = torch.where(slots >= 0, slots - self.storage.row_offset[t], -1)
        batch = TableBatch(name, self.mode, True, keys, inverse - u0, counts,
                           torch.tensor([keys.numel()]), slots=local)
        batch.pinned, batch.consumed = self.pinned, self.consumed
        batch.applied = name in self.applied
        if self.fallback is not None:
            batch.fallback = self.fallback[u0:self.unique_bounds[t + 1]]
        return batch

    def table_remapped(self, name: str, remap: torch.Tensor) -> None:
        """Member ``name``'s slots move by ``remap`` (in its own numbering); they stay counted
        from its part's old start until :meth:`rows_moved` (its group laid its tables out
        again: :meth:`GroupStorage.grow_tables`) or :meth:`move_to`."""
        t = self.storage.index[name]
        lo, hi = self.unique_bounds[t], self.unique_bounds[t + 1]
        start = self.storage.row_offset[t]
        part = self.slots[lo:hi]
        moved = torch.where(part >= 0, remap[(part - start).clamp(min=0)] + start, -1)
        self.slots = torch.cat([self.slots[:lo], moved, self.slots[hi:]])

    def rows_moved(self, storage: GroupStorage, old_offsets: Sequence[int]) -> None:
        if storage is self.storage:
            self._shift(old_offsets, storage.row_offset)

    def _shift(self, old_offsets: Sequence[int], new_offsets: Sequence[int]) -> None:
        """Renumber the slots of each table from its part's old start to its new one."""
        self.slots = shifted_slots(self.slots, self.unique_bounds, old_offsets, new_offsets)

    def move_to(self, storage: GroupStorage) -> bool:
        """Make this batch of an earlier group of the same tables (regrouped while the batch
        held pins, which moved with the tables' arrays) a batch of the group of ``storage``:
        its slots are renumbered to that group's rows. False, and nothing changes, if the
        earlier group had other tables."""
        old = self.storage
        if len(old.tables) != len(storage.tables) or any(
                a is not b for a, b in zip(old.tables, storage.tables)):
            return False
        self._shift(old.row_offset, storage.row_offset)
        self.storage = storage
        return True

    def end_pins_alone(self) -> None:
        """End the batch's pins table by table, in each table's own arrays (when its group no
        longer holds them: its tables were regrouped into other groups)."""
        storage = self.storage
        for t in sorted(self.unreleased):
            table = storage.tables[t]
            lo, hi = self.unique_bounds[t], self.unique_bounds[t + 1]
            part = self.slots[lo:hi]
            storage.tier_of(table).hash.release(
                torch.where(part >= 0, part - storage.row_offset[t], -1))
            table.drop_group_batch(self)
        self.unreleased = set()
        self.pinned = False


def update_rows(storage: GroupStorage, slots: torch.Tensor, batch, grads: OccurrenceGrads,
                taking: Sequence[bool], *, lr: float, steps: Mapping[str, int]) -> None:
    """The fused update of ``storage``'s rows at ``slots`` [U] (-1: none) of ``batch``'s
    unique keys, for the tables ``taking`` a gradient, each at its own ``steps``: one update
    per step the tables are at."""
    if not all(taking):  # tables without a gradient keep their rows as they are
        slots = slots.clone()
        for t, takes in enumerate(taking):
            if not takes:
                slots[batch.unique_bounds[t]:batch.unique_bounds[t + 1]] = -1
    step_of = [steps[name] for name, takes in zip(storage.names, taking) if takes]
    for step in sorted(set(step_of)):
        chosen = slots
        if len(set(step_of)) > 1:  # tables at different steps: one update per step
            chosen = slots.clone()
            for t, name in enumerate(storage.names):
                if not taking[t] or steps[name] != step:
                    chosen[batch.unique_bounds[t]:batch.unique_bounds[t + 1]] = -1
        fused_update(storage, chosen, grads, batch.keys, lr=lr, step=step)


def fused_update(storage: GroupStorage, slots: torch.Tensor, grads, keys: torch.Tensor, *,
                 lr: float, step: int) -> None:
    """The optimizer step of ``storage``'s rows at ``slots`` [U] (-1: none), ``grads`` of
    ``keys`` [U]. Rows served elsewhere (``storage.serves_elsewhere``) are gathered to the
    module's device, updated there by its kernels and written back, as a HOST_ONLY table
    alone updates its rows."""
    config = dict(dim=storage.dim, config=storage.optimizer, lr=lr, step=step,
                  **storage.rounding)
    if not storage.serves_elsewhere:
        update_rows_in_place(storage.weights, slots, grads, kernels=storage.kernels, keys=keys,
                             **config)
        return
    device = storage.serve_device
    stored = slots >= 0
    rows = storage.weights.index_select(0, slots.clamp(min=0)).to(device)
    local = torch.where(stored.to(device), torch.arange(slots.numel(), device=device), -1)
    update_rows_in_place(rows, local, grads, kernels=storage.serve_kernels,
                         keys=keys.to(device), **config)
    storage.weights.index_copy_(0, slots[stored], rows[stored.to(device)].to(storage.device))


def live_slots(storage: GroupStorage, slots: torch.Tensor, batch,
               counters: torch.Tensor) -> torch.Tensor:
    """``slots`` [U] (rows of ``storage`` holding ``batch``'s unique keys) if the batch is
    still pinned; else only those still holding its keys, the others counted as dropped
    updates of their tables in ``counters`` [T, counters]."""
    if batch.pinned:
        return slots
    kept = storage.arrays.keys[slots.clamp(min=0)] == batch.keys.to(slots.device)
    dropped = ((slots >= 0) & ~kept).to(torch.int64)
    per_table = per_table_sums(dropped, Segments(batch.unique_bounds, dropped.device))
    counters[:, _DROPPED] += per_table.to(counters.device)
    return torch.where(kept, slots, -1)
