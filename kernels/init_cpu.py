"""CPU initializer kernel: fill ``out[i, :]`` with the initial row of ``keys[i]``."""
from numba import njit, prange

from .init_common import initial_value
from .rng import row_stream


@njit(cache=True, parallel=True)
def init_rows_cpu(out, keys, seed, table_id, kind, p0, p1, low, high):
    """``out`` [N, D] float32; rows depend only on (seed, table_id, key)."""
    for i in prange(keys.size):
        stream = row_stream(seed, table_id, keys[i])
        for j in range(out.shape[1]):
            out[i, j] = initial_value(kind, p0, p1, low, high, stream, j)
