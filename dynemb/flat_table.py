"""``FlatTable``: the value rows behind a hash table; row = slot."""
from __future__ import annotations

from typing import Optional

import torch

from dynemb.initializers import Initializer
from dynemb.validation import check_index_tensor, check_positive_int, check_slots

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class FlatTable:
    """One contiguous ``[capacity, dim + optimizer_state_dim]`` tensor.

    Columns ``[0, dim)`` are the embedding, the rest the optimizer state of that row (always
    started at zero). Gather and scatter are torch's ``index_select`` / ``index_copy_``.

    Example::

        >>> flat = FlatTable(1024, dim=8, optimizer_state_dim=1)
        >>> slots = torch.tensor([3, 17])
        >>> flat.initialize(slots, keys=torch.tensor([100, 200]), initializer=Initializer(),
        ...                 seed=0, table_id=0)
        >>> flat.gather(slots).shape
        torch.Size([2, 8])
    """

    def __init__(self, capacity: int, dim: int, *, optimizer_state_dim: int = 0,
                 dtype: torch.dtype = torch.float32, device=None, backend: Optional[str] = None):
        check_positive_int(capacity, "capacity")
        check_positive_int(dim, "dim")
        if isinstance(optimizer_state_dim, bool) or not isinstance(optimizer_state_dim, int) or (
                optimizer_state_dim < 0):
            raise ValueError(f"optimizer_state_dim must be an int >= 0, got {optimizer_state_dim!r}")
        if dtype not in _DTYPES:
            raise TypeError(f"dtype must be one of {_DTYPES}, got {dtype}")
        self.dim = dim
        self.optimizer_state_dim = optimizer_state_dim
        self.backend = backend
        self.weights = torch.zeros(capacity, dim + optimizer_state_dim, dtype=dtype,
                                   device=device)

    @property
    def capacity(self) -> int:
        return self.weights.shape[0]

    @property
    def device(self) -> torch.device:
        return self.weights.device

    def gather(self, slots: torch.Tensor, *, with_state: bool = False) -> torch.Tensor:
        """Rows at ``slots`` [N] -> [N, dim] (or the full width ``with_state``)."""
        check_slots(slots, "slots", self.device, self.capacity)
        rows = self.weights.index_select(0, slots)
        return rows if with_state else rows[:, :self.dim]

    def scatter(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``rows`` [N, dim] (or full width) at ``slots`` [N] (unique slots)."""
        check_slots(slots, "slots", self.device, self.capacity)
        if rows.dim() != 2 or rows.shape[0] != slots.numel() or rows.shape[1] not in (
                self.dim, self.weights.shape[1]):
            raise ValueError(f"rows must have shape [{slots.numel()}, {self.dim}] or "
                             f"[{slots.numel()}, {self.weights.shape[1]}], got {tuple(rows.shape)}")
        target = self.weights if rows.shape[1] == self.weights.shape[1] else self.weights[:, :self.dim]
        target.index_copy_(0, slots, rows.to(self.weights.dtype))

    def initialize(self, slots: torch.Tensor, keys: torch.Tensor, initializer: Initializer, *,
                   seed: int, table_id: int) -> None:
        """Start the rows at ``slots`` from ``keys``' deterministic initial values, state at 0."""
        check_index_tensor(keys, "keys", self.device)
        if keys.shape != slots.shape:
            raise ValueError(f"keys has shape {tuple(keys.shape)} but slots has "
                             f"{tuple(slots.shape)}")
        rows = initializer.rows(keys, self.dim, seed=seed, table_id=table_id, backend=self.backend)
        if self.optimizer_state_dim:
            rows = torch.cat([rows, rows.new_zeros(rows.shape[0], self.optimizer_state_dim)], 1)
        self.scatter(slots, rows)

    def initialize_where(self, slots: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor,
                         initializer: Initializer, *, seed: int, table_id: int) -> None:
        """:meth:`initialize` the rows ``slots[i]`` with ``mask[i]`` (and ``slots[i] >= 0``).
        float32 rows are written by one kernel without a host sync."""
        if self.weights.dtype == torch.float32:
            initializer.write_rows(self.weights, slots, keys, mask, dim=self.dim, seed=seed,
                                   table_id=table_id, backend=self.backend)
            return
        pick = mask & (slots >= 0)
        if bool(pick.any()):
            self.initialize(slots[pick], keys[pick], initializer, seed=seed, table_id=table_id)

    def remap(self, remap: torch.Tensor, new_capacity: int) -> None:
        """Move rows after the hash table grew: old row ``s`` goes to ``remap[s]`` (if >= 0)."""
        check_index_tensor(remap, "remap", self.device)
        if remap.numel() != self.capacity:
            raise ValueError(f"remap has {remap.numel()} entries, the table {self.capacity} rows")
        moved = torch.zeros(new_capacity, self.weights.shape[1], dtype=self.weights.dtype,
                            device=self.device)
        live = remap >= 0
        moved[remap[live]] = self.weights[live]
        self.weights = moved
