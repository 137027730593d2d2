"""How a module's dynamic tables appear in its ``state_dict``.

Each table contributes, under the module's prefix::

    dynamic_tables.<table>.signature                        (the same on every rank)
    dynamic_tables.<table>.rank<r>_of_<w>.format            layout version (table_state)
    dynamic_tables.<table>.rank<r>_of_<w>.state             step and counters of rank r
    dynamic_tables.<table>.rank<r>_of_<w>.<tier>.layout     capacity, bucket size, clock,
                                                            entries, tombstones
    dynamic_tables.<table>.rank<r>_of_<w>.<tier>.keys       live entries only, shaped as
    dynamic_tables.<table>.rank<r>_of_<w>.<tier>.scores     the capacity (see table_state
    dynamic_tables.<table>.rank<r>_of_<w>.<tier>.slots      and padded_entries), with the
                                                            slot each sat in
    dynamic_tables.<table>.rank<r>_of_<w>.<tier>.rows
    dynamic_tables.<table>.rank<r>_of_<w>.<tier>.tombstones erased slots

An unsharded module is ``rank0_of_1``; rank ``r`` of a sharded module saves its own share,
so the names of one rank never collide with another's and ``torch.distributed.checkpoint``
writes each share once. Loading accepts any set of images (one, several, or parts of them,
as :class:`~dynemb.checkpoint.DynamicEmbLoadPlanner` reads them for another world size).

A table absent from the state dict is reported in ``missing_keys`` (its ``signature``), the
entries of a table the module lacks in ``unexpected_keys``, as ``nn.Module`` reports
parameters. ``load_state_dict(sd, strict=False)`` then loads the tables that are there;
with ``strict=True`` no table changes and ``load_state_dict`` raises naming the keys (see
:func:`tables_to_load`).
"""
from __future__ import annotations

import re
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from dynemb.checkpoint.load_strictness import load_is_strict
from dynemb.checkpoint.table_state import (SavedTable, can_restore_exactly, capture,
                                          check_compatible, parse)

NAMESPACE = "dynamic_tables"
_GROUP = re.compile(r"^rank(\d+)_of_(\d+)\.(.+)$")


def group_name(rank: int, world_size: int) -> str:
    return f"rank{rank}_of_{world_size}"


def save_tables(tables: Mapping, steps: Mapping[str, int], destination: Dict, prefix: str,
                rank: int = 0, world_size: int = 1) -> None:
    """Add every table's checkpoint tensors to ``destination`` (see the module docstring)."""
    group = group_name(rank, world_size)
    for name, table in tables.items():
        base = f"{prefix}{NAMESPACE}.{name}."
        for rel, tensor in capture(table, steps[name]).items():
            key = base + rel if rel == "signature" else f"{base}{group}.{rel}"
            destination[key] = tensor


def collect_saved(state_dict: Mapping[str, torch.Tensor], prefix: str,
                  table_names: List[str]) -> Tuple[Dict[str, List[SavedTable]], List[str]]:
    """The saved images of each table found under ``prefix`` (in rank order), and the keys
    under ``prefix`` + ``dynamic_tables.`` that belong to no table of the module."""
    base = f"{prefix}{NAMESPACE}."
    grouped: Dict[str, Dict[Tuple[int, int], Dict[str, torch.Tensor]]] = {}
    signatures: Dict[str, torch.Tensor] = {}
    unexpected = []
    for key, value in state_dict.items():
        if not key.startswith(base):
            continue
        table, _, rest = key[len(base):].partition(".")
        if table not in table_names:
            unexpected.append(key)
            continue
        if rest == "signature":
            signatures[table] = value
            continue
        match = _GROUP.match(rest)
        if match is None:
            unexpected.append(key)
            continue
        rank, world = int(match.group(1)), int(match.group(2))
        grouped.setdefault(table, {}).setdefault((rank, world), {})[match.group(3)] = value
    saved: Dict[str, List[SavedTable]] = {}
    for table, groups in grouped.items():
        if table not in signatures:
            raise ValueError(f"table {table!r}: the checkpoint has rows but no signature "
                             f"({base}{table}.signature)")
        saved[table] = [
            parse({"signature": signatures[table], **entries}, rank=rank, world_size=world,
                  where=f"table {table!r} ({group_name(rank, world)})")
            for (rank, world), entries in sorted(groups.items())]
    return saved, unexpected


def tables_to_load(state_dict: Mapping[str, torch.Tensor], prefix: str, table_names: List[str],
                   strict: bool, missing_keys: List[str],
                   unexpected_keys: List[str]) -> Optional[Dict[str, List[SavedTable]]]:
    """A dynamic module's ``_load_from_state_dict`` part before any table changes: the saved
    images of the tables ``state_dict`` holds (see :func:`collect_saved`), with the tables
    it lacks added to ``missing_keys`` (one key each,
    ``<prefix>dynamic_tables.<table>.signature``) and the keys of tables the module lacks to
    ``unexpected_keys``. None (load nothing, leave the module as it is: queued prefetches,
    lookups awaiting backward) when it holds no table of the module, or when the load is
    strict (:func:`~dynemb.checkpoint.load_strictness.load_is_strict` of ``strict``) and a
    key is missing or unexpected: ``load_state_dict`` then raises naming them, every table
    as it was. Damaged entries raise ``RuntimeError``.

    Example::

        >>> missing, unexpected = [], []
        >>> print(tables_to_load({}, "ec.", ["t0"], False, missing, unexpected), missing)
        None ['ec.dynamic_tables.t0.signature']
    """
    try:
        saved, unexpected = collect_saved(state_dict, prefix, table_names)
    except ValueError as err:
        raise RuntimeError(str(err)) from None
    unexpected_keys.extend(unexpected)
    absent = [n for n in table_names if n not in saved]
    missing_keys.extend(f"{prefix}{NAMESPACE}.{n}.signature" for n in absent)
    if not saved or ((absent or unexpected) and load_is_strict(strict)):
        return None
    return saved


def check_saved_tables(tables: Mapping[str, object],
                       saved: Mapping[str, List[SavedTable]]) -> set:
    """Check every saved image against the table it would replace (a table this module
    lacks, another dim, optimizer, dtype or score policy, a damaged slot image: ``ValueError``
    naming it) before anything changes; return the names of the tables that can be restored
    in place (one image of the same layout and storage mode), which cannot fail."""
    for name, parts in saved.items():
        if name not in tables:
            raise ValueError(f"the checkpoint has table {name!r}, this module has "
                             f"{list(tables)}")
        for part in parts:
            check_compatible(tables[name], part)
    return {n for n, parts in saved.items()
            if len(parts) == 1 and can_restore_exactly(tables[n], parts[0])}
