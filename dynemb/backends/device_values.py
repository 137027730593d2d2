"""What the layers above ask of a device by its type: small host values (sizes, bounds,
clocks) sent to it without stalling the host, and how much memory it has."""
from __future__ import annotations

import os
from typing import Optional, Sequence

import torch


def values_on(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a 1-D tensor on ``device``. For a CUDA device the copy goes through
    pinned memory and does not wait for it: a copy from pageable memory makes the host wait
    for the device, and torch's pinned-memory allocator keeps the buffer until the copy has
    run.

    Example::

        >>> values_on([0, 3, 5], torch.int64, torch.device("cpu")).tolist()
        [0, 3, 5]
    """
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def total_memory(device: torch.device) -> Optional[int]:
    """Total bytes of ``device``'s memory (host RAM for the CPU); None where unknown.

    Example::

        >>> total_memory(torch.device("cpu")) > 0, total_memory(torch.device("meta"))
        (True, None)
    """
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError, RuntimeError, AssertionError):
        pass
    return None
