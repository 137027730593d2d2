"""CUDA pooling kernels: one warp per bag, lanes stride over the columns (coalesced row reads
and output writes); same contract as ``pool_cpu.pool_bags_cpu``. And the plain gather of each
occurrence's row (``pool_cpu.gather_rows_cpu``)."""
from numba import cuda, float32

WARP = 32


@cuda.jit
def pool_bags_kernel(weights, occ_slots, offsets, scale, mean, batch, cols, dim, out):
    """Launch ``WARP`` threads per bag; a slot outside ``weights`` adds nothing."""
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
            s = occ_slots[k]
            if s < 0 or s >= weights.shape[0]:
                continue
            x = weights[s, j]
            if scale.size > 0:
                x = x * scale[k]
            acc += x
        if mean and end > start:
            acc = acc / float32(end - start)
        out[b, c + j] = acc


@cuda.jit
def gather_rows_kernel(weights, slots, index, dim, fallback, keep, out):
    """One thread per output cell ``(i, j)``: ``out[i, j] = weights[slots[index[i]], j]``;
    where the slot is -1 (or past ``weights``: nothing is read out of bounds) nothing with
    ``keep``, else ``fallback[index[i], j]``, or 0 when ``fallback`` has no rows."""
    t = cuda.grid(1)
    i = t // dim
    if i >= index.size:
        return
    j = t - i * dim
    u = index[i]
    s = slots[u]
    if s >= 0 and s < weights.shape[0]:
        out[i, j] = weights[s, j]
    elif keep:
        return
    elif fallback.shape[0] > 0:
        out[i, j] = fallback[u, j]
    else:
        out[i, j] = float32(0.0)
