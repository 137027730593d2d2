"""``PrefetchState``: what ``prefetch`` resolved for one batch, waiting for ``forward``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from dynemb.tables import TableBatch
from dynemb.options import StorageMode


@dataclass
class PrefetchState:
    """One prefetched batch: per table, its unique keys, inverse indices, slots, counts and
    storage mode (:class:`~dynemb.tables.TableBatch`), plus how to cut the table's
    rows back into features.

    ``values`` are the input ids (forward checks its input against them). ``features`` lists,
    per table, ``(feature name, number of values)`` in the order the
    table's keys were concatenated. ``ready`` is the CUDA event recorded on the prefetch
    stream (None on CPU); forward waits on it before reading the slots.
    """

    batches: Dict[str, TableBatch]
    features: Dict[str, List[Tuple[str, int]]]
    feature_order: Tuple[str, ...]
    training: bool
    ready: Optional[torch.cuda.Event] = None
    lengths: Dict[str, torch.Tensor] = field(default_factory=dict)
    values: Optional[torch.Tensor] = None  # the input ids, to match forward's input
    all_lengths: Optional[torch.Tensor] = None  # the input lengths, likewise

    @property
    def table_names(self) -> List[str]:
        return list(self.batches)

    @property
    def table_ids(self) -> Dict[str, int]:
        """Position of each table in the collection's table list."""
        return {name: i for i, name in enumerate(self.batches)}

    @property
    def storage_modes(self) -> Dict[str, StorageMode]:
        return {name: b.mode for name, b in self.batches.items()}

    @property
    def unique_keys(self) -> Dict[str, torch.Tensor]:
        return {name: b.keys for name, b in self.batches.items()}

    @property
    def slots(self) -> Dict[str, Optional[torch.Tensor]]:
        return {name: b.slots for name, b in self.batches.items()}
