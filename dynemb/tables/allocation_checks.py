"""Whether the up-front allocations of a module's tables fit the memory they go to, checked
before anything is allocated: each table alone, then all of them together, with the options
that allocate less named in the error. What a table allocates up front, and how to make it
allocate less, is its storage policy's (:mod:`dynemb.tables.policies`)."""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch

from dynemb.backends.device_values import total_memory
from dynemb.rows.hash_table import SLOT_BYTES
from dynemb.options import DynamicEmbTableOptions, TableLayout
from dynemb.tables.policies import storage_policy


def check_allocation(layout: TableLayout, options: DynamicEmbTableOptions, *, name: str,
                     device: torch.device) -> None:
    """Raise if the rows a table allocates up front (hash slots and rows) exceed the memory
    of ``device``, or of the host for the DEFAULT mode's host tier, naming the options that
    allocate less.

    Example::

        >>> from dynemb.options import choose_storage_mode
        >>> layout = choose_storage_mode(DynamicEmbTableOptions(), name="t", width=64,
        ...                              num_embeddings=2**36, config_dtype=torch.float32)
        >>> check_allocation(layout, DynamicEmbTableOptions(), name="t",
        ...                  device=torch.device("cpu"))
        Traceback (most recent call last):
        ValueError: table 't': the 151284754176 rows allocated up front (init_capacity, ...
    """
    for where, nbytes in _upfront_bytes(layout, device).items():
        total = total_memory(where)
        if total is not None and nbytes > total:
            upfront_rows = storage_policy(layout.mode).upfront_rows_text(layout, options)
            raise ValueError(
                f"table {name!r}: {upfront_rows} need {_gib(nbytes)} on {where}, which has "
                f"{_gib(total)}; {_allocate_less(layout)}")


def check_allocations(tables: Sequence[Tuple[str, TableLayout, DynamicEmbTableOptions]], *,
                      device: torch.device) -> None:
    """:func:`check_allocation` of each ``(name, layout, options)``, then of what they
    allocate up front together (a module builds all its tables, or none): raise, before
    anything is allocated, if the sum exceeds the memory of a device, naming the largest
    tables and the options that allocate less.

    Example::

        >>> from dynemb.options import choose_storage_mode
        >>> layout = choose_storage_mode(DynamicEmbTableOptions(), name="t", width=64,
        ...                              num_embeddings=2**21, config_dtype=torch.float32)
        >>> check_allocations([(f"t{i}", layout, DynamicEmbTableOptions()) for i in range(999)],
        ...                   device=torch.device("cpu"))  # 0.7 GiB each
        Traceback (most recent call last):
        ValueError: the 999 tables of the module allocate ... GiB up front on cpu together, ...
    """
    totals: Dict[torch.device, int] = {}
    by_table: Dict[torch.device, list] = {}
    for name, layout, options in tables:
        check_allocation(layout, options, name=name, device=device)
        for where, nbytes in _upfront_bytes(layout, device).items():
            totals[where] = totals.get(where, 0) + nbytes
            by_table.setdefault(where, []).append((nbytes, name, layout))
    for where, nbytes in totals.items():
        total = total_memory(where)
        if total is None or nbytes <= total:
            continue
        largest = sorted(by_table[where], key=lambda entry: -entry[0])
        named = ", ".join(f"{name!r} {_gib(n)}" for n, name, _ in largest[:5])
        more = f" and {len(largest) - 5} more" if len(largest) > 5 else ""
        hints = list(dict.fromkeys(_allocate_less(layout) for n, _, layout in largest if n))
        raise ValueError(
            f"the {len(tables)} tables of the module allocate {_gib(nbytes)} up front on "
            f"{where} together, which has {_gib(total)} (largest: {named}{more}); each fits "
            f"alone, not all of them: " + "; or ".join(hints))


def _upfront_bytes(layout: TableLayout, device: torch.device) -> Dict[torch.device, int]:
    """Bytes of hash slots and rows a table of ``layout`` allocates up front, by device."""
    policy = storage_policy(layout.mode)
    slot = layout.row_bytes + SLOT_BYTES
    needs = {device: policy.upfront_device_rows(layout) * slot}
    host = torch.device("cpu")
    needs[host] = needs.get(host, 0) + policy.upfront_host_rows(layout) * slot
    return needs


def _allocate_less(layout: TableLayout) -> str:
    return storage_policy(layout.mode).allocate_less_text(layout)


def _gib(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it at least 1 (three significant
    digits), so that no table's size reads as "0.0 GiB".

    >>> _gib(60_000 * 80), _gib(3 * 2**30), _gib(512)
    ('4.58 MiB', '3 GiB', '512 bytes')
    """
    if n < 1024:
        return f"{n} bytes"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024
        if n < 1024 or unit == "PiB":
            return f"{n:.3g} {unit}"
