"""The batches that hold pins in one table (:class:`~dynemb.tables.base.DynamicTable`):
prefetched ones not yet consumed by a forward, and looked-up ones awaiting their backward."""
from __future__ import annotations

from typing import Any, Iterable, Iterator


class HeldBatches:
    """Batches by identity, in the order they took their pins; adding and dropping one costs
    the same whatever their number.

    Example::

        >>> held = HeldBatches()
        >>> a, b = object(), object()
        >>> held.add(a), held.add(b), held.drop(a)
        (None, None, None)
        >>> list(held) == [b], len(held)
        (True, 1)
    """

    def __init__(self, batches: Iterable[Any] = ()):
        self._by_id = {id(b): b for b in batches}

    def add(self, batch: Any) -> None:
        self._by_id[id(batch)] = batch

    def drop(self, batch: Any) -> None:
        self._by_id.pop(id(batch), None)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._by_id.values())

    def __len__(self) -> int:
        return len(self._by_id)

    def describe(self) -> str:
        """Who holds the pins, for error messages."""
        if not self._by_id:
            return "no other batch: this batch alone has more keys than its buckets hold"
        queued = sum(1 for b in self if not b.consumed)
        return (f"{queued} prefetched batches not yet consumed by forward and "
                f"{len(self) - queued} looked-up batches waiting for their backward (their "
                f"pins end at their backward or at the next training forward)")

    # ids are not kept by pickling: the unpickled batches are keyed again
    def __getstate__(self):
        return list(self)

    def __setstate__(self, batches) -> None:
        self._by_id = {id(b): b for b in batches}
