"""``write_rows`` of a row-wise sharded module: every rank's keys go to their owners, all or
nothing over the ranks.

A collective: every rank calls it (with its own keys, rows, optimizer state and scores,
possibly none), and the ranks agree twice before anything is written:

1. each rank checks its own input against its share of the table (dim, dtype, a key twice,
   widths): if any rank's is bad, every rank raises;
2. the keys, rows, optimizer state and scores travel to the keys' owners
   (:func:`~dynemb.sharding.routing.owner_ranks`, ``all_to_all_single``; rows as raw bytes, so
   every dtype travels bit for bit); each owner checks what it received (a key sent by two
   ranks is a key twice) and claims its slots (:class:`~dynemb.tables.row_writes.RowWrite`);
3. if every owner claimed, every owner writes; else every owner takes its claim back and
   every rank raises (the refusing rank its own error, the others one naming it).
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.distributed as dist

from dynemb.sharding.routing import owner_ranks
from dynemb.tables.row_writes import check_write
from dynemb.types import TableFullError

#: What a rank's refusal was, as its code in the agreement (0: none).
_ERRORS = (KeyError, TypeError, ValueError, TableFullError)


def write_rows_sharded(local, group, rank: int, world: int, table: str, keys: torch.Tensor,
                       rows: torch.Tensor, optimizer_state: Optional[torch.Tensor] = None,
                       scores: Optional[torch.Tensor] = None) -> None:
    """See the module docstring; ``local`` is this rank's share of the tables (a
    :class:`~dynemb.DynamicEmbCollection`), ``group`` the process group of the ``world``
    ranks, this one ``rank``."""
    device = local.device
    error = None
    try:  # 1. this rank's input, checked against its share of the table
        if table not in local.tables:
            raise KeyError(f"no table {table!r} to write rows into; tables: "
                           f"{list(local.tables)}")
        checked = check_write(local.tables[table], keys, rows, optimizer_state, scores,
                              local.scores.get(table))
    except _ERRORS as err:
        error = err
    _agree(error, group, rank, world, device, table, "its input")
    # 2. to the owners
    dest = owner_ranks(checked.keys, world, local.table_options[table].sharding)
    order = torch.sort(dest, stable=True).indices
    send = torch.bincount(dest, minlength=world).to(device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_splits, recv_splits = send.tolist(), recv.tolist()

    def exchange(values: torch.Tensor) -> torch.Tensor:
        row_bytes = math.prod(values.shape[1:]) * values.element_size()
        raw = values[order].contiguous().view(torch.uint8).reshape(-1, row_bytes)  # any dtype
        out = torch.empty(sum(recv_splits), row_bytes, dtype=torch.uint8, device=device)
        dist.all_to_all_single(out, raw.to(device), recv_splits, send_splits, group=group)
        return out.view(values.dtype).reshape(-1, *values.shape[1:])

    got_keys = exchange(checked.keys)
    got_rows = exchange(checked.rows)
    # whether a rank sends state or scores is its choice: all or none must
    sends = torch.tensor([checked.state is not None, checked.scores is not None],
                         dtype=torch.int64, device=device)
    agreed = sends.clone()
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(sends, op=dist.ReduceOp.MAX, group=group)
    error = None
    if not torch.equal(agreed, sends):
        what = "optimizer_state" if agreed[0] != sends[0] else "scores"
        error = ValueError(f"write_rows into table {table!r}: some ranks pass {what} and "
                           f"others do not; pass it on every rank or on none")
    got_state = exchange(checked.state) if bool(agreed[0]) else None
    got_scores = exchange(checked.scores) if bool(agreed[1]) else None
    # 3. every owner claims; all write, or none
    write = None
    if error is None:
        try:
            write = local.prepare_write(table, got_keys, got_rows,
                                        optimizer_state=got_state, scores=got_scores)
            write.claim()
        except _ERRORS as err:
            error, write = err, None
    try:
        _agree(error, group, rank, world, device, table, "its share of the keys")
    except BaseException:
        if write is not None:
            write.undo()
        raise
    write.commit()


def _agree(error: Optional[BaseException], group, rank: int, world: int,
           device: torch.device, table: str, what: str) -> None:
    """Every rank learns whether any refused (``error``: this rank's refusal, or None); if
    one did, every rank raises: its own error, or one of the first refusing rank's type
    naming it."""
    codes = torch.zeros(world, dtype=torch.int64, device=device)
    if error is not None:
        codes[rank] = 1 + next(i for i, kind in enumerate(_ERRORS) if isinstance(error, kind))
    dist.all_reduce(codes, group=group)
    refusing: List[int] = [r for r, code in enumerate(codes.tolist()) if code]
    if not refusing:
        return
    if error is not None:
        raise error
    kind = _ERRORS[int(codes[refusing[0]]) - 1]
    message = (f"write_rows into table {table!r}: rank(s) {refusing} refused {what}; "
               f"nothing was written on any rank")
    if kind is TableFullError:
        raise TableFullError(message, torch.empty(0, dtype=torch.int64), None)
    raise kind(message)
