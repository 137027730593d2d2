"""Whether a table's up-front allocation fits the memory it goes to, checked before anything
is allocated, with the options that allocate less named in the error."""
from __future__ import annotations

import os
from typing import Optional

import torch

from dynemb.hash_table import SLOT_BYTES
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
    slot = layout.row_bytes + SLOT_BYTES
    host_rows = layout.host_tier_rows
    device_rows = layout.init_capacity
    if layout.mode is StorageMode.HOST_ONLY:
        device_rows, host_rows = 0, layout.max_capacity
    needs = {device: device_rows * slot}
    host = torch.device("cpu")
    needs[host] = needs.get(host, 0) + host_rows * slot
    for where, nbytes in needs.items():
        total = _memory_of(where)
        if total is not None and nbytes > total:
            raise ValueError(
                f"table {name!r}: {_upfront_rows(layout, options, host_rows)} need "
                f"{_gib(nbytes)} on {where}, which has {_gib(total)}; {_allocate_less(layout)}")


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
