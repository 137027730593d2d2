"""Whether the up-front allocations of a module's tables fit the memory they go to, checked
before anything is allocated: each table alone, then all of them together, with the options
that allocate less named in the error."""
from __future__ import annotations

import os
from typing import Dict, Optional, Sequence, Tuple

import torch

from dynemb.rows.hash_table import SLOT_BYTES
from dynemb.options import DynamicEmbTableOptions, StorageMode, TableLayout


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
    host_rows = _host_rows(layout)
    for where, nbytes in _upfront_bytes(layout, device).items():
        total = _memory_of(where)
        if total is not None and nbytes > total:
            raise ValueError(
                f"table {name!r}: {_upfront_rows(layout, options, host_rows)} need "
                f"{_gib(nbytes)} on {where}, which has {_gib(total)}; {_allocate_less(layout)}")


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
        total = _memory_of(where)
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


def _host_rows(layout: TableLayout) -> int:
    return layout.max_capacity if layout.mode is StorageMode.HOST_ONLY else layout.host_tier_rows


def _upfront_bytes(layout: TableLayout, device: torch.device) -> Dict[torch.device, int]:
    """Bytes of hash slots and rows a table of ``layout`` allocates up front, by device."""
    slot = layout.row_bytes + SLOT_BYTES
    device_rows = 0 if layout.mode is StorageMode.HOST_ONLY else layout.init_capacity
    needs = {device: device_rows * slot}
    host = torch.device("cpu")
    needs[host] = needs.get(host, 0) + _host_rows(layout) * slot
    return needs


def _upfront_rows(layout: TableLayout, options: DynamicEmbTableOptions, host_rows: int) -> str:
    if layout.mode is StorageMode.CACHE:
        return f"the {layout.init_capacity} device rows of the memory budget"
    if layout.mode is StorageMode.HOST_ONLY:
        return f"the {host_rows} host rows of max_capacity, allocated up front,"
    if layout.mode is StorageMode.DEFAULT:
        return (f"the {layout.init_capacity} device rows of the memory budget and the "
                f"{host_rows} rows of the host tier, allocated up front,")
    if options.init_capacity is not None:
        source = "init_capacity"
    elif options.max_capacity is not None:
        source = "init_capacity, which defaults to max_capacity"
    else:
        source = ("init_capacity, which defaults to max_capacity, which defaults to room for "
                  "num_embeddings ids")
    return f"the {layout.init_capacity} rows allocated up front ({source})"


def _allocate_less(layout: TableLayout) -> str:
    if layout.mode is StorageMode.CACHE:
        return "lower the memory budget (local_hbm_for_values / global_hbm_for_values)"
    if layout.mode is StorageMode.HOST_ONLY:
        return "lower max_capacity (a HOST_ONLY table holds all of it in host memory)"
    if layout.mode is StorageMode.DEFAULT:
        return ("with caching=False the host tier holds max_capacity minus the device rows from "
                "the start: lower max_capacity, or set caching=True (its backing store grows "
                "as rows arrive)")
    return (f"set init_capacity to start smaller (the table grows up to max_capacity="
            f"{layout.max_capacity} as rows arrive), or a memory budget (local_hbm_for_values "
            f"/ global_hbm_for_values) with caching=True to keep only the hot rows on the device "
            f"(a backing store that grows as rows arrive holds the rest)")


def _memory_of(device: torch.device) -> Optional[int]:
    """Total bytes of ``device``'s memory (host RAM for CPU); None where unknown."""
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError, RuntimeError, AssertionError):
        pass
    return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
