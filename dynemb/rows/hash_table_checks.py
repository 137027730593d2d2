"""How large a ``ScoredHashTable`` can be, and the checks of its arguments."""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from dynemb.backends.protocol import KernelBackend
from dynemb.types import MAX_BUCKET_SIZE, ScorePolicy
from dynemb.foundations.validation import (check_bucket_size, check_index_tensor, check_int,
                                           check_keys, check_same_length)

#: What ``find_or_insert`` does when keys find no slot.
ON_FAILURE = ("raise", "report", "defer")

#: Most buckets of one table: a key's bucket is (32 hash bits x buckets) >> 32 in int64.
MAX_BUCKETS = 2**31 - 1
#: Bytes of one slot: an int64 key, an int64 score and an int32 pin count.
SLOT_BYTES = 8 + 8 + 4
#: The chance :func:`slots_for_keys` allows that its keys overflow a bucket.
OVERFLOW_PROBABILITY = 1e-6


def max_table_capacity(bucket_size: int = MAX_BUCKET_SIZE) -> int:
    """Most slots one table with buckets of ``bucket_size`` can have.

    Example::

        >>> max_table_capacity(128)
        274877906816
    """
    return MAX_BUCKETS * bucket_size


def bucket_overflow_probability(keys: int, num_buckets: int, bucket_size: int) -> float:
    """Upper bound on the chance that ``keys`` distinct keys, hashed uniformly into
    ``num_buckets`` buckets of ``bucket_size`` slots, put more than ``bucket_size`` keys in
    some bucket (the table would then evict, or fail to place a key): the union bound
    ``num_buckets * P(Binomial(keys, 1 / num_buckets) > bucket_size)``, at most 1.

    Example::

        >>> bucket_overflow_probability(128, 1, 128)   # one bucket holds them all
        0.0
        >>> bucket_overflow_probability(1000, 8, 128) > 0.99   # 98% load: a bucket overflows
        True
    """
    if keys <= bucket_size:
        return 0.0
    if num_buckets == 1:
        return 1.0
    return min(1.0, num_buckets * _binomial_upper_tail(keys, 1.0 / num_buckets, bucket_size))


def _binomial_upper_tail(n: int, p: float, k: int) -> float:
    """P(Binomial(n, p) > k) for ``k < n``, summed from the first term up (the terms fall
    geometrically once past the mean, and the mean is below ``k`` wherever it matters)."""
    j = k + 1
    log_term = (sum(math.log(n - i) for i in range(j)) - math.lgamma(j + 1) + j * math.log(p)
                + (n - j) * math.log1p(-p))
    term, total = math.exp(log_term), 0.0
    while j <= n and term > total * 1e-17:
        total += term
        term *= (n - j) / (j + 1) * p / (1.0 - p)
        j += 1
    return total


@functools.lru_cache(maxsize=4096)
def slots_for_keys(keys: int, bucket_size: int = MAX_BUCKET_SIZE) -> int:
    """The fewest slots, in whole buckets of ``bucket_size``, in which ``keys`` distinct keys
    overflow no bucket but with probability at most :data:`OVERFLOW_PROBABILITY`
    (:func:`bucket_overflow_probability`): the capacity that holds ``keys`` ids without
    evicting any. A key's bucket is fixed by its hash and probed only inside, so a table is
    full where its fullest bucket is, well before every slot is used: with buckets of 128
    the load factor this allows is 0.60 for 1,000 keys, 0.54 for a million and 0.48 for a
    billion; smaller buckets need far more room (0.10 at a million with buckets of 16).

    Example::

        >>> slots_for_keys(1000), slots_for_keys(1_000_000)
        (1664, 1857536)
        >>> slots_for_keys(100)       # one bucket holds them
        128
    """
    check_int(keys, "keys")
    check_bucket_size(bucket_size)
    low = high = max(1, math.ceil(keys / bucket_size))
    while bucket_overflow_probability(keys, high, bucket_size) > OVERFLOW_PROBABILITY:
        high *= 2
    while low < high:  # the fewest buckets within the bound (it falls as buckets are added)
        mid = (low + high) // 2
        if bucket_overflow_probability(keys, mid, bucket_size) > OVERFLOW_PROBABILITY:
            low = mid + 1
        else:
            high = mid
    return low * bucket_size


