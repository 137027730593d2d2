"""Deterministic row initializers: a new row depends only on (seed, table_id, key)."""
from __future__ import annotations

import enum
import hashlib
import math
from dataclasses import dataclass

import torch

from dynemb.backends import backend_for_device
from dynemb.kernels import init_common
from dynemb.validation import check_index_tensor


class InitializerKind(enum.Enum):
    NORMAL = "normal"
    TRUNCATED_NORMAL = "truncated_normal"
    UNIFORM = "uniform"
    CONSTANT = "constant"


_KIND_CODES = {
    InitializerKind.NORMAL: init_common.INIT_NORMAL,
    InitializerKind.TRUNCATED_NORMAL: init_common.INIT_TRUNCATED_NORMAL,
    InitializerKind.UNIFORM: init_common.INIT_UNIFORM,
    InitializerKind.CONSTANT: init_common.INIT_CONSTANT,
}


@dataclass(frozen=True)
class Initializer:
    """How new rows start.

    - NORMAL: ``mean + std * N(0, 1)``;
    - TRUNCATED_NORMAL: the same, redrawn until it lies in ``[low, high]`` (absolute bounds,
      like ``torch.nn.init.trunc_normal_``; default mean -+ 2 std);
    - UNIFORM: uniform in ``[low, high)``;
    - CONSTANT: ``value``.

    Example::

        >>> init = Initializer(InitializerKind.UNIFORM, low=-0.1, high=0.1)
        >>> rows = init.rows(torch.tensor([5, 9, 5]), dim=4, seed=0, table_id=3)
        >>> bool((rows[0] == rows[2]).all())  # same key, same row
        True
    """

    kind: InitializerKind = InitializerKind.UNIFORM
    mean: float = 0.0
    std: float = 0.05
    low: float = -0.05
    high: float = 0.05
    value: float = 0.0

    def __post_init__(self):
        if not isinstance(self.kind, InitializerKind):
            raise TypeError(f"kind must be an InitializerKind, got {self.kind!r}")
        for name in ("mean", "std", "low", "high", "value"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if self.kind in (InitializerKind.NORMAL, InitializerKind.TRUNCATED_NORMAL) and self.std < 0:
            raise ValueError(f"std must be >= 0, got {self.std}")
        if self.kind in (InitializerKind.UNIFORM, InitializerKind.TRUNCATED_NORMAL) and not (
                self.low < self.high):
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")

    @classmethod
    def truncated_normal(cls, mean: float = 0.0, std: float = 0.05) -> "Initializer":
        """Truncated normal with bounds at ``mean -+ 2 std``."""
        return cls(InitializerKind.TRUNCATED_NORMAL, mean=mean, std=std, low=mean - 2 * std,
                   high=mean + 2 * std)

    def _params(self):
        if self.kind is InitializerKind.CONSTANT:
            return self.value, 0.0
        if self.kind is InitializerKind.UNIFORM:
            return self.low, self.high
        return self.mean, self.std

    def rows(self, keys: torch.Tensor, dim: int, *, seed: int, table_id: int,
             backend: str | None = None) -> torch.Tensor:
        """[N, dim] float32 initial rows of ``keys`` on the keys' device."""
        check_index_tensor(keys, "keys", keys.device)
        out = torch.empty(keys.numel(), dim, dtype=torch.float32, device=keys.device)
        p0, p1 = self._params()
        backend_for_device(keys.device, backend).init_rows(
            out, keys, int(seed), int(table_id), _KIND_CODES[self.kind], float(p0), float(p1),
            float(self.low), float(self.high))
        return out

    def write_rows(self, weights: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor,
                   mask: torch.Tensor, *, dim: int, seed: int, table_id: int,
                   backend: str | None = None) -> None:
        """In float32 ``weights`` [C, W], start the rows ``slots[i]`` with ``mask[i]`` (and
        ``slots[i] >= 0``) from ``keys[i]``: initial values in ``[0, dim)``, zeros after.
        One kernel, no host sync."""
        p0, p1 = self._params()
        backend_for_device(weights.device, backend).init_rows_at(
            weights, slots, keys, mask, int(dim), int(seed), int(table_id),
            _KIND_CODES[self.kind], float(p0), float(p1), float(self.low), float(self.high))


def table_identity(name: str) -> int:
    """The ``table_id`` a table's initial rows are drawn with: a stable 63-bit hash of its
    name, so two tables of a model (in one module or several) start from different rows for
    the same id, while a table keeps its rows whatever its position, rank or storage mode.

    Example::

        >>> table_identity("items") == table_identity("items") != table_identity("users")
        True
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a table name must be a non-empty str, got {name!r}")
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
