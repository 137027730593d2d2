"""Pooling a dynamic table's rows into bags, and the autograd step of a pooled lookup (used
by :class:`~dynemb.bag_collection.DynamicEmbBagCollection`).

Shapes: B samples, F features of a table, N ids of a table (all its features), U its unique
ids in the batch, D its embedding dim, C the output's columns (the sum of the features' dims).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from dynemb.dynamic_core import DynamicCore
from dynemb.optimizers import OccurrenceGrads, occurrence_csr
from dynemb.tables import DynamicTable, TableBatch


@dataclass
class Bags:
    """One table's bags in a batch: ``offsets`` [F * B + 1] and ``lengths`` [F * B] over its
    ids (feature by feature), per-id ``weights`` [N] or None, ``mode`` "sum" or "mean", and
    the first output column of its ``num_features`` features (their columns are adjacent)."""

    offsets: torch.Tensor
    lengths: torch.Tensor
    weights: Optional[torch.Tensor]
    mode: str
    column: int
    num_features: int

    def pool_into(self, out: torch.Tensor, table: DynamicTable, batch: TableBatch) -> None:
        """Write the bags into their columns of ``out`` [B, C]: straight from the table's
        rows by a kernel when they can be read in place, else by ``embedding_bag`` over the
        looked-up unique rows."""
        size, dim = out.shape[0], table.dim
        in_place = table.rows_in_place(batch)
        if in_place is not None:
            weights, occ_slots = in_place
            cols = self.column + dim * torch.arange(self.num_features, device=out.device)
            scale = (self.weights if self.weights is not None else
                     torch.empty(0, dtype=torch.float32, device=out.device))
            table.kernels.pool_bags(weights, occ_slots, self.offsets, scale,
                                    self.mode == "mean", size, cols, dim, out)
            return
        pooled = F.embedding_bag(batch.inverse, table.lookup(batch), self.offsets,
                                 mode=self.mode, per_sample_weights=self.weights,
                                 include_last_offset=True)  # [F * B, D]
        out[:, self.column:self.column + self.num_features * dim] = (
            pooled.view(self.num_features, size, dim).transpose(0, 1).reshape(size, -1))

    def occurrence_grads(self, grad_out: torch.Tensor, inverse: torch.Tensor, num_rows: int,
                         dim: int, clip: Optional[float], strided: bool) -> OccurrenceGrads:
        """Each id's gradient as the kernel sums it, from the output's gradient [B, C]: its
        bag's gradient (divided by the bag length for MEAN: the gradient of the sum, where
        fbgemm clips), times the id's weight. ``strided``: the kernel may read the bags'
        gradients in place from ``grad_out``'s columns. No host sync."""
        size = grad_out.shape[0]
        cols = grad_out[:, self.column:self.column + self.num_features * dim]
        if self.num_features == 1:
            grad_bags = cols if strided else cols.contiguous()
        else:  # bag i * B + b is feature i of sample b
            grad_bags = cols.reshape(size, self.num_features, dim).transpose(0, 1).reshape(
                -1, dim)
        scale = self.weights
        if self.mode == "mean":
            per_bag = self.lengths.clamp(min=1).to(torch.float32)
            if clip is not None:  # clipped after the division: divide the bags' gradients
                grad_bags = grad_bags / per_bag.unsqueeze(1)
            else:  # no clipping: the division rides on each id's scale
                bag_scale = (1.0 / per_bag).repeat_interleave(self.lengths,
                                                              output_size=inverse.numel())
                scale = bag_scale if scale is None else scale * bag_scale
        bag_of_id = torch.repeat_interleave(
            torch.arange(self.lengths.numel(), device=inverse.device), self.lengths,
            output_size=inverse.numel())
        offsets, order = occurrence_csr(inverse, num_rows)
        return OccurrenceGrads(grad_bags.to(torch.float32), offsets,
                               bag_of_id[order].contiguous(),
                               None if scale is None else scale[order].contiguous(), clip)


#: one table's part of a pooled lookup: its name, looked-up batch and bags
TableBags = Tuple[str, TableBatch, "Bags"]


def pool_all(core: DynamicCore, tables: List[TableBags], size: int,
             columns: int) -> torch.Tensor:
    """Every table's bags pooled into one [``size``, ``columns``] output."""
    out = torch.empty(size, columns, device=core.device)
    for name, batch, bags in tables:
        bags.pool_into(out, core.tables[name], batch)
    return out


class PooledLookup(torch.autograd.Function):
    """Every table's bags [B, sum of dims]; backward applies each table's fused optimizer
    straight from the output's gradient (no per-table gradient or [U, D] tensor)."""

    @staticmethod
    def forward(ctx, anchor, core: DynamicCore, tables: List[TableBags], size: int,
                columns: int):
        ctx.core, ctx.tables = core, tables
        ctx.generation = core.generation
        return pool_all(core, tables, size, columns)

    @staticmethod
    def backward(ctx, grad_out):
        core = ctx.core
        core.before_backward()
        for name, batch, bags in ctx.tables:
            table = core.tables[name]
            grads = bags.occurrence_grads(grad_out, batch.inverse, batch.keys.numel(),
                                          table.dim, core.max_gradient,
                                          table.kernels.name == "cpu")
            core.apply_gradients(name, batch, grads, ctx.generation)
        return None, None, None, None, None
