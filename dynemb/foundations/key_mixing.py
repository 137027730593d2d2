"""Hashes of int64 keys on torch tensors: which rank owns a key, which tier holds it.

Both are part of the data layout (a checkpoint or a running job depends on them), so they
never change. Each is independent of the bucket hash, ``mix64(key)`` in
:mod:`dynemb.kernels.hashing`: the keys of one rank, or of one tier, still spread over all
buckets of their table.

- owner rank: the high 32 bits of ``mix_keys(keys, OWNER_RANK_SALT)``, reduced to the
  world size by :func:`reduce_to_range`.
- tier placement: :func:`routes_to_first`, a multiplicative hash by ``TIER_MULTIPLIER``.

torch int64 arithmetic wraps like the kernels' and ``>>`` is arithmetic, so logical shifts
mask the sign bits.
"""
from __future__ import annotations

import torch

from dynemb.backends.protocol import MIX_A, MIX_B  # the bucket hash's, as Python ints
from dynemb.backends.protocol import TIER_MULTIPLIER  # the kernels' (hashing.routes_to_first)

#: 0x9E3779B97F4A7C15 (2**64 / golden ratio) as int64: added to a key before mixing, so the
#: owner rank is not a function of the bucket hash (which mixes the key itself).
OWNER_RANK_SALT = -7046029254386353131

_MASK31 = 0x7FFFFFFF
_MASK32 = 0xFFFFFFFF
_MASK63 = 0x7FFFFFFFFFFFFFFF


def mix_keys(keys: torch.Tensor, salt: int = 0) -> torch.Tensor:
    """The murmur3 64-bit finalizer of ``keys + salt`` (int64, wrapping).

    With ``salt=0`` it is the bucket hash's ``mix64``; any other salt gives a hash
    independent of it.

    Example::

        >>> mix_keys(torch.tensor([0, 1])).tolist()
        [0, -5451962507482445012]
    """
    x = keys + salt if salt else keys
    x = x ^ ((x >> 33) & _MASK31)
    x = x * MIX_A
    x = x ^ ((x >> 33) & _MASK31)
    x = x * MIX_B
    return x ^ ((x >> 33) & _MASK31)


def reduce_to_range(mixed: torch.Tensor, n: int) -> torch.Tensor:
    """``[0, n)`` from the high 32 bits of ``mixed`` by multiply-shift (as buckets are chosen).

    Example::

        >>> reduce_to_range(torch.tensor([-1, 0]), 4).tolist()
        [3, 0]
    """
    return (((mixed >> 32) & _MASK32) * n) >> 32


def owner_rank_hash(keys: torch.Tensor, world_size: int) -> torch.Tensor:
    """Rank in ``[0, world_size)`` owning each key under ``ShardingScheme.HASH``.

    Example::

        >>> owner_rank_hash(torch.tensor([1, 2, 3]), 4).tolist()
        [3, 3, 1]
    """
    return reduce_to_range(mix_keys(keys, OWNER_RANK_SALT), world_size)


def routes_to_first(keys: torch.Tensor, first_rows: int, total_rows: int) -> torch.Tensor:
    """[N] bool: each key goes to the first of two tiers of ``first_rows`` and
    ``total_rows - first_rows`` rows (a share of keys proportional to the rows).

    Example::

        >>> routes_to_first(torch.tensor([0, 1, 42, 7]), 1024, 2048).tolist()
        [True, False, True, False]
    """
    mixed = keys * TIER_MULTIPLIER
    mixed = (mixed ^ (mixed >> 31)) & _MASK63
    return mixed % total_rows < first_rows
