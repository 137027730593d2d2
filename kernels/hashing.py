"""Key hashing and bucket addressing, shared by the CPU and CUDA kernels.

Plain ``@njit`` functions: CPU kernels inline them, and numba-cuda compiles them as device
functions when a ``@cuda.jit`` kernel calls them. Everything stays in int64 arithmetic (which
wraps on overflow in both backends); logical right shifts are written as shift-and-mask.
"""
import numpy as np
from numba import njit

from .constants import EMPTY_KEY, TOMBSTONE_KEY

_MASK31 = np.int64(0x7FFFFFFF)
_MASK32 = np.int64(0xFFFFFFFF)
# 0xff51afd7ed558ccd and 0xc4ceb9fe1a85ec53 (the murmur3 64-bit finalizer) as int64.
MIX_A = np.int64(-49064778989728563)
MIX_B = np.int64(-4265267296055464877)
#: 0x9E3779B97F4A7C15 (2**64 / golden ratio) as int64: Fibonacci hashing of a key picks its
#: tier (:func:`routes_to_first`).
TIER_MULTIPLIER = np.int64(-7046029254386353131)
_MASK63 = np.int64(0x7FFFFFFFFFFFFFFF)


@njit(cache=True, inline="always")
def mix64(x):
    """Murmur3 finalizer: a bijection on 64-bit words that spreads every input bit."""
    x = x ^ ((x >> 33) & _MASK31)
    x = x * MIX_A
    x = x ^ ((x >> 33) & _MASK31)
    x = x * MIX_B
    x = x ^ ((x >> 33) & _MASK31)
    return x


@njit(cache=True, inline="always")
def bucket_base_and_start(key, num_buckets, bucket_size):
    """First slot of ``key``'s bucket and the in-bucket position its probe starts at.

    The bucket is chosen by multiply-shift range reduction of the high 32 hash bits, so any
    bucket count works and doubling it splits every bucket into two (growth never overflows).
    """
    h = mix64(key)
    return bucket_of_hash(h, num_buckets) * bucket_size, h & (bucket_size - 1)


@njit(cache=True, inline="always")
def bucket_of_hash(h, num_buckets):
    """The bucket of a key whose ``mix64`` is ``h``."""
    return (((h >> 32) & _MASK32) * num_buckets) >> 32


@njit(cache=True, inline="always")
def bucket_index(key, num_buckets):
    """The bucket ``key`` lives in, ``bucket_base_and_start(...)[0] // bucket_size``."""
    return bucket_of_hash(mix64(key), num_buckets)


@njit(cache=True, inline="always")
def partition_multiplier(parts, num_buckets):
    """Splits ``num_buckets`` buckets into ``parts`` contiguous ranges: bucket ``b`` is in
    range ``(b * multiplier) >> 32`` (a multiply and a shift per key, no division)."""
    return (parts << 32) // num_buckets


@njit(cache=True, inline="always")
def partition_of_bucket(bucket, multiplier):
    return (bucket * multiplier) >> 32


@njit(cache=True, inline="always")
def partition_first_bucket(p, multiplier):
    """The first bucket of range ``p`` (of ``partition_multiplier``)."""
    return ((p << 32) + multiplier - 1) // multiplier


@njit(cache=True, inline="always")
def is_live_key(key):
    """True for a stored key, False for the EMPTY and TOMBSTONE markers."""
    return key != EMPTY_KEY and key != TOMBSTONE_KEY


@njit(cache=True, inline="always")
def probe(tbl_keys, key, num_buckets, bucket_size):
    """Slot holding ``key`` or -1. Stops at the first EMPTY slot (keys never sit past one)."""
    base, start = bucket_base_and_start(key, num_buckets, bucket_size)
    mask = bucket_size - 1
    for j in range(bucket_size):
        s = base + ((start + j) & mask)
        k = tbl_keys[s]
        if k == key:
            return s
        if k == EMPTY_KEY:
            return -1
    return -1


@njit(cache=True, inline="always")
def routes_to_first(key, first_rows, total_rows):
    """Whether ``key`` goes to the first of two tiers of ``first_rows`` and ``total_rows -
    first_rows`` rows (``dynemb.foundations.key_mixing.routes_to_first`` for torch)."""
    mixed = key * TIER_MULTIPLIER
    mixed = (mixed ^ (mixed >> 31)) & _MASK63
    return mixed % total_rows < first_rows
