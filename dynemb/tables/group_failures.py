"""When a key that found no slot becomes an error: the one failure policy of a table group.

A claim (:mod:`dynemb.tables.groups`) counts each table's refused keys (its bucket
full of pinned rows, or NO_EVICTION and full) into a tensor on the group's device, on every
backend. What happens next depends only on whether the host may wait for that count:

- **at once** (kernels that run on the host, where the count is already there): the claim
  is undone and the first refusing table raises its ``TableFullError``, naming the keys; the
  group is unchanged, as a table alone is;
- **later** (the CUDA kernels, whose count the host could read only by waiting for the
  device): the refused keys are served zeros and not trained; the count crosses to the host
  without waiting, and the next prefetch (:meth:`GroupFailures.check`) raises once it is in.

The backend says which (``KernelBackend.defers_failures``); nothing else in the table layer
asks.

Example::

    >>> from dynemb.backends.numba_backends import get_backend
    >>> failures = GroupFailures(["a", "b"], get_backend("cpu"), torch.device("cpu"))
    >>> failures.first_refusing(torch.tensor([0, 2]))
    1
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from dynemb.types import TableFullError


class GroupFailures:
    """The failure policy of a group of tables ``names`` on ``kernels`` (see the module
    docstring); counts on ``device``. ``tables`` (the group's, in order): each one's
    ``refused`` counts the keys of the error raised later."""

    def __init__(self, names: Sequence[str], kernels, device: torch.device,
                 tables: Sequence = ()):
        self.names = list(names)
        self.tables = list(tables)
        #: raise in the claim that refused (else at a later prefetch)
        self.at_once = not kernels.defers_failures
        self.total = torch.zeros(len(names), dtype=torch.int64, device=device)
        self._async = device.type == "cuda"
        self.host = torch.zeros(len(names), dtype=torch.int64, pin_memory=self._async)
        self._event = None

    def first_refusing(self, refused: torch.Tensor) -> Optional[int]:
        """A claim's refused keys per table ``refused`` [T] (on the device): at once, the
        first table that refused one (the caller undoes the claim and raises its error), or
        None; later, None (they are added to the running count, sent to the host without
        waiting)."""
        if self.at_once:
            return next((t for t, n in enumerate(refused.tolist()) if n), None)
        self.total += refused
        self.host.copy_(self.total, non_blocking=self._async)
        if self._async:
            self._event = torch.cuda.Event()
            self._event.record()
        return None

    def check(self, wait: bool = False) -> None:
        """Raise the ``TableFullError`` of keys of earlier claims that found no slot, once
        their count has reached the host (``wait``: wait for it; nothing is pending at
        once)."""
        if self.at_once:
            return
        if wait and self._event is not None:
            self._event.synchronize()
        elif self._event is not None and not self._event.query():
            return
        counts = self.host.tolist()
        if not any(counts):
            return
        self.total.zero_()
        self.host.zero_()
        for table, n in zip(self.tables, counts):
            table.refused += n
        named = ", ".join(f"{name!r}: {n}" for name, n in zip(self.names, counts) if n)
        raise TableFullError(
            f"tables {named} keys of earlier batches found no slot (buckets full of pinned "
            f"rows or NO_EVICTION) and were served zeros without being trained",
            torch.empty(0, dtype=torch.int64), None)
