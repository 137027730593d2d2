"""How large a ``ScoredHashTable`` can be, and the checks of its arguments."""
from __future__ import annotations

from typing import Optional

import torch

from dynemb.types import MAX_BUCKET_SIZE, ScorePolicy
from dynemb.validation import (check_bucket_size, check_index_tensor, check_int, check_keys,
                               check_same_length)

#: What ``find_or_insert`` does when keys find no slot.
ON_FAILURE = ("raise", "report", "defer")

#: Most buckets of one table: a key's bucket is (32 hash bits x buckets) >> 32 in int64.
MAX_BUCKETS = 2**31 - 1
#: Bytes of one slot: an int64 key, an int64 score and an int32 pin count.
SLOT_BYTES = 8 + 8 + 4


def max_table_capacity(bucket_size: int = MAX_BUCKET_SIZE) -> int:
    """Most slots one table with buckets of ``bucket_size`` can have.

    Example::

        >>> max_table_capacity(128)
        274877906816
    """
    return MAX_BUCKETS * bucket_size


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
                          on_failure: str, assume_unique: bool, counts) -> None:
    """The arguments of ``find_or_insert`` on a table of ``policy`` on ``device``."""
    if assume_unique:
        check_index_tensor(keys, "keys", device)
    else:
        check_keys(keys, device)
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
