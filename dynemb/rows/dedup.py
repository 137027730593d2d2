"""Unique keys with inverse indices and counts, on either backend.

On CPU the dedup kernel returns exactly the unique keys (in first-occurrence order, or in the
bucket order of the hash table they go to). On CUDA the number of unique keys is
data-dependent; reading it would stall the host, so :func:`padded_unique` keeps every output
at the input length and pads with ``EMPTY_KEY``, which every table kernel skips.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from dynemb.backends.numba_backends import resolve_kernels
from dynemb.backends.protocol import KernelBackend
from dynemb.types import EMPTY_KEY


class Unique(NamedTuple):
    """``keys[inverse] == input``; ``counts[i]`` occurrences of ``keys[i]``. Padded entries
    (CUDA) hold ``EMPTY_KEY`` with count 0; ``num_unique`` is a 1-element device tensor."""

    keys: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor
    num_unique: torch.Tensor


def padded_unique(keys: torch.Tensor) -> Unique:
    """Sort-based dedup whose outputs all have ``keys.numel()`` entries (no host sync).

    Example::

        >>> u = padded_unique(torch.tensor([5, 3, 5]))
        >>> u.keys.tolist()[:2], u.inverse.tolist(), int(u.num_unique)
        ([3, 5], [1, 0, 1], 2)
    """
    n = keys.numel()
    ukeys = torch.full_like(keys, EMPTY_KEY)
    inverse = torch.zeros_like(keys)
    counts = torch.zeros_like(keys)
    if n == 0:
        return Unique(ukeys, inverse, counts, torch.zeros(1, dtype=torch.int64,
                                                          device=keys.device))
    sorted_keys, order = torch.sort(keys)
    new_run = torch.ones_like(sorted_keys, dtype=torch.bool)
    new_run[1:] = sorted_keys[1:] != sorted_keys[:-1]
    run = torch.cumsum(new_run.to(torch.int64), 0) - 1
    ukeys.scatter_(0, run, sorted_keys)
    inverse.scatter_(0, order, run)
    counts.scatter_add_(0, run, torch.ones_like(run))
    return Unique(ukeys, inverse, counts, run[-1:] + 1)


def unique_keys(keys: torch.Tensor, backend: str | None = None, *,
                num_buckets: int | None = None, kernels: KernelBackend | None = None) -> Unique:
    """Exact unique keys on the CPU backend, :func:`padded_unique` on CUDA: ``kernels`` (what
    the owning table resolved), else the ``backend`` of the keys' device.

    On CPU the keys come in first-occurrence order, or with ``num_buckets`` (the keys go to a
    hash table of that many buckets next) sorted by bucket, ties in first-occurrence order:
    the table's ``find_or_insert`` then claims them in place, without a sort of its own.
    """
    impl = resolve_kernels(keys.device, backend, kernels)
    if impl.name == "cpu":
        ukeys, inverse, counts = impl.dedup(keys, num_buckets)
        return Unique(ukeys, inverse, counts, torch.tensor([ukeys.numel()]))
    return padded_unique(keys)
