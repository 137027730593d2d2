"""Checks of a saved tier before it is loaded: every key where lookups will find it.

A hash table finds a key by probing its bucket from the key's start position up to the
first ``EMPTY_KEY`` slot (:func:`dynemb.kernels.hashing.probe`). Every insert fills the first
free slot of that probe, so in a table the kernels built each live key

- sits in its own bucket (``bucket_of(mix64(key))``),
- has no ``EMPTY_KEY`` slot between its probe start and its slot, and
- appears once.

A slot image edited by hand (a key moved to another slot, a key written twice) breaks
these: the key's row is unreachable, and the next lookup inserts the key a second time.
The checks here are torch operations over the whole image (no Python loop over keys) and
raise ``ValueError`` naming the table and tier, before anything is loaded.
That a DEFAULT table's key sits in the tier it routes to is the table's own check
(:meth:`TieredTable.check_routing <dynemb.tables.tiered.TieredTable.check_routing>`).
"""
from __future__ import annotations

import torch

from dynemb.foundations.key_mixing import mix_keys, reduce_to_range
from dynemb.types import EMPTY_KEY, TOMBSTONE_KEY


def is_bucketed_layout(capacity: int, bucket_size: int) -> bool:
    """``capacity`` slots in buckets of ``bucket_size`` (a power of two) as tables have."""
    return (bucket_size > 0 and bucket_size & (bucket_size - 1) == 0 and capacity > 0
            and capacity % bucket_size == 0)


def check_slot_image(keys: torch.Tensor, bucket_size: int, where: str) -> None:
    """Raise ``ValueError`` (``where``: "table 't', tier 'device'") unless every live key of
    the slot image ``keys`` (one int64 per slot, ``EMPTY_KEY`` / ``TOMBSTONE_KEY`` for free
    slots) is in its own bucket, reachable by its probe, and stored once."""
    capacity = keys.numel()
    if not is_bucketed_layout(capacity, bucket_size):
        raise ValueError(f"{where}: {capacity} slots do not make buckets of {bucket_size}")
    keys = keys.reshape(-1)
    live = (keys != EMPTY_KEY) & (keys != TOMBSTONE_KEY)
    slots = live.nonzero().squeeze(1)
    held = keys[slots]
    mixed = mix_keys(held)
    bucket = reduce_to_range(mixed, capacity // bucket_size)
    misplaced = bucket != slots // bucket_size
    if bool(misplaced.any()):
        raise ValueError(f"{where}: {int(misplaced.sum())} keys are in slots outside their "
                         f"bucket (e.g. key {int(held[misplaced][0])} in slot "
                         f"{int(slots[misplaced][0])}); lookups would not find them")
    start = mixed & (bucket_size - 1)
    distance = (slots % bucket_size - start) & (bucket_size - 1)
    to_empty = _distance_to_empty(keys == EMPTY_KEY, bucket_size)
    unreachable = distance > to_empty[bucket * bucket_size + start]
    if bool(unreachable.any()):
        raise ValueError(f"{where}: {int(unreachable.sum())} keys lie past an empty slot of "
                         f"their bucket's probe (e.g. key {int(held[unreachable][0])} in slot "
                         f"{int(slots[unreachable][0])}); lookups would not find them")
    check_distinct(held, where)  # equal keys share a bucket: all that is left to check


def _distance_to_empty(empty: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """[capacity] int32: for each slot, how many probe steps from it (wrapping inside its
    bucket) reach the first ``EMPTY_KEY`` slot; ``bucket_size`` when its bucket has none."""
    rows = empty.reshape(-1, bucket_size)
    twice = torch.cat([rows, rows], dim=1)  # a probe wraps around its bucket
    position = torch.arange(2 * bucket_size, dtype=torch.int32,
                            device=empty.device).expand_as(twice)
    never = 3 * bucket_size
    at = torch.where(twice, position, torch.full_like(position, never))
    next_empty = at.flip(1).cummin(1).values.flip(1)[:, :bucket_size]
    steps = next_empty - position[:, :bucket_size]
    return steps.clamp_(max=bucket_size).reshape(-1)


def check_distinct(keys: torch.Tensor, where: str) -> None:
    """Raise ``ValueError`` unless ``keys`` (live keys, any order) holds each key once."""
    if keys.numel() < 2:
        return
    ordered = torch.sort(keys.reshape(-1)).values
    repeated = ordered[1:] == ordered[:-1]
    if bool(repeated.any()):
        raise ValueError(f"{where}: {int(repeated.sum())} keys are stored twice (e.g. key "
                         f"{int(ordered[1:][repeated][0])})")


def check_live_keys(keys: torch.Tensor, where: str) -> None:
    """Raise ``ValueError`` if an entry's key is a free-slot marker."""
    reserved = (keys == EMPTY_KEY) | (keys == TOMBSTONE_KEY)
    if bool(reserved.any()):
        raise ValueError(f"{where}: {int(reserved.sum())} entries hold a free-slot marker "
                         f"(EMPTY_KEY / TOMBSTONE_KEY) as their key")

