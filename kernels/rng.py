"""Counter-based random numbers: the value depends only on (seed, table, key, counter).

This is what makes a new row's initial vector independent of batch order, rank, backend and
storage mode. Shared by the CPU and CUDA initializer kernels.
"""
import math

import numpy as np
from numba import njit

from .hashing import mix64

_MASK53 = np.int64((1 << 53) - 1)
_GOLDEN = np.int64(-7046029254386353131)  # 0x9e3779b97f4a7c15 as int64
_INV_2_53 = 1.0 / 9007199254740992.0


@njit(cache=True, inline="always")
def row_stream(seed, table_id, key):
    """A 64-bit word identifying the random stream of one row."""
    return mix64(mix64(seed ^ (table_id * _GOLDEN)) ^ key)


@njit(cache=True, inline="always")
def uniform01(stream, counter):
    """Uniform in the open interval (0, 1), 53 bits of resolution."""
    h = mix64(stream + (counter + 1) * _GOLDEN)
    return (float((h >> 11) & _MASK53) + 0.5) * _INV_2_53


@njit(cache=True, inline="always")
def normal_pair(stream, pair):
    """Two independent standard normals: Box-Muller on the uniforms drawn at ``2 * pair`` and
    ``2 * pair + 1``, both of its outputs (one log, one square root for two values)."""
    u1 = uniform01(stream, 2 * pair)
    u2 = uniform01(stream, 2 * pair + 1)
    radius = math.sqrt(-2.0 * math.log(u1))
    angle = 2.0 * math.pi * u2
    return radius * math.cos(angle), radius * math.sin(angle)


@njit(cache=True, inline="always")
def standard_normal(stream, counter):
    """Normal number ``counter`` of the stream: output ``counter % 2`` of
    ``normal_pair(stream, counter // 2)``."""
    first, second = normal_pair(stream, counter >> 1)
    return first if (counter & 1) == 0 else second


_UPDATE_SALT = np.int64(0x5DEECE66D)


@njit(cache=True, inline="always")
def update_stream(seed, table_id, key, step):
    """The random stream of one row's update at ``step`` (e.g. its stochastic rounding).

    Independent of the row's initializer stream and of where the row is stored."""
    return mix64(row_stream(seed, table_id, key) ^ mix64(step * _GOLDEN + _UPDATE_SALT))


@njit(cache=True, inline="always")
def random_bits32(stream, counter):
    """32 uniform random bits, as an int64 in ``[0, 2**32)``."""
    return (mix64(stream + (counter + 1) * _GOLDEN) >> 32) & np.int64(0xFFFFFFFF)
