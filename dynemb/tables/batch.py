"""``TableBatch``: one table's share of a prefetched batch, from prefetch to backward."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from dynemb.options import StorageMode


@dataclass
class TableBatch:
    """One table's part of a :class:`~dynemb.prefetch.PrefetchState`.

    ``keys`` / ``counts`` [U] are the unique keys and their occurrences, ``inverse`` [N] maps
    each input key to its unique index. ``slots`` [U] are device-tier slots (-1: no device row:
    padding, a key refused by admission, a key unseen in eval, or the host tier in DEFAULT);
    ``host_slots`` [U] the DEFAULT host-tier slots. ``fallback`` [U, dim] holds the rows used
    for keys without a slot (initializer, eval initializer or CACHE store rows).

    Life cycle: ``pinned`` while its slots hold a pin, ``consumed`` once a forward looked it
    up, ``applied`` once its backward ran.
    """

    name: str
    mode: StorageMode
    training: bool
    keys: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor
    num_unique: torch.Tensor
    slots: Optional[torch.Tensor] = None
    host_slots: Optional[torch.Tensor] = None
    fallback: Optional[torch.Tensor] = None
    pinned: bool = False
    consumed: bool = False
    applied: bool = False

    @property
    def num_keys(self) -> int:
        return self.inverse.numel()

    def tensors(self) -> List[torch.Tensor]:
        """Every tensor the batch holds (to mark them used by another CUDA stream)."""
        return [t for t in (self.keys, self.inverse, self.counts, self.num_unique, self.slots,
                            self.host_slots, self.fallback) if t is not None]
