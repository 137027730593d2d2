"""The building block every storage mode shares: a :class:`Tier` (a hash table and the flat
table of its rows)."""
from __future__ import annotations

from typing import Optional

import torch

from dynemb.backends.numba_backends import resolve_kernels
from dynemb.rows.flat_table import FlatTable
from dynemb.rows.hash_table import ScoredHashTable
from dynemb.backends.protocol import KernelBackend
from dynemb.options import DynamicEmbTableOptions, TableLayout
from dynemb.foundations.validation import canonical_device


class Tier:
    """A hash table (key -> slot) and the flat table of its rows (row = slot).

    ``grow``: the hash table doubles, up to ``layout.max_capacity``, once it passes
    ``options.max_load_factor`` (HBM_DIRECT tables that start below their maximum).
    ``kernels``: those its table resolved, handed to both (None: the kernels of ``device``,
    e.g. for a host tier on the CPU).
    """

    def __init__(self, layout: TableLayout, capacity: int, dim: int, state_dim: int,
                 options: DynamicEmbTableOptions, device: torch.device,
                 kernels: Optional[KernelBackend], *, grow: bool = False):
        self.device = canonical_device(device)
        self.kernels = resolve_kernels(self.device, kernels=kernels)
        self.hash = ScoredHashTable(
            capacity, bucket_size=layout.bucket_size, policy=options.score_strategy,
            device=self.device, kernels=self.kernels,
            grow_at_load_factor=options.max_load_factor if grow else None,
            max_capacity=layout.max_capacity if grow else None)
        self.flat = FlatTable(capacity, dim, optimizer_state_dim=state_dim, dtype=layout.dtype,
                              device=self.device, kernels=self.kernels)