def check_table_arguments(capacity: int, bucket_size: Optional[int], policy: ScorePolicy,
                          grow_at_load_factor: Optional[float],
                          max_capacity: Optional[int]) -> int:
    """Raise on arguments ``ScoredHashTable`` cannot take, naming the nearest valid ones;
    returns the bucket size (its default when None).

    Example::

        >>> check_table_arguments(64, None, ScorePolicy.LRU, 0.75, 1024)  # one bucket
        64
    """
    check_int(capacity, "capacity")
    if bucket_size is None:
        _check_capacity_for_default_buckets(capacity)
        bucket_size = min(MAX_BUCKET_SIZE, capacity)
    check_bucket_size(bucket_size)
    if capacity % bucket_size:
        raise ValueError(f"capacity must be a multiple of bucket_size ({bucket_size}), got "
                         f"{capacity}; nearest valid: "
                         f"{max(bucket_size, capacity // bucket_size * bucket_size)}")
    for name, rows in (("capacity", capacity), ("max_capacity", max_capacity)):
        if rows is not None and rows > max_table_capacity(bucket_size):
            raise ValueError(_too_many_slots(name, rows, bucket_size))
    if not isinstance(policy, ScorePolicy):
        raise TypeError(f"policy must be a ScorePolicy, got {policy!r}")
    if grow_at_load_factor is not None and not 0.0 < grow_at_load_factor <= 1.0:
        raise ValueError(f"grow_at_load_factor must be in (0, 1], got {grow_at_load_factor}")
    if max_capacity is not None:
        check_int(max_capacity, "max_capacity")
        if max_capacity < capacity:
            raise ValueError(f"max_capacity ({max_capacity}) is below capacity ({capacity})")
    return bucket_size


def check_claim_arguments(policy: ScorePolicy, device: torch.device, keys, scores, *,
                          on_failure: str, assume_unique: bool, counts,
                          kernels: Optional[KernelBackend] = None) -> None:
    """The arguments of ``find_or_insert`` on a table of ``policy`` on ``device`` (run by
    ``kernels``)."""
    if assume_unique:
        check_index_tensor(keys, "keys", device)
    else:
        check_keys(keys, device, kernels=kernels)
    check_scores(policy, device, keys, scores, required=policy is ScorePolicy.CUSTOMIZED)
    if on_failure not in ON_FAILURE:
        raise ValueError(f"on_failure must be one of {ON_FAILURE}, got {on_failure!r}")
    if counts is not None:
        if not assume_unique:
            raise ValueError("counts is only taken with assume_unique=True")
        check_index_tensor(counts, "counts", device)
        check_same_length(keys, "keys", counts, "counts")


def check_scores(policy: ScorePolicy, device: torch.device, keys, scores, *,
                 required: bool) -> None:
    """Given scores: only CUSTOMIZED takes them (and then ``required`` ones), one per key."""
    custom = policy is ScorePolicy.CUSTOMIZED
    if scores is None:
        if custom and required:
            raise ValueError("scores are required by the CUSTOMIZED policy")
        return
    if not custom:
        raise ValueError(f"scores are only used by the CUSTOMIZED policy, this table uses "
                         f"{policy.name}")
    check_index_tensor(scores, "scores", device)
    check_same_length(keys, "keys", scores, "scores")


def check_distinct_with_scores(ids: torch.Tensor, scores: torch.Tensor, device: torch.device, *,
                               name: str, each: str) -> None:
    """Raise unless ``scores`` is an index tensor on ``device`` of ``ids``' shape and ``ids``
    (slots or keys, called ``name``) are distinct (``each``: what one of them stands for)."""
    check_index_tensor(scores, "scores", device)
    if scores.shape != ids.shape:
        raise ValueError(f"scores has shape {tuple(scores.shape)} but {name} has "
                         f"{tuple(ids.shape)}")
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"{name} must be distinct ({each})")


def _check_capacity_for_default_buckets(capacity: int) -> None:
    """The default bucket is the whole table below ``MAX_BUCKET_SIZE`` slots, so the capacity
    must then be a power of two; above it, a multiple of ``MAX_BUCKET_SIZE``."""
    if capacity < MAX_BUCKET_SIZE and capacity & (capacity - 1):
        lower = 1 << (capacity.bit_length() - 1)
        nearest = lower if capacity - lower < 2 * lower - capacity else 2 * lower
        raise ValueError(f"capacity below {MAX_BUCKET_SIZE} must be a power of two (one bucket "
                         f"then holds the whole table), or else a multiple of "
                         f"{MAX_BUCKET_SIZE}; got {capacity}, nearest valid: {nearest}")
    if capacity > MAX_BUCKET_SIZE and capacity % MAX_BUCKET_SIZE:
        nearest = (capacity + MAX_BUCKET_SIZE // 2) // MAX_BUCKET_SIZE * MAX_BUCKET_SIZE
        raise ValueError(f"capacity must be a multiple of bucket_size ({MAX_BUCKET_SIZE}) when "
                         f"it is {MAX_BUCKET_SIZE} or more (bucket_size defaults to "
                         f"{MAX_BUCKET_SIZE}; below that, to the capacity, a power of two); got "
                         f"{capacity}, nearest valid: {nearest}")


def _too_many_slots(name: str, rows: int, bucket_size: int) -> str:
    hint = (f"use larger buckets (bucket_size up to {MAX_BUCKET_SIZE})"
            if rows <= max_table_capacity(MAX_BUCKET_SIZE)
            else "split the keys over several tables (shard the table over more ranks)")
    return (f"{name} {rows} is beyond the {max_table_capacity(bucket_size)} slots one table "
            f"can have with bucket_size {bucket_size} ({MAX_BUCKETS} buckets); {hint}")
