"""``MemoryBreakdown``: the bytes a built table holds, by category; ``PlannedRows``: the rows a
table of a given layout will hold at its largest."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterable

import torch


@dataclass
class MemoryBreakdown:
    """Bytes of the tensors one table holds right now, by category (distinct storages).

    ``in_flight_bytes`` are batches still pinned (prefetched or awaiting backward): they come
    and go with the steps and are not part of the table.

    Example::

        >>> from dynemb.options import choose_storage_mode
        >>> from dynemb.tables import build_table
        >>> options = DynamicEmbTableOptions(max_capacity=512)
        >>> layout = choose_storage_mode(options, name="t", num_embeddings=512, width=8,
        ...                              config_dtype=torch.float32)
        >>> table = build_table("t", 0, 8, layout, options, OptimizerConfig(), torch.device("cpu"))
        >>> memory = table.memory_breakdown()
        >>> memory.values_bytes                          # 512 rows of 8 float32
        16384
        >>> memory.device_bytes == (memory.values_bytes + memory.optimizer_bytes + memory.hash_bytes
        ...                         + memory.admission_bytes + memory.other_bytes)
        True
    """

    values_bytes: int = 0
    optimizer_bytes: int = 0
    hash_bytes: int = 0
    admission_bytes: int = 0
    other_bytes: int = 0
    host_values_bytes: int = 0
    host_optimizer_bytes: int = 0
    host_hash_bytes: int = 0
    host_other_bytes: int = 0
    in_flight_bytes: int = 0

    @property
    def device_bytes(self) -> int:
        return (self.values_bytes + self.optimizer_bytes + self.hash_bytes
                + self.admission_bytes + self.other_bytes)

    @property
    def host_bytes(self) -> int:
        return (self.host_values_bytes + self.host_optimizer_bytes + self.host_hash_bytes
                + self.host_other_bytes)

    @property
    def total_bytes(self) -> int:
        return self.device_bytes + self.host_bytes

    def __add__(self, other: "MemoryBreakdown") -> "MemoryBreakdown":
        return MemoryBreakdown(*(getattr(self, f.name) + getattr(other, f.name)
                                 for f in fields(self)))


@dataclass(frozen=True)
class PlannedRows:
    """Rows one table holds at its largest, known from its layout before it is built (see
    ``planned_rows`` of the table classes).

    ``device_rows`` are the device tier's rows (one hash slot each); ``host_rows`` the rows of
    the host tier or backing store, indexed by ``host_hash_slots`` hash slots. ``host_exact``
    is False where the host side is a user's store whose own structures are unknown (its
    rows are counted, its hash slots are not).

    Example::

        >>> PlannedRows(device_rows=256, host_rows=768, host_hash_slots=768).host_exact
        True
    """

    device_rows: int
    host_rows: int = 0
    host_hash_slots: int = 0
    host_exact: bool = True


def storage_bytes(tensors: Iterable[torch.Tensor], *, spans_only: bool = False) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once).
    ``spans_only``: per storage, only the span its given views cover (a table of a group,
    whose rows are a view of the group's, counts its own part)."""
    if not spans_only:
        seen, total = set(), 0
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key = (tensor.device, storage.data_ptr(), storage.nbytes())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        return total
    spans: dict = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr(), storage.nbytes())
        if tensor.numel() == 0:
            spans.setdefault(key, None)
            continue
        start = tensor.storage_offset() * tensor.element_size()
        end = start + (1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
                       ) * tensor.element_size()
        lo, hi = spans.get(key) or (start, end)
        spans[key] = (min(lo, start), max(hi, end))
    return sum(hi - lo for span in spans.values() if span is not None for lo, hi in [span])
