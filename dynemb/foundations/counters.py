"""Per-table counters, accumulated on the table's device so that counting never stalls it."""
from __future__ import annotations

from typing import Dict

import torch

from dynemb.backends.device_values import values_on

#: Counted events, in the order they are stored.
COUNTER_NAMES = (
    "lookups",            # key occurrences looked up (duplicates included)
    "unique_keys",        # distinct keys per batch, summed over batches
    "hits",               # distinct keys found on the device (cache hits)
    "misses",             # distinct keys not on the device
    "inserts",            # keys given a device slot (new keys and CACHE loads)
    "evictions",          # device rows displaced by the score policy
    "write_backs",        # CACHE: evicted rows written to the backing store
    "loads",              # CACHE: missed rows read back from the backing store
    "admission_rejects",  # distinct keys per batch refused by admission (not stored)
    "store_evictions",    # CACHE: rows the backing store itself evicted (its capacity is full)
    "dropped_updates",    # rows a late backward could not update: evicted after its pins ended
)
_INDEX = {name: i for i, name in enumerate(COUNTER_NAMES)}


class TableCounters:
    """Running totals of one table's events (see :data:`COUNTER_NAMES`).

    ``add`` takes Python ints or 0-d device tensors, so the hot path never reads a value back;
    ``snapshot`` reads them all in one transfer.

    Example::

        >>> c = TableCounters(torch.device("cpu"))
        >>> c.add("hits", torch.tensor(3)); c.add("hits", 2)
        >>> c.snapshot()["hits"]
        5
    """

    def __init__(self, device: torch.device):
        self._values = torch.zeros(len(COUNTER_NAMES), dtype=torch.int64, device=device)
        self._indices: Dict[tuple, torch.Tensor] = {}  # counter names -> their index tensor

    def add(self, name: str, amount) -> None:
        # in place on the element's view: one op (``values[i] += x`` is an add and a copy)
        self._values[_INDEX[name]].add_(amount)

    def add_many(self, **amounts) -> None:
        """Add several counters: Python ints, or 0-d tensors on the counters' device, in one
        ``index_add_`` (a device op per counter otherwise)."""
        values = list(amounts.values())
        device = self._values.device
        if all(isinstance(v, int) for v in values):  # host values
            source = values_on(values, torch.int64, device)
        elif all(isinstance(v, torch.Tensor) and v.device == device for v in values):
            source = torch.stack(values).to(torch.int64)
        else:
            for name, amount in amounts.items():
                self.add(name, amount)
            return
        names = tuple(amounts)
        index = self._indices.get(names)
        if index is None:
            index = self._indices[names] = values_on([_INDEX[k] for k in names], torch.int64,
                                                     device)
        self._values.index_add_(0, index, source)

    def nbytes(self) -> int:
        return self._values.numel() * self._values.element_size()

    @property
    def values(self) -> torch.Tensor:
        """The counters in :data:`COUNTER_NAMES` order, [len(COUNTER_NAMES)] int64 (live)."""
        return self._values

    def use_storage(self, values: torch.Tensor) -> None:
        """Copy the counters into ``values`` (e.g. a table group's row of counters) and count
        there from now on."""
        if values.shape != self._values.shape or values.dtype != self._values.dtype:
            raise ValueError(f"counter storage must be {tuple(self._values.shape)} int64, got "
                             f"{tuple(values.shape)} {values.dtype}")
        if values.data_ptr() != self._values.data_ptr():
            values.copy_(self._values)
        self._values = values

    def snapshot(self) -> Dict[str, int]:
        return dict(zip(COUNTER_NAMES, self._values.tolist()))

    def load(self, values: torch.Tensor) -> None:
        """Set every counter (values in :data:`COUNTER_NAMES` order), e.g. from a checkpoint."""
        if values.shape != self._values.shape:
            raise ValueError(f"expected {len(COUNTER_NAMES)} counters, got {tuple(values.shape)}")
        self._values.copy_(values)

    def reset(self) -> None:
        self._values.zero_()
