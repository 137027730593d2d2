"""``FlatTable``: the value rows behind a hash table; row = slot. ``RowLayout``: what a row
holds and where."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dynemb.backends.numba_backends import resolve_kernels
from dynemb.rows.initializers import Initializer
from dynemb.backends.protocol import KernelBackend
from dynemb.rows.row_moves import remap_rows
from dynemb.types import SUPPORTED_DTYPES
from dynemb.foundations.validation import check_index_tensor, check_int, check_slots


@dataclass(frozen=True)
class RowLayout:
    """The physical layout of one table row: embedding columns, then the optimizer state.

    The optimizer state is float32 whatever the row dtype (as in fbgemm): a float16 /
    bfloat16 Adam second moment would underflow to zero. float32 rows are
    ``[embedding (dim) | state (state_dim)]``. float16 / bfloat16 rows with state are
    ``[embedding (dim, padded to an even count) | state]`` where each float32 state value
    takes two half-width columns, read and written through ``weights.view(torch.float32)``.
    Rows stay one contiguous tensor of ``width`` columns, so they move between tiers and
    stores as whole rows.

    Example::

        >>> layout = RowLayout(dim=7, state_dim=14, dtype=torch.float16)
        >>> layout.width, layout.row_bytes  # 8 half columns + 14 float32 values
        (36, 72)
        >>> weights = torch.zeros(4, layout.width, dtype=torch.float16)
        >>> layout.state(weights).dtype, layout.state(weights).shape
        (torch.float32, torch.Size([4, 14]))
    """

    dim: int
    state_dim: int = 0
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        check_int(self.dim, "dim")
        check_int(self.state_dim, "optimizer_state_dim", minimum=0)
        if self.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype}")

    @property
    def _split(self) -> bool:
        """True when the state is stored as float32 inside rows of a narrower dtype."""
        return self.dtype != torch.float32 and self.state_dim > 0

    @property
    def embedding_columns(self) -> int:
        """Columns before the state: ``dim``, rounded up to even for split rows."""
        return self.dim + (self.dim % 2 if self._split else 0)

    @property
    def width(self) -> int:
        """Physical columns of a row (in the row dtype)."""
        return self.embedding_columns + (2 * self.state_dim if self._split else self.state_dim)

    @property
    def logical_width(self) -> int:
        """``dim + state_dim``: the columns of :meth:`to_logical` rows."""
        return self.dim + self.state_dim

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def embedding_bytes(self) -> int:
        """Bytes of a row's embedding columns (padding included)."""
        return self.embedding_columns * self.element_size

    @property
    def state_bytes(self) -> int:
        """Bytes of a row's optimizer state."""
        return self.state_dim * (4 if self._split else self.element_size)

    @property
    def row_bytes(self) -> int:
        return self.embedding_bytes + self.state_bytes

    def embeddings(self, weights: torch.Tensor) -> torch.Tensor:
        """The embedding columns of physical rows ``weights`` [N, width] (a view)."""
        return weights[:, :self.dim]

    def state(self, weights: torch.Tensor) -> torch.Tensor:
        """The optimizer state of physical rows ``weights`` [N, width]: a float32 view
        [N, state_dim] (writes go to ``weights``)."""
        if not self._split:
            return weights[:, self.embedding_columns:self.embedding_columns + self.state_dim]
        start = self.embedding_columns // 2
        return weights.view(torch.float32)[:, start:start + self.state_dim]

    def to_logical(self, weights: torch.Tensor) -> torch.Tensor:
        """Physical rows [N, width] -> float32 ``[N, dim + state_dim]``: the embedding
        (upcast), then the state. A new tensor, except for float32 rows (returned as given)."""
        if self.dtype == torch.float32:
            return weights
        return torch.cat([self.embeddings(weights).float(), self.state(weights)], 1)

    def to_physical(self, rows: torch.Tensor) -> torch.Tensor:
        """Logical rows ``[N, dim + state_dim]`` -> physical rows [N, width] in the row dtype
        (the embedding rounded to nearest, the state kept in float32, padding zero)."""
        if not self._split:
            return rows.to(self.dtype)
        out = torch.zeros(rows.shape[0], self.width, dtype=self.dtype, device=rows.device)
        self.embeddings(out).copy_(rows[:, :self.dim])
        self.state(out).copy_(rows[:, self.dim:])
        return out


