"""One batch's prefetch over a module's groups and tables, all or nothing.

Every claim comes before any row is filled: a table that refuses the batch (its buckets full
of pinned rows, or NO_EVICTION and full) raises while the claims of the tables before it can
still be taken back exactly (keys, scores, sizes, clocks, pins), so a refused batch changes
no table. What cannot be taken back runs after every claim that can: a CUDA group's prefetch
(which never refuses at once: its failures are reported at a later prefetch), and the tables
whose prefetch is more than a claim (DEFAULT, which claims in forward, and admission, which
counts keys before it claims). Filling the rows comes last; a store that fails there takes
back its own table's claim and those not yet filled.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Mapping, Sequence, Tuple

from dynemb.tables import DynamicTable
from dynemb.tables.groups import TableGroup

#: by table name: (keys, [(feature, count), ...], occurrences or None), as split_by_table
Inputs = Mapping[str, Tuple[Any, Any, Any]]


def prefetch_all(groups: Sequence[TableGroup], tables: Mapping[str, DynamicTable],
                 inputs: Inputs, training: bool, scores: Mapping[str, int],
                 release: Callable[[Iterable[Tuple[str, Any]]], None]) -> Dict[str, Any]:
    """Each table's batch (a group's tables share theirs) of ``inputs``; on any error the
    claims are taken back, every pin taken ends (``release``) and the error propagates.
    ``groups``: for a training batch, those to claim as one; else those that look up as one
    (:meth:`~dynemb.tables.groups.TableGroup.lookup_batch`)."""
    if not training:
        return _look_up_all(groups, tables, inputs, scores, release)
    batches: Dict[str, Any] = {}
    claimed: List[Tuple[Any, Any]] = []  # (group or table, batch) not yet filled
    at_once = [group for group in groups if not group.claims_apart()]
    later = {name for group in at_once for name in group.names}
    try:
        for group in groups:
            if group.claims_apart():
                batch = group.claim_batch(*_group_inputs(group, inputs, scores))
                if batch is not None:  # None: a key found no slot; alone, they say where
                    batches.update((name, batch) for name in group.names)
                    claimed.append((group, batch))
        for name, table in tables.items():
            if name not in batches and name not in later and table.claims_apart(training):
                keys, _, occurrences = inputs[name]
                batches[name] = table.claim_batch(keys, training, occurrences, scores.get(name))
                claimed.append((table, batches[name]))
        for group in at_once:
            batch = group.prefetch(*_group_inputs(group, inputs, scores))
            batches.update((name, batch) for name in group.names)
        for name, table in tables.items():  # the rest: all of their prefetch
            if name not in batches:
                keys, _, occurrences = inputs[name]
                batches[name] = table.prefetch(keys, training, occurrences=occurrences,
                                               score=scores.get(name))
        for owner, batch in claimed:
            owner.finish_batch(batch)
    except Exception:
        for owner, batch in reversed(claimed):
            if batch.pending is not None:  # claimed, not filled: taken back
                owner.undo_batch(batch)
        release(batches.items())
        raise
    return batches


def _look_up_all(groups: Sequence[TableGroup], tables: Mapping[str, DynamicTable],
                 inputs: Inputs, scores: Mapping[str, int],
                 release: Callable[[Iterable[Tuple[str, Any]]], None]) -> Dict[str, Any]:
    """A read-only batch: nothing to take back, the pins taken end on an error."""
    batches: Dict[str, Any] = {}
    try:
        for group in groups:
            keys, occurrences, _ = _group_inputs(group, inputs, scores)
            batch = group.lookup_batch(keys, occurrences)
            batches.update((name, batch) for name in group.names)
        for name, table in tables.items():
            if name not in batches:
                keys, _, occurrences = inputs[name]
                batches[name] = table.prefetch(keys, False, occurrences=occurrences,
                                               score=scores.get(name))
    except Exception:
        release(batches.items())
        raise
    return batches


def _group_inputs(group: TableGroup, inputs: Inputs, scores: Mapping[str, int]):
    """A group's keys, occurrences and scores, one of each per table."""
    names = group.names
    return ([inputs[n][0] for n in names], [inputs[n][2] for n in names],
            [scores.get(n) for n in names])


def check_failures(groups: Sequence[TableGroup], tables: Iterable[DynamicTable]) -> None:
    """Raise the ``TableFullError`` of keys of earlier batches that found no slot on the CUDA
    kernels, before any table claims the new batch."""
    for owner in [*groups, *tables]:
        owner.check_failures()
