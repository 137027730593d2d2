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
from dynemb.rows.optimizers import fused_update as update_rows_in_place
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
