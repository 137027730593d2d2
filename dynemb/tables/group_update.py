"""A table group's backward (:mod:`dynemb.tables.groups`): one fused update of the rows of
every table that took a gradient, each table at its own step (the gradients of every input
key's row come in one :class:`~dynemb.rows.optimizers.OccurrenceGrads`, see
:meth:`~dynemb.tables.lookup_batch.LookupBatch.occurrence_grads`), over the group's
:class:`~dynemb.tables.group_storage.GroupStorage`."""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from dynemb.foundations.counters import COUNTER_NAMES
from dynemb.rows.optimizers import OccurrenceGrads
from dynemb.backends.protocol import Segments
from dynemb.tables.group_storage import GroupStorage, per_table_sums

_DROPPED = COUNTER_NAMES.index("dropped_updates")


def apply_group_gradients(storage: GroupStorage, batch, grads: OccurrenceGrads,
                          taking: Sequence[bool], *, lr: float,
                          steps: Mapping[str, int]) -> None:
    """The fused update of the rows of the tables ``taking`` a gradient (``grads``: of
    ``batch``'s unique keys), each at its own ``steps``; then those tables' pins end (the
    others' at the next training lookup, as a table alone keeps them until its backward or
    that lookup)."""
    slots = live_slots(storage, batch.slots, batch, storage.counters)
    update_rows(storage, slots, batch, grads, taking, lr=lr, steps=steps)
    batch.applied.update(name for name, takes in zip(storage.names, taking) if takes)
    for table, takes in zip(storage.tables, taking):  # tracking began after the prefetch
        if takes and table.changes is not None:
            table.changes.updated(batch.member(table.name))
    storage.release(batch, [t for t, takes in enumerate(taking) if takes])


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
        storage.fused_update(chosen, grads, batch.keys, lr=lr, step=step)


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
