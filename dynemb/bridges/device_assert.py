"""An assertion checked on the device, without a host synchronization.

Relies on ``torch._assert_async(condition, message)``: a CUDA kernel that fails the stream
(a device-side assert, reported at the next synchronization) when ``condition`` is false. A
forward that checks its ids against the prefetched ones would otherwise copy the verdict to
the host and wait for the prefetch stream.
"""
from __future__ import annotations

import torch


def assert_on_device(condition: torch.Tensor, message: str) -> None:
    """Fail the device's stream with ``message`` when the one-element bool ``condition`` is
    false; the host does not wait (on CPU it raises at once).

    Example::

        >>> ids = torch.tensor([1, 2])
        >>> assert_on_device((ids == torch.tensor([1, 2])).all(), "other ids")
    """
    torch._assert_async(condition, message)
