"""CUDA rounding kernel: one thread per element of ``src`` [N, D]."""
from numba import cuda

from .rng import random_bits32, update_stream
from .round_common import round_bits


@cuda.jit
def round_rows_kernel(src, out, keys, seed, table_id, step, fmt, stochastic):
    """Same contract as ``round_cpu.round_rows_cpu``."""
    t = cuda.grid(1)
    dim = src.shape[1]
    if t < keys.size * dim:
        i = t // dim
        j = t - i * dim
        stream = update_stream(seed, table_id, keys[i], step)
        out[i, j] = round_bits(src[i, j], random_bits32(stream, j), fmt, stochastic)
