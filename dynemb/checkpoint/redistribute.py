"""Loading a checkpoint into another world size or another sharding scheme: send every
saved row to its new owner.

Each rank holds some parts of the saved images (with
:class:`~dynemb.checkpoint.DynamicEmbLoadPlanner`, ``1 / world_size`` of each); it sends each
live entry to the rank that owns its key now (:func:`~dynemb.sharding.routing.owner_ranks`)
with ``all_to_all_single``, at most ``chunk_rows`` entries per rank and round, so no rank
ever gathers a whole table. What arrives becomes one :class:`SavedTable` per table, loaded by
key.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from dynemb.checkpoint.table_state import SavedTable, SavedTier, saved_scheme
from dynemb.options import ShardingScheme
from dynemb.tables.checkpoint_tiers import TIER_NAMES

#: The tiers of a checkpoint that hold rows, in the order they are saved.
_ROW_TIERS = tuple(name for name in TIER_NAMES if name != "admission")
#: Entries a rank sends per round (bounds the buffers of each exchange).
CHUNK_ROWS = 1 << 18


def on_their_owners(parts: List[SavedTable], rank: int, world_size: int,
                    scheme: ShardingScheme) -> bool:
    """Whether ``parts`` is this rank's own saved share with every key on this rank under
    ``scheme`` (so it may load slot for slot): saved by rank ``rank`` of ``world_size``
    under ``scheme`` (any scheme for a single rank)."""
    if len(parts) != 1 or (parts[0].rank, parts[0].world_size) != (rank, world_size):
        return False
    return saved_scheme(parts[0].signature) is scheme or world_size == 1


def redistribute(parts: List[SavedTable], tiers: List[str],
                 owner_of: Callable[[torch.Tensor], torch.Tensor], rank: int, world_size: int,
                 group: Optional[dist.ProcessGroup] = None,
                 chunk_rows: int = CHUNK_ROWS) -> SavedTable:
    """The entries of ``parts`` (held by this rank) that each rank owns, gathered on it.

    Collective: every rank of ``group`` calls it with the same ``tiers`` (the tiers the
    table has, in a fixed order); the row tiers the checkpoint has on any rank come too
    (a table saved in another storage mode: CACHE's ``host`` tier, the backing store, into
    an HBM_DIRECT table). The step is the largest saved one; the counters of saved
    rank ``k`` land on rank ``k % world_size`` (totals are kept); each tier's clock is the
    largest saved one. Duplicate entries (parts read by several ranks) are kept once."""
    signature = parts[0].signature if parts else None
    step = max((p.step for p in parts), default=0)
    step = int(_all_reduce_max(torch.tensor([step]), group))
    counters = [p.counters for p in parts if p.rank % world_size == rank]
    tiers = _with_saved_row_tiers(tiers, parts, group)
    # a tier the checkpoint lacks (another storage mode) still gets rows of the table's width
    row_spec = _row_spec([t for p in parts for t in p.tiers.values()])
    out_tiers: Dict[str, SavedTier] = {}
    for name in tiers:
        present = [p.tiers[name] for p in parts if name in p.tiers]
        clock = int(_all_reduce_max(torch.tensor([max((t.clock for t in present), default=0)]),
                                    group))
        live = [t.live() for t in present]
        keys = torch.cat([k for k, _, _ in live]) if live else torch.empty(0, dtype=torch.int64)
        scores = torch.cat([s for _, s, _ in live]) if live else torch.empty(0,
                                                                               dtype=torch.int64)
        has_rows = name != "admission"
        rows = torch.cat([r for _, _, r in live]) if live and has_rows else None
        keys, scores, rows = _exchange(keys.cpu(), scores.cpu(),
                                       None if rows is None else rows.cpu(), has_rows,
                                       owner_of, world_size, group, chunk_rows, row_spec)
        keys, scores, rows = _first_of_each_key(keys, scores, rows)
        out_tiers[name] = SavedTier(-1, 0, clock, keys, scores, rows)
    if signature is None:
        raise ValueError("no part of the checkpoint reached this rank")
    total = torch.stack(counters).sum(0) if counters else torch.zeros_like(parts[0].counters)
    return SavedTable(signature, step, total, out_tiers, rank, world_size)


def _with_saved_row_tiers(tiers: List[str], parts: List[SavedTable], group) -> List[str]:
    """``tiers`` and the row tiers any rank's ``parts`` have, in checkpoint order (the same
    on every rank)."""
    held = torch.tensor([int(name in tiers or any(name in p.tiers for p in parts))
                         for name in _ROW_TIERS])
    held = _all_reduce_max(held, group)
    row_tiers = [name for name, h in zip(_ROW_TIERS, held.tolist()) if h]
    return row_tiers + [name for name in tiers if name not in _ROW_TIERS]


def _row_spec(present: List[SavedTier]) -> Tuple[int, torch.dtype]:
    for tier in present:
        if tier.rows is not None:
            return tier.rows.shape[1], tier.rows.dtype
    return 0, torch.float32


def _all_reduce_max(value: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value


def _exchange(keys, scores, rows, has_rows, owner_of, world_size, group, chunk_rows,
              row_spec):
    """All-to-all of (keys, scores, rows) to their owners, in rounds of ``chunk_rows``."""
    # every rank must agree on the row shape to exchange empty buffers
    width, dtype = row_spec
    width = int(_all_reduce_max(torch.tensor([width]), group))
    dest = owner_of(keys) if keys.numel() else torch.empty(0, dtype=torch.int64)
    order = torch.sort(dest, stable=True).indices
    keys, scores, dest = keys[order], scores[order], dest[order]
    if has_rows:
        rows = (rows[order] if rows is not None else torch.empty(0, width, dtype=dtype))
        dtype = _agree_dtype(rows.dtype, group)
    rounds = int(_all_reduce_max(torch.tensor([-(-keys.numel() // chunk_rows)]), group))
    got_keys, got_scores, got_rows = [], [], []
    for r in range(rounds):
        lo, hi = r * chunk_rows, (r + 1) * chunk_rows
        part_dest = dest[lo:hi]
        send_splits = torch.bincount(part_dest, minlength=world_size)
        recv_splits = torch.empty_like(send_splits)
        dist.all_to_all_single(recv_splits, send_splits, group=group)
        send, recv = send_splits.tolist(), recv_splits.tolist()
        n = sum(recv)
        k = torch.empty(n, dtype=torch.int64)
        dist.all_to_all_single(k, keys[lo:hi].contiguous(), recv, send, group=group)
        s = torch.empty(n, dtype=torch.int64)
        dist.all_to_all_single(s, scores[lo:hi].contiguous(), recv, send, group=group)
        got_keys.append(k)
        got_scores.append(s)
        if has_rows:
            # rows travel as raw bytes: every dtype, one collective
            part = rows[lo:hi].to(dtype).contiguous()
            row_bytes = width * dtype.itemsize
            raw = torch.empty(n, row_bytes, dtype=torch.uint8)
            dist.all_to_all_single(raw, part.view(torch.uint8).reshape(-1, row_bytes),
                                   recv, send, group=group)
            got_rows.append(raw.view(dtype).reshape(n, width))
    keys = torch.cat(got_keys) if got_keys else torch.empty(0, dtype=torch.int64)
    scores = torch.cat(got_scores) if got_scores else torch.empty(0, dtype=torch.int64)
    rows = (torch.cat(got_rows) if got_rows else torch.empty(0, width, dtype=dtype)) \
        if has_rows else None
    return keys, scores, rows


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _agree_dtype(dtype: torch.dtype, group) -> torch.dtype:
    """The rows' dtype as the ranks that hold rows have it (a rank with none follows)."""
    code = torch.tensor([_DTYPES.index(dtype)])
    return _DTYPES[int(_all_reduce_max(code, group))]


def _first_of_each_key(keys, scores, rows):
    """Drop repeated keys (the same saved entry read twice), keeping the first."""
    if keys.numel() == 0:
        return keys, scores, rows
    unique, inverse = torch.unique(keys, return_inverse=True)
    if unique.numel() == keys.numel():
        return keys, scores, rows
    first = torch.full((unique.numel(),), keys.numel(), dtype=torch.int64)
    first = first.scatter_reduce(0, inverse, torch.arange(keys.numel()), reduce="amin")
    return keys[first], scores[first], None if rows is None else rows[first]
