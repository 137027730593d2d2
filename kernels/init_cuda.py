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


KERNELS = {"init_rows_kernel": init_rows_kernel}
