"""Everything computed from a key, rewritten with Python ints and floats from the documented
rules: the murmur3 finalizer, owner ranks, tier placement, the counter-based random streams
and the initial rows they give. Tests check the torch and numba code against these.

Words are kept unsigned (``& M64``); two's complement int64 arithmetic, which the kernels
use, gives the same bits.
"""
from __future__ import annotations

import math
from typing import Iterable, List

M64 = (1 << 64) - 1
#: 2**64 / golden ratio: the owner-rank salt, the tier multiplier and the stream step
GOLDEN = 0x9E3779B97F4A7C15
#: murmur3's 64-bit finalizer constants
FMIX_A = 0xFF51AFD7ED558CCD
FMIX_B = 0xC4CEB9FE1A85EC53
UPDATE_SALT = 0x5DEECE66D
TRUNCATED_TRIES = 32


def signed(x: int) -> int:
    """The int64 with the bits of ``x``."""
    x &= M64
    return x - (1 << 64) if x >> 63 else x


def fmix64(x: int) -> int:
    """murmur3 fmix64, unsigned in and out."""
    x &= M64
    x ^= x >> 33
    x = (x * FMIX_A) & M64
    x ^= x >> 33
    x = (x * FMIX_B) & M64
    return x ^ (x >> 33)


# -- placement -------------------------------------------------------------------------------
def bucket_of(key: int, num_buckets: int) -> int:
    """Multiply-shift of the high 32 bits of ``fmix64(key)``."""
    return ((fmix64(key) >> 32) * num_buckets) >> 32


def owner_hash(key: int, world: int) -> int:
    """``ShardingScheme.HASH``: multiply-shift of the high 32 bits of ``fmix64(key + salt)``."""
    return ((fmix64(key + GOLDEN) >> 32) * world) >> 32


def owner_mod(key: int, world: int) -> int:
    """``ShardingScheme.MOD``: the non-negative remainder (Python's ``%``)."""
    return key % world


def owner(key: int, world: int, scheme: str) -> int:
    """``scheme``: a ``ShardingScheme`` value, "hash" or "mod"."""
    return owner_hash(key, world) if scheme == "hash" else owner_mod(key, world)


def routes_to_first(key: int, first: int, total: int) -> bool:
    """Tier placement: Fibonacci hashing of the key, folded, modulo the total rows."""
    m = signed(key * GOLDEN)
    return ((m ^ (m >> 31)) & ((1 << 63) - 1)) % total < first


# -- random streams --------------------------------------------------------------------------
def row_stream(seed: int, table_id: int, key: int) -> int:
    return fmix64(fmix64(seed ^ (table_id * GOLDEN)) ^ key)


def uniform01(stream: int, counter: int) -> float:
    """53 random bits of ``fmix64(stream + (counter + 1) * GOLDEN)``, centred in their cell."""
    h = fmix64(stream + (counter + 1) * GOLDEN)
    return ((h >> 11) + 0.5) / 2.0 ** 53


def standard_normal(stream: int, counter: int) -> float:
    """Box-Muller on the uniforms drawn at ``2 * (counter // 2)`` and ``2 * (counter // 2) + 1``:
    the cosine output for an even counter, the sine output for an odd one."""
    pair = counter // 2
    u1, u2 = uniform01(stream, 2 * pair), uniform01(stream, 2 * pair + 1)
    trig = math.cos if counter % 2 == 0 else math.sin
    return math.sqrt(-2.0 * math.log(u1)) * trig(2.0 * math.pi * u2)


def update_stream(seed: int, table_id: int, key: int, step: int) -> int:
    return fmix64(row_stream(seed, table_id, key) ^ fmix64(step * GOLDEN + UPDATE_SALT))


def random_bits32(stream: int, counter: int) -> int:
    return fmix64(stream + (counter + 1) * GOLDEN) >> 32


# -- initial rows ----------------------------------------------------------------------------
def initial_value(init, stream: int, column: int) -> float:
    """Element ``column`` of a row of ``init`` (a ``dynemb.Initializer``), from its fields."""
    kind = init.kind.value
    if kind == "constant":
        return init.value
    if kind == "uniform":
        return init.low + (init.high - init.low) * uniform01(stream, column)
    if kind == "normal":
        return init.mean + init.std * standard_normal(stream, column)
    assert kind == "truncated_normal", kind
    x = init.mean
    for attempt in range(TRUNCATED_TRIES):
        x = init.mean + init.std * standard_normal(stream, column * TRUNCATED_TRIES + attempt)
        if init.low <= x <= init.high:
            return x
    return min(max(x, init.low), init.high)


def initial_rows(init, keys: Iterable[int], dim: int, *, seed: int,
                 table_id: int) -> List[List[float]]:
    """The rows ``init`` gives ``keys`` (Python floats: round to float32 to compare)."""
    return [[initial_value(init, row_stream(seed, table_id, k), j) for j in range(dim)]
            for k in keys]
