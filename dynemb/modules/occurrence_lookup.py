"""The autograd step of a sequence lookup: rows per occurrence forward, the fused optimizer
in backward (used by :class:`~dynemb.modules.collection.DynamicEmbCollection`)."""
from __future__ import annotations

from typing import Sequence

import torch

from dynemb.modules.dynamic_core import DynamicCore
from dynemb.tables.lookup_batch import LookupBatch


class OccurrenceLookup(torch.autograd.Function):
    """Rows of a batch's input keys, one per occurrence, for every table of the batch (a
    group's, or a table alone: :class:`~dynemb.tables.lookup_batch.LookupBatch`): one gather
    split into parts of ``sizes`` (one per feature of each table), ``part_tables[i]`` the
    index in ``batch.names`` of part ``i``'s table. Backward hands the parts' gradients with
    the batch's inverse index to the fused optimizer kernel, which clips each (as fbgemm does,
    before the per-row sum), sums them per row and updates the rows of the tables some of
    whose parts took a gradient, in one fused update: no [U, dim] gradient is built."""

    @staticmethod
    def forward(ctx, anchor, core: DynamicCore, batch: LookupBatch, sizes: Sequence[int],
                part_tables: Sequence[int]):
        ctx.core, ctx.batch, ctx.sizes, ctx.part_tables = core, batch, sizes, part_tables
        ctx.generation = core.generation
        ctx.set_materialize_grads(False)  # a part that took no gradient gets None
        return batch.lookup_occurrences(sizes)

    @staticmethod
    def backward(ctx, *grad_rows):
        core = ctx.core
        core.before_backward()
        batch = ctx.batch
        grads = batch.occurrence_grads(grad_rows, clip=core.max_gradient, sizes=ctx.sizes)
        taking = [False] * len(batch.names)
        for grad, table in zip(grad_rows, ctx.part_tables):
            if grad is not None:
                taking[table] = True
        core.apply_gradients(batch, grads, taking, ctx.generation)
        return None, None, None, None, None
