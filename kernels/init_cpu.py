"""CPU initializer kernel: fill ``out[i, :]`` with the initial row of ``keys[i]``."""
from numba import njit, prange

from .cpu_compile import prange_loops
from .init_common import fill_row
from .rng import row_stream


@njit(cache=True, parallel=prange_loops())
def init_rows_cpu(out, keys, seed, table_id, kind, p0, p1, low, high):
    """``out`` [N, D] float32; rows depend only on (seed, table_id, key)."""
    for i in prange(keys.size):
        fill_row(out[i], kind, p0, p1, low, high, row_stream(seed, table_id, keys[i]),
                 out.shape[1])


@njit(cache=True, parallel=prange_loops())
def init_rows_at_cpu(weights, slots, keys, mask, dim, seed, table_id, kind, p0, p1, low, high):
    """Start row ``weights[slots[i]]`` of every ``mask[i]`` (and ``slots[i] >= 0``) from
    ``keys[i]``: columns ``[0, dim)`` the initial value, the rest (optimizer state) zero.
    The threads split the entries up to the last one written (a group's padding comes last:
    split with it, one thread would get the rows and the other the padding)."""
    end = slots.size
    while end > 0 and (slots[end - 1] < 0 or not mask[end - 1]):
        end -= 1
    for i in prange(end):
        s = slots[i]
        if s < 0 or not mask[i]:
            continue
        row = weights[s]
        fill_row(row, kind, p0, p1, low, high, row_stream(seed, table_id, keys[i]), dim)
        for j in range(dim, weights.shape[1]):
            row[j] = 0.0
