"""Deterministic row initializers: a new row depends only on (seed, table_id, key)."""
from __future__ import annotations

import enum
import functools
import hashlib
import inspect
import math
from dataclasses import dataclass

import torch

from dynemb.backends.numba_backends import resolve_kernels
from dynemb.backends import protocol as codes
from dynemb.backends.protocol import KernelBackend
from dynemb.foundations.validation import check_index_tensor


class InitializerKind(enum.Enum):
    NORMAL = "normal"
    TRUNCATED_NORMAL = "truncated_normal"
    UNIFORM = "uniform"
    CONSTANT = "constant"


_KIND_CODES = {
    InitializerKind.NORMAL: codes.INIT_NORMAL,
    InitializerKind.TRUNCATED_NORMAL: codes.INIT_TRUNCATED_NORMAL,
    InitializerKind.UNIFORM: codes.INIT_UNIFORM,
    InitializerKind.CONSTANT: codes.INIT_CONSTANT,
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

    def kernel_params(self):
        """``(kind code, p0, p1, low, high)``: what the initializer kernels take."""
        p0, p1 = self._params()
        return _KIND_CODES[self.kind], float(p0), float(p1), float(self.low), float(self.high)

    def rows(self, keys: torch.Tensor, dim: int, *, seed: int, table_id: int,
             backend: str | None = None, kernels: KernelBackend | None = None) -> torch.Tensor:
        """[N, dim] float32 initial rows of ``keys`` on the keys' device, by ``kernels`` (what
        the owning table resolved) or else the ``backend`` of the keys' device."""
        check_index_tensor(keys, "keys", keys.device)
        out = torch.empty(keys.numel(), dim, dtype=torch.float32, device=keys.device)
        p0, p1 = self._params()
        resolve_kernels(keys.device, backend, kernels).init_rows(
            out, keys, int(seed), int(table_id), _KIND_CODES[self.kind], float(p0), float(p1),
            float(self.low), float(self.high))
        return out

    def write_rows(self, weights: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor,
                   mask: torch.Tensor, *, dim: int, seed: int, table_id: int,
                   backend: str | None = None, kernels: KernelBackend | None = None) -> None:
        """In float32 ``weights`` [C, W], start the rows ``slots[i]`` with ``mask[i]`` (and
        ``slots[i] >= 0``) from ``keys[i]``: initial values in ``[0, dim)``, zeros after.
        One kernel, no host sync; ``backend`` / ``kernels`` as for :meth:`rows`."""
        p0, p1 = self._params()
        resolve_kernels(weights.device, backend, kernels).init_rows_at(
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


#: The ``torch.nn.init`` functions a config's ``init_fn`` may be (alone or in a
#: ``functools.partial``), with the :class:`Initializer` each one's arguments make.
_TORCH_INITS = {
    torch.nn.init.uniform_: lambda a: Initializer(InitializerKind.UNIFORM, low=a["a"],
                                                  high=a["b"]),
    torch.nn.init.normal_: lambda a: Initializer(InitializerKind.NORMAL, mean=a["mean"],
                                                 std=a["std"]),
    torch.nn.init.trunc_normal_: lambda a: Initializer(
        InitializerKind.TRUNCATED_NORMAL, mean=a["mean"], std=a["std"], low=a["a"], high=a["b"]),
    torch.nn.init.constant_: lambda a: Initializer(InitializerKind.CONSTANT, value=a["val"]),
    torch.nn.init.zeros_: lambda a: Initializer(InitializerKind.CONSTANT, value=0.0),
    torch.nn.init.ones_: lambda a: Initializer(InitializerKind.CONSTANT, value=1.0),
}


def initializer_from_config(config) -> Initializer:
    """The :class:`Initializer` that starts new rows as TorchRec starts ``config``'s table
    (an ``EmbeddingConfig`` or ``EmbeddingBagConfig``).

    TorchRec fills ``init_fn`` in with ``uniform_`` over ``[weight_init_min,
    weight_init_max]``, each bound defaulting to ``-+sqrt(1 / num_embeddings)``; that range
    is taken. A given ``init_fn`` that is one of ``torch.nn.init``'s ``uniform_``,
    ``normal_``, ``trunc_normal_``, ``constant_``, ``zeros_`` or ``ones_`` (alone or in a
    ``functools.partial``) is drawn per id with the same distribution. Any other function
    cannot run on the rows of ids as they first appear and raises ``ValueError`` naming the
    supported way, ``DynamicEmbTableOptions(initializer=Initializer(...))``.

    Example::

        >>> config = EmbeddingConfig(name="items", embedding_dim=8, num_embeddings=100,
        ...                          weight_init_min=-1.0, weight_init_max=1.0)
        >>> init = initializer_from_config(config)
        >>> init.kind.name, init.low, init.high
        ('UNIFORM', -1.0, 1.0)
        >>> initializer_from_config(EmbeddingConfig(name="t", embedding_dim=8,
        ...                                         num_embeddings=10_000)).high  # sqrt(1/n)
        0.01
    """
    init_fn = config.init_fn
    if init_fn is None:  # cleared after TorchRec's __post_init__ filled it in
        return _uniform(config, config.get_weight_init_min(), config.get_weight_init_max())
    func, args, keywords = _unwrap(init_fn)
    make = _TORCH_INITS.get(func)
    if make is None:
        raise ValueError(_unsupported(config, init_fn))
    arguments = _arguments(config, init_fn, func, args, keywords)
    if arguments.get("generator") is not None:
        raise ValueError(
            f"table {config.name!r}: init_fn passes a torch.Generator, which cannot seed rows "
            f"drawn per id; a dynamic table's rows depend on (seed, table name, id): set "
            f"DynamicEmbTableOptions(seed=...) instead")
    if func is torch.nn.init.uniform_:
        return _uniform(config, arguments["a"], arguments["b"])
    try:
        return make(arguments)
    except (TypeError, ValueError) as err:
        raise ValueError(f"table {config.name!r}: init_fn {init_fn!r}: {err}") from None


def _arguments(config, init_fn, func, args, keywords) -> dict:
    """The arguments ``func`` gets when TorchRec calls ``init_fn(weight)``: a partial's
    positional arguments come before the weight, which must land on the tensor parameter."""
    weight = object()
    try:
        bound = inspect.signature(func).bind(*args, weight, **keywords)
    except TypeError as err:
        raise ValueError(f"table {config.name!r}: init_fn {init_fn!r} cannot be called with "
                         f"the weight tensor ({err})") from None
    bound.apply_defaults()
    if bound.arguments.get("tensor") is not weight:
        raise ValueError(f"table {config.name!r}: init_fn {init_fn!r} would get the weight "
                         f"tensor after its positional arguments, not as {func.__name__}'s "
                         f"tensor (TorchRec calls init_fn(weight)); pass the other arguments "
                         f"by keyword")
    return dict(bound.arguments)


def _unwrap(init_fn):
    """(function, positional arguments after the tensor, keyword arguments) of an init_fn."""
    if isinstance(init_fn, functools.partial):
        return init_fn.func, init_fn.args, dict(init_fn.keywords)
    return init_fn, (), {}


def _uniform(config, low, high) -> Initializer:
    """Uniform over ``[low, high]`` as ``torch.nn.init.uniform_`` takes it (equal bounds give
    that value; reversed ones are refused, as torch refuses them)."""
    for name, value in (("weight_init_min", low), ("weight_init_max", high)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
                value):
            raise ValueError(f"table {config.name!r}: {name} (or init_fn's bound) must be a "
                             f"finite number, got {value!r}")
    if low > high:
        raise ValueError(f"table {config.name!r}: weight_init_min ({low}) is above "
                         f"weight_init_max ({high})")
    if low == high:
        return Initializer(InitializerKind.CONSTANT, value=float(low))
    return Initializer(InitializerKind.UNIFORM, low=float(low), high=float(high))


def _unsupported(config, init_fn) -> str:
    supported = ", ".join(f.__name__ for f in _TORCH_INITS)
    return (f"table {config.name!r}: init_fn {init_fn!r} cannot start the rows of a dynamic "
            f"table, which are drawn per id as ids first appear, from (seed, table name, id), "
            f"not by calling a function on a whole weight tensor. Supported as init_fn: "
            f"torch.nn.init's {supported} (alone or in functools.partial), or leave init_fn "
            f"unset and give weight_init_min / weight_init_max; otherwise choose the rows' "
            f"distribution with DynamicEmbTableOptions(initializer=Initializer(...)) (UNIFORM, "
            f"NORMAL, TRUNCATED_NORMAL or CONSTANT), which takes precedence over the config")
