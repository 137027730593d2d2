"""Initializer rules shared by ``init_cpu.py`` and ``init_cuda.py``."""
from numba import njit

from .rng import normal_pair, standard_normal, uniform01

INIT_NORMAL = 0
INIT_TRUNCATED_NORMAL = 1
INIT_UNIFORM = 2
INIT_CONSTANT = 3

#: Draws a truncated normal tries before falling back to clamping (p(reject) <= 0.32 per draw
#: for bounds at +-1 std, so the fallback is reached with probability below 1e-15).
_TRUNCATED_TRIES = 32


@njit(cache=True, inline="always")
def initial_value(kind, p0, p1, low, high, stream, column):
    """Element ``column`` of a row. NORMAL/TRUNCATED: p0 mean, p1 std; UNIFORM: [p0, p1)."""
    if kind == INIT_CONSTANT:
        return p0
    if kind == INIT_UNIFORM:
        return p0 + (p1 - p0) * uniform01(stream, column)
    if kind == INIT_NORMAL:
        return p0 + p1 * standard_normal(stream, column)
    x = p0
    for attempt in range(_TRUNCATED_TRIES):
        x = p0 + p1 * standard_normal(stream, column * _TRUNCATED_TRIES + attempt)
        if low <= x <= high:
            return x
    return min(max(x, low), high)


@njit(cache=True, inline="always")
def fill_row(row, kind, p0, p1, low, high, stream, dim):
    """``row[j] = initial_value(..., j)`` for ``j < dim``; NORMAL rows take both values of each
    Box-Muller pair at once (half the logs and square roots of element by element)."""
    if kind == INIT_NORMAL:
        for j in range(0, dim - 1, 2):
            first, second = normal_pair(stream, j >> 1)
            row[j] = p0 + p1 * first
            row[j + 1] = p0 + p1 * second
        if dim % 2 == 1:
            row[dim - 1] = initial_value(kind, p0, p1, low, high, stream, dim - 1)
        return
    for j in range(dim):
        row[j] = initial_value(kind, p0, p1, low, high, stream, j)
