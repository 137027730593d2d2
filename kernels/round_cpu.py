"""CPU rounding kernel: float32 rows to float16 / bfloat16 bits (``prange`` over rows)."""
from numba import njit, prange

from .cpu_compile import prange_loops
from .rng import random_bits32, update_stream
from .round_common import round_bits


@njit(cache=True, parallel=prange_loops())
def round_rows_cpu(src, out, keys, seed, table_id, step, fmt, stochastic):
    """``out[i, j]`` (int16 bits) = ``src[i, j]`` (float32 bits, int32) rounded to ``fmt``.

    The random bits of element (i, j) depend only on (seed, table_id, keys[i], step, j)."""
    for i in prange(keys.size):
        stream = update_stream(seed, table_id, keys[i], step)
        for j in range(src.shape[1]):
            out[i, j] = round_bits(src[i, j], random_bits32(stream, j), fmt, stochastic)
