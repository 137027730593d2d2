"""One batch's prefetch over a module's groups and tables, all or nothing.

Every claim comes before any row is filled: a table that refuses the batch (its buckets full
of pinned rows, or NO_EVICTION and full) raises while the claims of the tables before it can
still be taken back exactly (keys, scores, sizes, clocks, pins), so a refused batch changes
no table (on the CUDA kernels a claim never refuses at once: its refused keys are reported
at a later prefetch, ``dynemb.tables.group_failures``). What cannot be taken back runs after
every claim that can: the tables whose prefetch is more than a claim (DEFAULT, which claims
in forward, and admission, which counts keys before it claims). Filling the rows comes last;
a store that fails there takes back its own table's claim and those not yet filled.

The prefetch runs over the module's groups (:mod:`dynemb.tables.groups`: every table is in
one, a group of one where it has no partner), a :class:`~dynemb.tables.groups.TableGroup` or
a DEFAULT :class:`~dynemb.tables.group_tiers.TieredGroup`, through what both offer, without
asking which it holds. A group serves the tables ``names``, with one input per table, in
that order (keys, occurrences, scores), and answers with one
:class:`~dynemb.tables.lookup_batch.LookupBatch` for all of them:

- ``claims_apart()``: whether ``claim_batch`` of a training batch only claims (then
  ``finish_batch`` fills and counts, or ``undo_batch`` takes the claim back exactly); else
  ``prefetch`` does all of the prefetch at once, and nothing can be taken back;
- ``claim_batch(keys, occurrences, scores)``: the claimed batch; a key that finds no slot
  raises the ``TableFullError`` its table alone raises, the group unchanged;
- ``prefetch(keys, occurrences, scores)``: a training batch, claimed and filled;
- ``lookup_batch(keys, occurrences)``: a read-only (eval) batch;
- ``check_failures()``: raise the ``TableFullError`` of keys of earlier batches that found no
  slot on the CUDA kernels.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Mapping, Sequence, Tuple

#: by table name: (keys, [(feature, count), ...], occurrences or None), as split_by_table
Inputs = Mapping[str, Tuple[Any, Any, Any]]


def prefetch_all(units: Sequence, inputs: Inputs, training: bool, scores: Mapping[str, int],
                 release: Callable[[Iterable[Tuple[str, Any]]], None]) -> Dict[str, Any]:
    """Each table's batch (the tables of a unit share theirs) of ``inputs``; on any error
    the claims are taken back, every pin taken ends (``release``) and the error propagates.
    ``units``: the module's groups (see the module docstring)."""
    if not training:
        return _look_up_all(units, inputs, release)
    batches: Dict[str, Any] = {}
    claimed: List[Tuple[Any, Any]] = []  # (unit, batch) not yet filled
    try:
        for unit in units:
            if unit.claims_apart():  # a key without a slot raises, its unit unchanged
                batch = unit.claim_batch(*_unit_inputs(unit, inputs, scores))
                batches.update((name, batch) for name in unit.names)
                claimed.append((unit, batch))
        for unit in units:  # the rest: all of their prefetch
            if not unit.claims_apart():
                batch = unit.prefetch(*_unit_inputs(unit, inputs, scores))
                batches.update((name, batch) for name in unit.names)
        for unit, batch in claimed:
            unit.finish_batch(batch)
    except Exception:
        for unit, batch in reversed(claimed):
            if batch.pending is not None:  # claimed, not filled: taken back
                unit.undo_batch(batch)
        release(batches.items())
        raise
    return batches


def _look_up_all(units: Sequence, inputs: Inputs,
                 release: Callable[[Iterable[Tuple[str, Any]]], None]) -> Dict[str, Any]:
    """A read-only batch: nothing to take back, the pins taken end on an error."""
    batches: Dict[str, Any] = {}
    try:
        for unit in units:
            keys, occurrences, _ = _unit_inputs(unit, inputs, {})
            batch = unit.lookup_batch(keys, occurrences)
            batches.update((name, batch) for name in unit.names)
    except Exception:
        release(batches.items())
        raise
    return batches


def _unit_inputs(unit, inputs: Inputs, scores: Mapping[str, int]):
    """A unit's keys, occurrences and scores, one of each per table."""
    names = unit.names
    return ([inputs[n][0] for n in names], [inputs[n][2] for n in names],
            [scores.get(n) for n in names])


def check_failures(units: Sequence) -> None:
    """Raise the ``TableFullError`` of keys of earlier batches that found no slot on the CUDA
    kernels, before any table claims the new batch."""
    for unit in units:
        unit.check_failures()
