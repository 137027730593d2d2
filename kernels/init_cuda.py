"""CUDA initializer kernel: one thread per element of ``out`` [N, D]."""
from numba import cuda

from .init_common import initial_value
from .rng import row_stream


@cuda.jit
def init_rows_kernel(out, keys, seed, table_id, kind, p0, p1, low, high):
    t = cuda.grid(1)
    dim = out.shape[1]
    if t < keys.size * dim:
        i = t // dim
        j = t - i * dim
        out[i, j] = initial_value(kind, p0, p1, low, high, row_stream(seed, table_id, keys[i]), j)


@cuda.jit
def init_rows_at_kernel(weights, slots, keys, mask, dim, seed, table_id, kind, p0, p1, low, high):
    """One thread per element of the rows ``weights[slots[i]]`` with ``mask[i]``: the initial
    value in columns ``[0, dim)``, zero (optimizer state) after."""
    t = cuda.grid(1)
    width = weights.shape[1]
    if t < slots.size * width:
        i = t // width
        j = t - i * width
        s = slots[i]
        if s < 0 or not mask[i]:
            return
        if j < dim:
            weights[s, j] = initial_value(kind, p0, p1, low, high,
                                          row_stream(seed, table_id, keys[i]), j)
        else:
            weights[s, j] = 0.0
