"""CUDA pooling kernel: one warp per bag, lanes stride over the columns (coalesced row reads
and output writes); same contract as ``pool_cpu.pool_bags_cpu``."""
from numba import cuda, float32

WARP = 32


@cuda.jit
def pool_bags_kernel(weights, occ_slots, offsets, scale, mean, batch, cols, dim, out):
    """Launch ``WARP`` threads per bag."""
    t = cuda.grid(1)
    q = t // WARP
    lane = t % WARP
    if batch == 0 or q >= offsets.size - 1:
        return
    i = q // batch
    b = q - i * batch
    c = cols[i]
    start = offsets[q]
    end = offsets[q + 1]
    for j in range(lane, dim, WARP):
        acc = float32(0.0)
        for k in range(start, end):
            x = weights[occ_slots[k], j]
            if scale.size > 0:
                x = x * scale[k]
            acc += x
        if mean and end > start:
            acc = acc / float32(end - start)
        out[b, c + j] = acc
