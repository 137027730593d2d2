"""Small host values (sizes, bounds, clocks) sent to the device without stalling the host."""
from __future__ import annotations

from typing import Sequence

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
