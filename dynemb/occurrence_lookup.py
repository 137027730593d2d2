"""The autograd step of a sequence lookup: rows per occurrence forward, the fused optimizer
in backward (used by :class:`~dynemb.collection.DynamicEmbCollection`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dynemb.optimizers import OccurrenceGrads
from dynemb.tables import TableBatch

if TYPE_CHECKING:
    from dynemb.collection import DynamicEmbCollection


class OccurrenceLookup(torch.autograd.Function):
    """Rows of one table's input keys, one per occurrence; backward hands their gradients
    [N, dim] with the batch's inverse index to the fused optimizer kernel, which clips each
    (as fbgemm does, before the per-row sum), sums them per row and updates the row: no
    [U, dim] gradient is built."""

    @staticmethod
    def forward(ctx, anchor, module: "DynamicEmbCollection", name: str, batch: TableBatch):
        ctx.module, ctx.name, ctx.batch = module, name, batch
        ctx.generation = module._generation
        return module.tables[name].lookup_occurrences(batch)

    @staticmethod
    def backward(ctx, grad_rows):
        module, batch = ctx.module, ctx.batch
        if module._stash is not None:  # stashed rows come back now at the latest
            module._stash.restore()
        grads = OccurrenceGrads.from_inverse(grad_rows, batch.inverse, batch.keys.numel(),
                                             clip=module._optimizer_config.max_gradient)
        module._apply_gradients(ctx.name, batch, grads, ctx.generation)
        return None, None, None, None
