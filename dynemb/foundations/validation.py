"""Argument checks shared by the public API. Each error names the argument at fault."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.sparse.jagged_tensor_validator import validate_keyed_jagged_tensor

from dynemb.backends.numba_backends import resolve_kernels
from dynemb.backends.protocol import KernelBackend
from dynemb.types import EMPTY_KEY, MAX_BUCKET_SIZE, TOMBSTONE_KEY


def check_index_tensor(t, name: str, device: torch.device) -> None:
    """``t`` must be a 1-D int64 tensor on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int64:
        raise TypeError(f"{name} must have dtype torch.int64, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if not same_device(t.device, device):
        raise ValueError(f"{name} is on {t.device} but the table is on {device}")


def check_keys(keys, device: torch.device, name: str = "keys", *,
               kernels: Optional[KernelBackend] = None) -> None:
    """1-D int64 keys on ``device`` that contain no reserved key (looked for by ``kernels``,
    those of ``device`` when None)."""
    check_index_tensor(keys, name, device)
    if not keys.numel() or not resolve_kernels(keys.device, kernels=kernels).has_reserved_keys(
            keys):
        return
    reserved = (keys == EMPTY_KEY) | (keys == TOMBSTONE_KEY)
    if bool(reserved.any()):
        bad = keys[reserved][0].item()
        raise ValueError(
            f"{name} contains the reserved key {bad} (EMPTY_KEY={EMPTY_KEY} and "
            f"TOMBSTONE_KEY={TOMBSTONE_KEY} mark free slots and cannot be stored)")


def check_same_length(a: torch.Tensor, name_a: str, b: torch.Tensor, name_b: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name_b} has shape {tuple(b.shape)} but {name_a} has {tuple(a.shape)}")


def check_int(value, name: str, *, minimum: int = 1) -> int:
    """``value`` must be an int (not a bool) >= ``minimum``; returns it.

    Example::

        >>> check_int(0, "seed", minimum=0)
        0
        >>> check_int(0, "capacity")
        Traceback (most recent call last):
        ValueError: capacity must be positive, got 0
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        bound = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def check_bucket_size(bucket_size, name: str = "bucket_size") -> int:
    """``bucket_size`` must be a power of two <= ``MAX_BUCKET_SIZE``; returns it.

    Example::

        >>> check_bucket_size(96)
        Traceback (most recent call last):
        ValueError: bucket_size must be a power of two <= 128, got 96
    """
    check_int(bucket_size, name)
    if bucket_size > MAX_BUCKET_SIZE or bucket_size & (bucket_size - 1):
        raise ValueError(f"{name} must be a power of two <= {MAX_BUCKET_SIZE}, got "
                         f"{bucket_size}")
    return bucket_size


def check_slots(slots, name: str, device: torch.device, capacity: int) -> None:
    """1-D int64 slot indices in ``[0, capacity)``."""
    check_index_tensor(slots, name, device)
    if slots.numel() and (bool((slots < 0).any()) or bool((slots >= capacity).any())):
        raise ValueError(f"{name} must lie in [0, {capacity}), got values from "
                         f"{slots.min().item()} to {slots.max().item()}")


def check_kjt_lengths(kjt) -> None:
    """A KJT's lengths are >= 0, add up to its ids, and cover every feature x sample."""
    lengths = kjt.lengths()
    if lengths.numel() and bool((lengths < 0).any()):
        raise ValueError("lengths must be >= 0")
    total = int(lengths.sum()) if lengths.numel() else 0
    if total != kjt.values().numel():
        raise ValueError(f"lengths add up to {total} but there are {kjt.values().numel()} ids")
    if kjt.variable_stride_per_key():
        strides = dict(zip(kjt.keys(), kjt.stride_per_key()))
        if lengths.numel() != sum(strides.values()):
            raise ValueError(f"lengths has {lengths.numel()} entries, expected one per sample "
                             f"of each feature: {sum(strides.values())} (batch sizes {strides})")
    elif lengths.numel() != len(kjt.keys()) * kjt.stride():
        raise ValueError(f"lengths has {lengths.numel()} entries, expected "
                         f"{len(kjt.keys())} features x batch {kjt.stride()}")


def check_kjt(kjt, device: torch.device, *, check_lengths: bool = True,
              variable_batch: bool = False) -> None:
    """What every input KeyedJaggedTensor must be, checked before any table changes: int64 or
    int32 ids on ``device``, each feature once, one batch size for every feature (unless
    ``variable_batch``). With ``check_lengths`` also its lengths, offsets and weights (reads
    them on the host).

    Example::

        >>> check_kjt(KeyedJaggedTensor.from_lengths_sync(
        ...     ["f", "f"], torch.tensor([1, 2]), torch.tensor([1, 1])), torch.device("cpu"))
        Traceback (most recent call last):
        ValueError: feature 'f' appears 2 times in the KJT's keys ['f', 'f']; each feature must appear once ...
    """
    if not isinstance(kjt, KeyedJaggedTensor):
        raise TypeError(f"input must be a KeyedJaggedTensor, got {type(kjt).__name__}")
    values = kjt.values()
    if values.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"ids must be int64 or int32, got {values.dtype}")
    if not same_device(values.device, device):
        raise ValueError(f"the KJT's ids are on {values.device} but the tables are on {device}; "
                         f"pass the KJT on {device} (kjt.to(torch.device({str(device)!r})))")
    keys = list(kjt.keys())
    if len(set(keys)) != len(keys):
        twice = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"feature {twice!r} appears {keys.count(twice)} times in the KJT's "
                         f"keys {keys}; each feature must appear once (put all its ids under "
                         f"one key, or give each copy its own name in the table's "
                         f"feature_names)")
    if kjt.variable_stride_per_key() and not variable_batch:
        raise ValueError(f"the KJT has a different batch size per feature (variable batch, "
                         f"strides {dict(zip(keys, kjt.stride_per_key()))}); only KJTs with "
                         f"one batch size for every feature are supported: give every feature "
                         f"the same number of samples, with zero-length ones where it has none")
    if check_lengths:
        check_kjt_lengths(kjt)
        validate_keyed_jagged_tensor(kjt)  # TorchRec's: offsets and weights agree with them


class MissingFeatureError(KeyError, ValueError):
    """A KJT lacks a feature that the collection reads: a ``KeyError``, as TorchRec's
    collections raise for it, and a ``ValueError`` (a bad input), with the message in full."""

    def __str__(self) -> str:
        return str(self.args[0])


def check_features_present(keys: Sequence[str], features: Sequence[str]) -> None:
    """Raise :class:`MissingFeatureError` unless the KJT's ``keys`` hold every one of
    ``features``.

    Example::

        >>> check_features_present(["a"], ["a", "b"])
        Traceback (most recent call last):
        dynemb.foundations.validation.MissingFeatureError: features ['b'] of this collection are not in the KJT ...
    """
    present = set(keys)
    missing = [f for f in features if f not in present]
    if missing:
        raise MissingFeatureError(
            f"features {missing} of this collection are not in the KJT (its features: "
            f"{list(keys)}); every feature must be given, with zero lengths where it has no "
            f"ids")


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` name one device: ``cuda`` is the current CUDA device, as torch
    places a tensor created with ``device="cuda"`` (whose ``.device`` then reads ``cuda:0``)."""
    return a == b or canonical_device(a) == canonical_device(b)


def canonical_device(device) -> torch.device:
    """``device`` as a ``torch.device`` with its index: ``"cuda"`` becomes ``cuda:<current>``,
    so that it compares equal to the ``.device`` of the tensors made on it.

    Example::

        >>> canonical_device("cpu")
        device(type='cpu')
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device
