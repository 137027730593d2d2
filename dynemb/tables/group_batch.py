"""``GroupBatch``: a table group's share of a prefetched batch (see
:mod:`dynemb.tables.groups`), from prefetch to backward; the many-member case of
:class:`~dynemb.tables.lookup_batch.LookupBatch`."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from dynemb.rows.optimizers import OccurrenceGrads
from dynemb.tables.batch import TableBatch
from dynemb.tables.lookup_batch import LookupBatch, PoolingRows


def key_bounds_of(keys: Sequence[torch.Tensor]) -> List[int]:
    """[T + 1] where each table's keys start in their concatenation, and their total.

    >>> key_bounds_of([torch.ones(2), torch.ones(0), torch.ones(3)])
    [0, 2, 2, 5]
    """
    bounds = [0]
    for part in keys:
        bounds.append(bounds[-1] + part.numel())
    return bounds


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


class GroupBatch(LookupBatch):
    """A group's share of a prefetched batch, for all its tables at once.

    ``keys`` / ``counts`` [U]: each table's unique keys (in bucket order), table after
    table; table ``t``'s are ``[unique_bounds[t], unique_bounds[t + 1])``. ``inverse`` [N]:
    the unique index of each input key (the tables' keys concatenated in group order, table
    ``t``'s ``[key_bounds[t], key_bounds[t + 1])``). ``slots`` [U]: group rows. ``applied``:
    the tables whose backward ran.
    """

    training = True
    fallback = None
    pending = None  # (a batch pickled by an earlier version has no instance value)

    def __init__(self, group, keys, inverse, counts, unique_bounds, key_bounds,
                 slots):
        self.group = group
        self.mode = group.mode
        self.keys, self.inverse, self.counts, self.slots = keys, inverse, counts, slots
        self.unique_bounds: List[int] = unique_bounds
        self.key_bounds: List[int] = key_bounds
        self.pinned = True
        self.unreleased = set(range(len(group.names)))  # tables whose pins have not ended
        self.consumed = False
        self.applied: set = set()
        #: [U] the table of each unique key, on the device (the CUDA path's; None on CPU)
        self.seg = None
        #: between ``TableGroup.claim`` and ``finish``: the claim whose rows are not filled
        self.pending = None

    @property
    def names(self) -> Tuple[str, ...]:
        return self.group.names

    def tensors(self) -> List[torch.Tensor]:
        return [self.keys, self.inverse, self.counts, self.slots]

    # -- LookupBatch ---------------------------------------------------------------------------
    @property
    def dim(self) -> int:
        return self.group.dim

    @property
    def device(self) -> torch.device:
        return self.group.device

    @property
    def kernels(self):
        return self.group.kernels

    def key_range(self, name: str) -> Tuple[int, int]:
        t = self.group.index[name]
        return self.key_bounds[t], self.key_bounds[t + 1]

    def lookup_occurrences(self, sizes: Optional[Sequence[int]] = None
                           ) -> Tuple[torch.Tensor, ...]:
        return self.group.lookup_occurrences(self, sizes)

    def pooling_rows(self) -> PoolingRows:
        """Straight from the group's rows; an eval batch on the host kernels pools its
        unique rows (stored, or the eval initializer's) by ``embedding_bag``, as each table
        alone pools its eval lookups. On the CUDA path a key without a slot pools zeros, and
        an eval batch's key not stored its eval row."""
        group = self.group
        if self.fallback is not None and group.kernels.name != "cuda":
            return PoolingRows(group.unique_rows(self), self.inverse, by_kernel=False)
        occ_slots = self.slots.index_select(0, self.inverse)
        rows = group.weights
        if self.seg is not None or self.fallback is not None:
            rows = self.lookup_occurrences([occ_slots.numel()])[0]
            occ_slots = torch.arange(occ_slots.numel(), device=occ_slots.device)
        elif rows.dtype != torch.float32:  # float16 / bfloat16 rows: pool float32 copies
            rows = rows[:, :group.dim].float()
        return PoolingRows(rows, occ_slots, by_kernel=True)

    @property
    def reads_strided_grads(self) -> bool:
        return self.seg is None  # the CUDA path's batches carry their keys' tables

    def applied_to(self, name: str) -> bool:
        return name in self.applied

    def apply_gradients(self, grads: OccurrenceGrads, taking: Sequence[bool], *, lr: float,
                        steps) -> None:
        self.group.apply_gradients(self, grads, taking, lr=lr, steps=steps)

    def release(self) -> None:
        self.group.release(self)

    def rehome(self, groups: Sequence) -> bool:
        if self.group in groups:
            return True
        return any(self.move_to(group) for group in groups)

    def table_tensors(self, name: str) -> List[torch.Tensor]:
        """The parts of the batch's tensors that are table ``name``'s."""
        t = self.group.index[name]
        u0, u1 = self.unique_bounds[t], self.unique_bounds[t + 1]
        k0, k1 = self.key_bounds[t], self.key_bounds[t + 1]
        return [self.keys[u0:u1], self.inverse[k0:k1], self.counts[u0:u1], self.slots[u0:u1]]

    def member(self, name: str) -> TableBatch:
        """Table ``name``'s part as a :class:`TableBatch` of its own (slots of its table,
        inverse into its keys): a copy, for reading."""
        t = self.group.index[name]
        u0 = self.unique_bounds[t]
        keys, inverse, counts, slots = self.table_tensors(name)
        local = torch.where(slots >= 0, slots - self.group.row_offset[t], -1)
        batch = TableBatch(name, self.mode, True, keys, inverse - u0, counts,
                           torch.tensor([keys.numel()]), slots=local)
        batch.pinned, batch.consumed = self.pinned, self.consumed
        batch.applied = name in self.applied
        return batch

    def move_to(self, group) -> bool:
        """Make this batch of an earlier group of the same tables (regrouped while the batch
        held pins, which moved with the tables' arrays) a batch of ``group``: its slots are
        renumbered to that group's rows. False, and nothing changes, if the earlier group
        had other tables."""
        old = self.group
        if len(old.tables) != len(group.tables) or any(
                a is not b for a, b in zip(old.tables, group.tables)):
            return False
        device = self.slots.device
        shift = torch.tensor([new - was for new, was in zip(group.row_offset, old.row_offset)][:-1],
                             dtype=torch.int64, device=device)
        sizes = torch.tensor(np.diff(np.asarray(self.unique_bounds)), dtype=torch.int64,
                             device=device)
        delta = torch.repeat_interleave(shift, sizes, output_size=self.slots.numel())
        self.slots = torch.where(self.slots >= 0, self.slots + delta, -1)
        self.group = group
        return True

    def end_pins_alone(self) -> None:
        """End the batch's pins table by table, in each table's own arrays (when its group no
        longer holds them: its tables were regrouped into other groups)."""
        group = self.group
        for t in sorted(self.unreleased):
            table = group.tables[t]
            lo, hi = self.unique_bounds[t], self.unique_bounds[t + 1]
            part = self.slots[lo:hi]
            table.tier.hash.release(torch.where(part >= 0, part - group.row_offset[t], -1))
            table.drop_group_batch(self)
        self.unreleased = set()
        self.pinned = False
