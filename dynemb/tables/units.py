"""The units a module's prefetch runs over: each :class:`~dynemb.tables.groups.TableGroup`,
and each table that trains alone as a :class:`LoneTable`, a unit of one table.

A unit serves the tables ``names``, with one input per table, in that order (keys,
occurrences, scores), and answers with one
:class:`~dynemb.tables.lookup_batch.LookupBatch` for all of them:

- ``claims_apart()``: whether ``claim_batch`` of a training batch only claims (then
  ``finish_batch`` fills and counts, or ``undo_batch`` takes the claim back exactly); else
  ``prefetch`` does all of the prefetch at once, and nothing can be taken back;
- ``claim_batch(keys, occurrences, scores)``: the claimed batch, or None when a key found no
  slot and the unit claimed nothing (its tables then claim one by one, ``alone()``, which
  raise the error a table alone raises);
- ``prefetch(keys, occurrences, scores)``: a training batch, claimed and filled;
- ``lookup_batch(keys, occurrences)``: a read-only (eval) batch;
- ``check_failures()``: raise the ``TableFullError`` of keys of earlier batches that found no
  slot on the CUDA kernels;
- ``rows``: where the unit's rows live, as memory stashing (:mod:`dynemb.stashing`) moves
  them: a table's own tier, or the rows of a group (its tables' in one tensor).

:mod:`dynemb.modules.batch_claims` runs a batch's prefetch over them, all or nothing, without asking
which kind of unit it holds.
"""
from __future__ import annotations

from typing import List, Mapping, Optional, Sequence, Tuple

import torch

from dynemb.tables.base import DynamicTable
from dynemb.tables.batch import TableBatch


class LoneTable:
    """A table that trains alone, seen as a unit of one table (see the module docstring)."""

    def __init__(self, table: DynamicTable):
        self.table = table
        self.names: Tuple[str, ...] = (table.name,)

    def claims_apart(self) -> bool:
        return self.table.claims_apart(True)

    def claim_batch(self, keys: Sequence[torch.Tensor],
                    occurrences: Sequence[Optional[torch.Tensor]],
                    scores: Sequence[Optional[int]]) -> TableBatch:
        return self.table.claim_batch(keys[0], True, occurrences[0], scores[0])

    def finish_batch(self, batch: TableBatch) -> TableBatch:
        return self.table.finish_batch(batch)

    def undo_batch(self, batch: TableBatch) -> None:
        self.table.undo_batch(batch)

    def prefetch(self, keys: Sequence[torch.Tensor],
                 occurrences: Sequence[Optional[torch.Tensor]],
                 scores: Sequence[Optional[int]]) -> TableBatch:
        return self.table.prefetch(keys[0], True, occurrences=occurrences[0], score=scores[0])

    def lookup_batch(self, keys: Sequence[torch.Tensor],
                     occurrences: Sequence[Optional[torch.Tensor]]) -> TableBatch:
        return self.table.prefetch(keys[0], False, occurrences=occurrences[0])

    def check_failures(self) -> None:
        self.table.check_failures()

    def alone(self) -> List["LoneTable"]:
        return [self]

    @property
    def rows(self):
        return self.table.tier


def work_units(groups: Sequence, tables: Mapping[str, DynamicTable]) -> List:
    """``groups`` (in their order), then every table of ``tables`` in none of them as a
    :class:`LoneTable` (in table order)."""
    grouped = {name for group in groups for name in group.names}
    return [*groups, *(LoneTable(table) for name, table in tables.items()
                       if name not in grouped)]
