"""Pooling a dynamic table's rows into bags, and the autograd step of a pooled lookup (used
by :class:`~dynemb.modules.bag_collection.DynamicEmbBagCollection`).

Shapes: B samples, F features of a table, N ids of a table (all its features), U its unique
ids in the batch, D its embedding dim, C the output's columns (the sum of the features' dims).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from dynemb.foundations.device_values import values_on
from dynemb.modules.dynamic_core import DynamicCore
from dynemb.rows.optimizers import OccurrenceGrads, occurrence_csr
from dynemb.tables import DynamicTable, TableBatch
from dynemb.tables.groups import GroupBatch


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
        rows by the pooling kernel when they can be read in place, else from its looked-up
        unique rows: by the kernel on the CUDA kernels (as a table group there pools, so that
        the two sum alike), by ``embedding_bag`` on CPU (as TorchRec's EBC and a serving
        export pool)."""
        size, dim = out.shape[0], table.dim
        in_place = table.rows_in_place(batch)
        if in_place is not None:
            weights, occ_slots = in_place
        elif table.kernels.name == "cuda":
            weights = table.lookup(batch).to(torch.float32).contiguous()
            occ_slots = batch.inverse.to(torch.int64).contiguous()
        else:
            pooled = F.embedding_bag(batch.inverse, table.lookup(batch), self.offsets,
                                     mode=self.mode, per_sample_weights=self.weights,
                                     include_last_offset=True)  # [F * B, D]
            out[:, self.column:self.column + self.num_features * dim] = (
                pooled.view(self.num_features, size, dim).transpose(0, 1).reshape(size, -1))
            return
        cols = self.column + dim * torch.arange(self.num_features, device=out.device)
        scale = (self.weights if self.weights is not None else
                 torch.empty(0, dtype=torch.float32, device=out.device))
        table.kernels.pool_bags(weights, occ_slots, self.offsets, scale, self.mode == "mean",
                                size, cols, dim, out)

    def occurrence_grads(self, grad_out: torch.Tensor, inverse: torch.Tensor, num_rows: int,
                         dim: int, clip: Optional[float], strided: bool) -> OccurrenceGrads:
        """Each id's gradient as the kernel sums it, from the output's gradient [B, C]: its
        bag's gradient (divided by the bag length for MEAN: the gradient of the sum, where
        fbgemm clips), times the id's weight. ``strided``: the kernel may read the bags'
        gradients in place from ``grad_out``'s columns. No host sync."""
        grad_bags, scale = self.bag_grads(grad_out, inverse.numel(), dim, clip, strided)
        offsets, order = occurrence_csr(inverse, num_rows)
        return OccurrenceGrads(grad_bags.to(torch.float32), offsets,
                               self.bag_of_id(inverse.numel())[order].contiguous(),
                               None if scale is None else scale[order].contiguous(), clip)

    def bag_of_id(self, num_ids: int) -> torch.Tensor:
        """[N] the bag of each id (feature ``i``'s bag of sample ``b`` is ``i * B + b``)."""
        return torch.repeat_interleave(
            torch.arange(self.lengths.numel(), device=self.lengths.device), self.lengths,
            output_size=num_ids)

    def bag_grads(self, grad_out: torch.Tensor, num_ids: int, dim: int, clip: Optional[float],
                  strided: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(each bag's gradient [F * B, dim], each id's scale [N] or None): what
        :meth:`occurrence_grads` hands the kernel, before the ids are put in row order."""
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
                                                              output_size=num_ids)
                scale = bag_scale if scale is None else scale * bag_scale
        return grad_bags, scale


#: one table's part of a pooled lookup: its name, looked-up batch and bags
TableBags = Tuple[str, TableBatch, "Bags"]


def lookup_units(tables: List[TableBags]):
    """The tables as the lookup runs them: ``(name, batch, bags)`` for a table alone, and
    ``(None, group batch, [(name, bags), ...])`` once per group (:mod:`dynemb.tables.groups`),
    at its first table."""
    seen = set()
    members: Dict[int, List[Tuple[str, Bags]]] = {}
    for name, batch, bags in tables:
        if isinstance(batch, GroupBatch):
            members.setdefault(id(batch), []).append((name, bags))
    for name, batch, bags in tables:
        if not isinstance(batch, GroupBatch):
            yield name, batch, bags
        elif id(batch) not in seen:
            seen.add(id(batch))
            yield None, batch, members[id(batch)]


def pool_all(core: DynamicCore, tables: List[TableBags], size: int,
             columns: int) -> torch.Tensor:
    """Every table's bags pooled into one [``size``, ``columns``] output."""
    out = torch.empty(size, columns, device=core.device)
    for name, batch, bags in lookup_units(tables):
        if name is None:
            pool_group(out, batch, bags)
        else:
            bags.pool_into(out, core.tables[name], batch)
    return out


def pool_group(out: torch.Tensor, batch: GroupBatch, members: List[Tuple[str, Bags]]) -> None:
    """A group's tables' bags into their columns of ``out`` [B, C], straight from the
    group's rows: one kernel call for all of them when they pool alike (else one per
    table)."""
    group = batch.group
    if batch.fallback is not None and group.kernels.name != "cuda":
        _pool_group_eval(out, batch, members)
        return
    size, dim = out.shape[0], group.dim
    occ_slots = batch.slots.index_select(0, batch.inverse)
    rows = group.weights
    if batch.seg is not None or batch.fallback is not None:
        # CUDA: a key without a slot pools zeros; eval: a key not stored pools its eval row
        rows = group.lookup_occurrences(batch, [occ_slots.numel()])[0]
        occ_slots = torch.arange(occ_slots.numel(), device=occ_slots.device)
    elif rows.dtype != torch.float32:  # float16 / bfloat16 rows: pool float32 copies
        rows = rows[:, :dim].float()
    uniform = len({bags.mode for _, bags in members}) == 1
    parts = [members] if uniform else [[m] for m in members]
    for part in parts:
        first = [batch.key_bounds[group.index[name]] for name, _ in part]
        offsets = torch.cat([bags.offsets[:-1] + start for (_, bags), start in zip(part, first)]
                            + [part[-1][1].offsets[-1:] + first[-1]])
        cols = _group_columns(part, dim, out.device)
        scale = (torch.cat([bags.weights for _, bags in part]) if part[0][1].weights is not None
                 else torch.empty(0, dtype=torch.float32, device=out.device))
        group.kernels.pool_bags(rows, occ_slots, offsets, scale, part[0][1].mode == "mean",
                                size, cols, dim, out)


def _pool_group_eval(out: torch.Tensor, batch: GroupBatch,
                     members: List[Tuple[str, Bags]]) -> None:
    """A group's read-only batch on CPU: ``embedding_bag`` over its unique rows (stored, or
    the eval initializer's), as each table alone pools its eval lookups, in one call when
    the tables pool alike. Each bag sums the same rows in the same order as alone."""
    group = batch.group
    size, dim = out.shape[0], group.dim
    rows = group.unique_rows(batch)
    uniform = len({bags.mode for _, bags in members}) == 1
    for part in ([members] if uniform else [[m] for m in members]):
        bounds = [(batch.key_bounds[group.index[name]], batch.key_bounds[group.index[name] + 1])
                  for name, _ in part]
        ids = torch.cat([batch.inverse[lo:hi] for lo, hi in bounds])
        starts = [0]
        for lo, hi in bounds:
            starts.append(starts[-1] + hi - lo)
        offsets = torch.cat([bags.offsets[:-1] + start for (_, bags), start in zip(part, starts)]
                            + [part[-1][1].offsets[-1:] + starts[-2]])
        weights = (torch.cat([bags.weights for _, bags in part])
                   if part[0][1].weights is not None else None)
        pooled = F.embedding_bag(ids, rows, offsets, mode=part[0][1].mode,
                                 per_sample_weights=weights, include_last_offset=True)
        columns = (_group_columns(part, dim, out.device)[:, None]
                   + torch.arange(dim, device=out.device)).reshape(-1)
        out[:, columns] = pooled.view(-1, size, dim).transpose(0, 1).reshape(size, -1)


def group_occurrence_grads(grad_out: torch.Tensor, batch: GroupBatch,
                           members: List[Tuple[str, Bags]],
                           clip: Optional[float]) -> OccurrenceGrads:
    """:meth:`Bags.occurrence_grads` for a whole group: every id of its tables, in one,
    with a number of ops that does not depend on the number of tables (but the ``cat`` of
    their lengths and weights).

    Through a view of ``grad_out`` [B, C] whose row ``r`` is ``grad_out.view(-1)[r:r + dim]``,
    the bag of feature column ``c`` and sample ``b`` is row ``b * C + c``. On CPU the kernel
    reads each id's bag gradient straight from that view (no copy). CUDA's update kernel takes
    contiguous rows, and clipped MEAN bags must be divided before the kernel clips them: there
    the bags' gradients are gathered from the view in one indexing op."""
    dim = batch.group.dim
    size, columns = grad_out.shape
    grad_out = grad_out.contiguous()
    device = grad_out.device
    sample_rows = torch.arange(size, device=device) * columns
    # bag i * B + b of the group's features in order: row b * C + (its feature's column)
    row_of_bag = (_group_columns(members, dim, device)[:, None]
                  + sample_rows[None, :]).reshape(-1)
    lengths = torch.cat([bags.lengths for _, bags in members])
    num_ids = batch.inverse.numel()
    per_bag = None  # each bag's divisor: its length for MEAN bags, 1 otherwise
    means = [bags.mode == "mean" for _, bags in members]
    if any(means):
        per_bag = lengths.clamp(min=1).to(torch.float32)
        if not all(means):
            is_mean = torch.repeat_interleave(
                values_on(means, torch.bool, device),
                values_on([bags.lengths.numel() for _, bags in members], torch.int64, device),
                output_size=lengths.numel())
            per_bag = torch.where(is_mean, per_bag, 1.0)
    rows = grad_out.to(torch.float32).as_strided((size * columns - dim + 1, dim), (1, 1))
    divide_first = per_bag is not None and clip is not None
    if batch.seg is not None or divide_first:
        src = rows[row_of_bag]  # [bags, dim], contiguous
        if divide_first:
            src = src / per_bag.unsqueeze(1)
        row_of_id = torch.repeat_interleave(torch.arange(row_of_bag.numel(), device=device),
                                            lengths, output_size=num_ids)
    else:
        src = rows
        row_of_id = torch.repeat_interleave(row_of_bag, lengths, output_size=num_ids)
    scale = None
    if per_bag is not None and not divide_first:  # the division rides on each id's scale
        scale = torch.repeat_interleave(1.0 / per_bag, lengths, output_size=num_ids)
    if members[0][1].weights is not None:  # a weighted collection: every table has weights
        weights = torch.cat([bags.weights for _, bags in members])
        scale = weights if scale is None else weights * scale
    offsets, order = occurrence_csr(batch.inverse, batch.keys.numel())
    return OccurrenceGrads(src, offsets, row_of_id[order].contiguous(),
                           None if scale is None else scale[order].contiguous(), clip)


def _group_columns(members: List[Tuple[str, Bags]], dim: int, device) -> torch.Tensor:
    """The first output column of each feature of the group's tables, in order."""
    return values_on([bags.column + dim * i for _, bags in members
                      for i in range(bags.num_features)], torch.int64, torch.device(device))


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
        for name, batch, bags in lookup_units(ctx.tables):
            if name is None:  # a group: every table takes the output's gradient
                grads = group_occurrence_grads(grad_out, batch, bags, core.max_gradient)
                core.apply_group_gradients(batch, grads, [True] * len(batch.names),
                                           ctx.generation)
                continue
            table = core.tables[name]
            grads = bags.occurrence_grads(grad_out, batch.inverse, batch.keys.numel(),
                                          table.dim, core.max_gradient,
                                          table.kernels.name == "cpu")
            core.apply_gradients(name, batch, grads, ctx.generation)
        return None, None, None, None, None
