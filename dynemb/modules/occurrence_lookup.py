"""The autograd step of a sequence lookup: rows per occurrence forward, the fused optimizer
in backward (used by :class:`~dynemb.modules.collection.DynamicEmbCollection`)."""
from __future__ import annotations

import torch

from dynemb.modules.dynamic_core import DynamicCore
from dynemb.rows.optimizers import OccurrenceGrads
from dynemb.tables import TableBatch
from dynemb.tables.groups import GroupBatch


class OccurrenceLookup(torch.autograd.Function):
    """Rows of one table's input keys, one per occurrence; backward hands their gradients
    [N, dim] with the batch's inverse index to the fused optimizer kernel, which clips each
    (as fbgemm does, before the per-row sum), sums them per row and updates the row: no
    [U, dim] gradient is built."""

    @staticmethod
    def forward(ctx, anchor, core: DynamicCore, name: str, batch: TableBatch):
        ctx.core, ctx.name, ctx.batch = core, name, batch
        ctx.generation = core.generation
        return core.tables[name].lookup_occurrences(batch)

    @staticmethod
    def backward(ctx, grad_rows):
        core, batch = ctx.core, ctx.batch
        core.before_backward()
        grads = OccurrenceGrads.from_inverse(grad_rows, batch.inverse, batch.keys.numel(),
                                             clip=core.max_gradient)
        core.apply_gradients(ctx.name, batch, grads, ctx.generation)
        return None, None, None, None


class GroupOccurrenceLookup(torch.autograd.Function):
    """:class:`OccurrenceLookup` for every table of a group at once
    (:mod:`dynemb.tables.groups`): one gather split into parts of ``sizes`` (one per
    feature of each table), ``part_tables[i]`` the group index of part ``i``'s table;
    backward updates the rows of the tables some of whose parts took a gradient, in one
    fused update."""

    @staticmethod
    def forward(ctx, anchor, core: DynamicCore, batch: GroupBatch, sizes, part_tables):
        ctx.core, ctx.batch, ctx.sizes, ctx.part_tables = core, batch, sizes, part_tables
        ctx.generation = core.generation
        ctx.set_materialize_grads(False)  # a part that took no gradient gets None
        return batch.group.lookup_occurrences(batch, sizes)

    @staticmethod
    def backward(ctx, *grad_rows):
        core = ctx.core
        core.before_backward()
        batch = ctx.batch
        grads = batch.group.occurrence_grads(batch, grad_rows, clip=core.max_gradient,
                                             sizes=ctx.sizes)
        taking = [False] * len(batch.names)
        for grad, table in zip(grad_rows, ctx.part_tables):
            if grad is not None:
                taking[table] = True
        core.apply_group_gradients(batch, grads, taking, ctx.generation)
        return None, None, None, None, None