class FlatTable:
    """One contiguous ``[capacity, layout.width]`` tensor of rows laid out as ``layout``
    (a :class:`RowLayout`): the embedding (``dim`` columns), then the optimizer state of that
    row (always started at zero; float32 whatever the dtype). For float32 tables the width
    is ``dim + optimizer_state_dim``. Gather and scatter are torch's ``index_select`` /
    ``index_copy_``. Rows start from the initializer on ``kernels`` (what the owner resolved
    for ``device``), else on the ``backend`` ("cpu" / "cuda", None: by device) resolved once
    here.

    Example::

        >>> flat = FlatTable(1024, dim=8, optimizer_state_dim=1)
        >>> slots = torch.tensor([3, 17])
        >>> flat.initialize(slots, keys=torch.tensor([100, 200]), initializer=Initializer(),
        ...                 seed=0, table_id=0)
        >>> flat.gather(slots).shape
        torch.Size([2, 8])
    """

    def __init__(self, capacity: int, dim: int, *, optimizer_state_dim: int = 0,
                 dtype: torch.dtype = torch.float32, device=None, backend: Optional[str] = None,
                 kernels: Optional[KernelBackend] = None):
        check_int(capacity, "capacity")
        self.layout = RowLayout(dim, optimizer_state_dim, dtype)
        self.dim = dim
        self.optimizer_state_dim = optimizer_state_dim
        self.weights = torch.zeros(capacity, self.layout.width, dtype=dtype, device=device)
        self.kernels = resolve_kernels(self.weights.device, backend, kernels)

    @property
    def capacity(self) -> int:
        return self.weights.shape[0]

    @property
    def device(self) -> torch.device:
        return self.weights.device

    @property
    def state(self) -> torch.Tensor:
        """The optimizer state of every row, [capacity, optimizer_state_dim] float32 (a view)."""
        return self.layout.state(self.weights)

    def gather(self, slots: torch.Tensor, *, with_state: bool = False) -> torch.Tensor:
        """Rows at ``slots`` [N] -> [N, dim] in the table dtype. ``with_state``: the logical
        rows ``[N, dim + state_dim]`` (float32 for float16 / bfloat16 tables, see
        :meth:`RowLayout.to_logical`)."""
        check_slots(slots, "slots", self.device, self.capacity)
        rows = self.weights.index_select(0, slots)
        return self.layout.to_logical(rows) if with_state else rows[:, :self.dim]

    def scatter(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``rows`` [N, dim] or logical ``[N, dim + state_dim]`` rows at ``slots`` [N]
        (unique slots). The embedding is rounded to nearest in the table dtype."""
        check_slots(slots, "slots", self.device, self.capacity)
        logical = self.layout.logical_width
        if rows.dim() != 2 or rows.shape[0] != slots.numel() or rows.shape[1] not in (
                self.dim, logical):
            raise ValueError(f"rows must have shape [{slots.numel()}, {self.dim}] or "
                             f"[{slots.numel()}, {logical}], got {tuple(rows.shape)}")
        if rows.shape[1] == self.dim and self.dim != logical:
            self.weights[:, :self.dim].index_copy_(0, slots, rows.to(self.weights.dtype))
        else:
            self.weights.index_copy_(0, slots, self.layout.to_physical(rows))

    def initialize(self, slots: torch.Tensor, keys: torch.Tensor, initializer: Initializer, *,
                   seed: int, table_id: int) -> None:
        """Start the rows at ``slots`` from ``keys``' deterministic initial values, state at 0."""
        check_index_tensor(keys, "keys", self.device)
        if keys.shape != slots.shape:
            raise ValueError(f"keys has shape {tuple(keys.shape)} but slots has "
                             f"{tuple(slots.shape)}")
        rows = initializer.rows(keys, self.dim, seed=seed, table_id=table_id, kernels=self.kernels)
        if self.optimizer_state_dim:
            rows = torch.cat([rows, rows.new_zeros(rows.shape[0], self.optimizer_state_dim)], 1)
        self.scatter(slots, rows)

    def initialize_where(self, slots: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor,
                         initializer: Initializer, *, seed: int, table_id: int) -> None:
        """:meth:`initialize` the rows ``slots[i]`` with ``mask[i]`` (and ``slots[i] >= 0``).
        float32 rows are written by one kernel without a host sync.

        While :attr:`weights` is empty (whoever holds the rows let their memory go for a
        while), the initialization waits: :meth:`take_held_writes` hands it to them, to make
        once the rows are back in :attr:`weights`."""
        if self.weights.shape[0] == 0:
            self._held().append((lambda flat: flat.initialize_where(
                slots, keys, mask, initializer, seed=seed, table_id=table_id),
                (slots, keys, mask)))
            return
        if self.weights.dtype == torch.float32:
            initializer.write_rows(self.weights, slots, keys, mask, dim=self.dim, seed=seed,
                                   table_id=table_id, kernels=self.kernels)
            return
        pick = mask & (slots >= 0)
        if bool(pick.any()):
            self.initialize(slots[pick], keys[pick], initializer, seed=seed, table_id=table_id)

    def _held(self) -> list:
        return self.__dict__.setdefault("_held_writes", [])

    def take_held_writes(self) -> list:
        """The row initializations made while :attr:`weights` was empty, oldest first, as
        ``(write, tensors)``: ``write(self)`` makes one, reading ``tensors``; they are
        forgotten here.

        Example::

            >>> flat = FlatTable(8, dim=2)
            >>> rows = flat.weights
            >>> flat.weights = torch.empty(0, 2)  # the rows' memory let go
            >>> flat.initialize_where(torch.tensor([5]), torch.tensor([7]), torch.tensor([True]),
            ...                       Initializer(), seed=0, table_id=0)
            >>> flat.weights = rows  # back
            >>> [write(flat) for write, _ in flat.take_held_writes()] and bool(rows[5].any())
            True
        """
        held, self.__dict__["_held_writes"] = self._held(), []
        return held

    def use_storage(self, weights: torch.Tensor) -> None:
        """Copy the rows into ``weights`` (same shape and dtype, e.g. a view of a table
        group's rows) and keep them there."""
        if weights.shape != self.weights.shape or weights.dtype != self.weights.dtype:
            raise ValueError(f"row storage must be {tuple(self.weights.shape)} "
                             f"{self.weights.dtype}, got {tuple(weights.shape)} {weights.dtype}")
        if weights.data_ptr() != self.weights.data_ptr():
            weights.copy_(self.weights)
        self.weights = weights

    def remap(self, remap: torch.Tensor, new_capacity: int) -> None:
        """Move rows after the hash table grew: old row ``s`` goes to ``remap[s]`` (if >= 0)."""
        check_index_tensor(remap, "remap", self.device)
        if remap.numel() != self.capacity:
            raise ValueError(f"remap has {remap.numel()} entries, the table {self.capacity} rows")
        self.weights = remap_rows(self.weights, remap, new_capacity, kernels=self.kernels)
