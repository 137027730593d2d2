"""Pooling dynamic tables' rows into bags, and the autograd step of a pooled lookup (used by
:class:`~dynemb.modules.bag_collection.DynamicEmbBagCollection`).

One path for every batch (:class:`~dynemb.tables.lookup_batch.LookupBatch`: a group's
tables, or a table alone): the batch says where its rows are
(:meth:`~dynemb.tables.lookup_batch.LookupBatch.pooling_rows`), its tables' bags pool from
them in one call when the tables pool alike (else one per table), and backward builds every
id's gradient of all its tables in one :class:`~dynemb.rows.optimizers.OccurrenceGrads` for one
fused update.

Shapes: B samples, F features of a table, N ids of a batch (all features of all its tables),
U its unique ids, D the embedding dim, C the output's columns (the sum of the features' dims).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from dynemb.backends.device_values import values_on
from dynemb.modules.dynamic_core import DynamicCore
from dynemb.rows.optimizers import OccurrenceGrads, occurrence_csr
from dynemb.tables.lookup_batch import LookupBatch, PoolingRows


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


#: one table's part of a pooled lookup: its name, looked-up batch and bags
TableBags = Tuple[str, LookupBatch, Bags]
#: the tables of one batch with their bags, in the batch's order
Members = List[Tuple[str, Bags]]


def lookup_units(tables: Sequence[TableBags]) -> List[Tuple[LookupBatch, Members]]:
    """Each batch once (at its first table), with the bags of its tables in the batch's
    order (that of its ids)."""
    bags_of: Dict[int, Dict[str, Bags]] = {}
    batches: Dict[int, LookupBatch] = {}
    for name, batch, bags in tables:
        batches.setdefault(id(batch), batch)
        bags_of.setdefault(id(batch), {})[name] = bags
    return [(batch, [(name, bags_of[key][name]) for name in batch.names
                     if name in bags_of[key]])
            for key, batch in batches.items()]


def pool_all(core: DynamicCore, tables: Sequence[TableBags], size: int,
             columns: int) -> torch.Tensor:
    """Every table's bags pooled into one [``size``, ``columns``] output."""
    out = torch.empty(size, columns, device=core.device)
    for batch, members in lookup_units(tables):
        pool_batch(out, batch, members)
    return out


def pool_batch(out: torch.Tensor, batch: LookupBatch, members: Members) -> None:
    """A batch's tables' bags into their columns of ``out`` [B, C], by the pooling kernel
    straight from the rows :meth:`~dynemb.tables.lookup_batch.LookupBatch.pooling_rows`
    names; in one call for all the tables when they pool alike, else one per table."""
    source = batch.pooling_rows()
    uniform = len({bags.mode for _, bags in members}) == 1
    for part in ([members] if uniform else [[m] for m in members]):
        _pool_by_kernel(out, batch, source, part)


def _pool_by_kernel(out: torch.Tensor, batch: LookupBatch, source: PoolingRows,
                    part: Members) -> None:
    size, dim = out.shape[0], batch.dim
    starts = [batch.key_range(name)[0] for name, _ in part]
    scale = (_joined([bags.weights for _, bags in part]) if part[0][1].weights is not None
             else torch.empty(0, dtype=torch.float32, device=out.device))
    batch.kernels.pool_bags(source.rows, source.index, _bag_offsets(part, starts), scale,
                            part[0][1].mode == "mean", size, _columns(part, dim, out.device),
                            dim, out)


def _bag_offsets(part: Members, starts: Sequence[int]) -> torch.Tensor:
    """The bags of ``part``'s tables, one after the other, over ids whose table ``i``'s
    start at ``starts[i]``."""
    if len(part) == 1 and starts[0] == 0:
        return part[0][1].offsets
    return torch.cat([bags.offsets[:-1] + start for (_, bags), start in zip(part, starts)]
                     + [part[-1][1].offsets[-1:] + starts[-1]])


def _joined(tensors: List[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def pooled_grads(grad_out: torch.Tensor, batch: LookupBatch, members: Members,
                 clip: Optional[float]) -> OccurrenceGrads:
    """The gradient of every id of a batch's tables from the output's gradient [B, C], in
    one, with a number of ops that does not depend on the number of tables (but the ``cat``
    of their lengths and weights): each id's bag's gradient (divided by the bag length for
    MEAN: the gradient of the sum, where fbgemm clips), times the id's weight. No host sync.

    Through a view of ``grad_out`` [B, C] whose row ``r`` is ``grad_out.view(-1)[r:r + dim]``,
    the bag of feature column ``c`` and sample ``b`` is row ``b * C + c``. Where the update
    kernel reads strided gradients (the host kernels) it reads each id's bag gradient
    straight from that view (no copy). Elsewhere, and where clipped MEAN bags must be
    divided before the kernel clips them, the bags' gradients are gathered from the view in
    one indexing op."""
    dim = batch.dim
    size, columns = grad_out.shape
    grad_out = grad_out.contiguous()
    device = grad_out.device
    sample_rows = torch.arange(size, device=device) * columns
    # bag i * B + b of the batch's features in order: row b * C + (its feature's column)
    row_of_bag = (_columns(members, dim, device)[:, None]
                  + sample_rows[None, :]).reshape(-1)
    lengths = _joined([bags.lengths for _, bags in members])
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
    if not batch.reads_strided_grads or divide_first:
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
        weights = _joined([bags.weights for _, bags in members])
        scale = weights if scale is None else weights * scale
    offsets, order = occurrence_csr(batch.inverse, batch.keys.numel())
    return OccurrenceGrads(src, offsets, row_of_id[order].contiguous(),
                           None if scale is None else scale[order].contiguous(), clip)


def _columns(members: Members, dim: int, device) -> torch.Tensor:
    """The first output column of each feature of the tables, in order."""
    return values_on([bags.column + dim * i for _, bags in members
                      for i in range(bags.num_features)], torch.int64, torch.device(device))


class PooledLookup(torch.autograd.Function):
    """Every table's bags [B, sum of dims]; backward applies the fused optimizer of each
    batch's tables straight from the output's gradient (no per-table gradient or [U, D]
    tensor)."""

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
        for batch, members in lookup_units(ctx.tables):  # every table takes the gradient
            grads = pooled_grads(grad_out, batch, members, core.max_gradient)
            core.apply_gradients(batch, grads, [True] * len(batch.names), ctx.generation)
        return None, None, None, None, None
