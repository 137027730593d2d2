"""CUDA fused optimizer kernel: one warp per touched row, lanes stride over its columns.

Consecutive lanes touch consecutive columns, so every access of a row is coalesced. Each
lane sums its columns of the row's occurrence gradients (``src[order[k]]``, clamped and
scaled as in ``optim_cpu.fused_update_cpu``) as it goes: no ``[rows, dim]`` gradient is ever
written.

A row with more than ``PIECE`` occurrences (a hot id) would keep its one warp looping over
them alone while the others idle: at 81,920 Zipf ids a step, the hottest row's ~7,000
occurrences made the whole update 23 ms on an H200. Such a row is cut into pieces of
``PIECE`` occurrences, each summed by its own warp (``piece_sums_kernel``) into a small
``[pieces, dim]`` buffer; the row's warp then adds its pieces in order. The cut depends on
the row alone (not on where it sits in the batch), so a row's gradient is the same float32
sum whether its table runs alone or in a group. Row-wise
AdaGrad sums the row's squared gradients with a shared-memory tree inside each warp (the
simulator has no warp shuffles); every thread of the block, in range or not, takes part in the
``syncthreads`` barriers, which is why no thread returns early.
"""
from numba import cuda, float32

from .optim_common import (OPT_ADAGRAD, OPT_ADAM, OPT_ROWWISE_ADAGRAD, OPT_SGD, adagrad_element,
                           adam_element, rowwise_adagrad_scale, rowwise_element, rowwise_grad,
                           sgd_element)

WARP = 32
#: Launches use at most this many threads per block (the shared reduction buffer's size).
MAX_THREADS_PER_BLOCK = 256
#: Occurrences a row's warp sums itself; a row with more is summed a piece of this many at a
#: time by ``piece_sums_kernel`` (a hot row then costs about its count / PIECE + PIECE serial
#: loads, not its count).
PIECE = 64


@cuda.jit(device=True, inline=True)
def _occurrence_sum(src, order, scale, clip, start, end, j):
    """Column ``j`` of the clamped, scaled gradients of occurrences ``start:end``."""
    g = float32(0.0)
    for k in range(start, end):
        x = src[order[k], j]
        if clip >= 0:
            x = min(max(x, -clip), clip)
        if scale.size > 0:
            x = x * scale[k]
        g += x
    return g


@cuda.jit(device=True, inline=True)
def _row_grad(src, offsets, order, scale, clip, piece_end, piece_count, pieces, row, j):
    """Column ``j`` of row ``row``'s gradient: its occurrences' clamped, scaled sum, from its
    pieces when it has any."""
    count = piece_count[row]
    if count == 0:
        return _occurrence_sum(src, order, scale, clip, offsets[row], offsets[row + 1], j)
    g = float32(0.0)
    for p in range(piece_end[row] - count, piece_end[row]):
        g += pieces[p, j]
    return g


@cuda.jit
def piece_counts_kernel(offsets, piece, out_count):
    """Per row ``r`` of the CSR ``offsets``: its number of pieces of ``piece`` occurrences,
    ``ceil(count / piece)``, or 0 for a row of at most ``piece`` (summed whole)."""
    r = cuda.grid(1)
    if r >= out_count.size:
        return
    count = offsets[r + 1] - offsets[r]
    out_count[r] = (count + piece - 1) // piece if count > piece else 0


@cuda.jit
def piece_rows_kernel(piece_end, piece_count, out_piece_row):
    """Each row writes its own number into its pieces' places ``[piece_end[r] -
    piece_count[r], piece_end[r])`` of ``out_piece_row`` (the rest keeps the padding)."""
    r = cuda.grid(1)
    if r >= piece_count.size:
        return
    end = piece_end[r]
    for p in range(end - piece_count[r], end):
        out_piece_row[p] = r


@cuda.jit
def piece_sums_kernel(src, offsets, order, scale, clip, piece_row, piece_end, piece_count,
                      pieces, dim):
    """Warp ``p`` sums piece ``p`` into ``pieces[p, :dim]``: piece ``i`` of row
    ``r = piece_row[p]`` holds occurrences ``offsets[r] + i * PIECE`` onwards (at most
    ``PIECE``), ``i = p - (piece_end[r] - piece_count[r])``; ``r`` past the rows (the padding
    of an upper bound on the pieces) does nothing. Launch ``WARP`` threads per piece."""
    p = cuda.grid(1) // WARP
    lane = cuda.threadIdx.x % WARP
    if p >= piece_row.size:
        return
    r = piece_row[p]
    if r >= piece_count.size:
        return
    start = offsets[r] + (p - (piece_end[r] - piece_count[r])) * PIECE
    end = min(start + PIECE, offsets[r + 1])
    for j in range(lane, dim, WARP):
        pieces[p, j] = _occurrence_sum(src, order, scale, clip, start, end, j)


@cuda.jit
def fused_update_kernel(weights, slots, src, offsets, order, scale, clip, piece_end,
                        piece_count, pieces, kind, dim, lr, eps, beta1, beta2, weight_decay,
                        bias1, bias2, acc0):
    """Same contract as ``optim_cpu.fused_update_cpu``, a row's gradient taken from its
    pieces (``piece_sums_kernel``) where ``piece_count[row] > 0``; launch ``WARP`` threads
    per row."""
    partial = cuda.shared.array(MAX_THREADS_PER_BLOCK, float32)
    tid = cuda.threadIdx.x
    lane = tid % WARP
    row = cuda.grid(1) // WARP
    s = -1
    if row < slots.size and slots[row] < weights.shape[0]:  # past the rows: skipped
        s = slots[row]
    if kind == OPT_ROWWISE_ADAGRAD:
        sum_sq = float32(0.0)
        old_acc = float32(0.0)
        if s >= 0:
            old_acc = weights[s, dim]  # read before lane 0 may overwrite it below
            for j in range(lane, dim, WARP):
                g = rowwise_grad(_row_grad(src, offsets, order, scale, clip, piece_end,
                                           piece_count, pieces, row, j),
                                 weights[s, j], weight_decay)
                sum_sq += g * g
        partial[tid] = sum_sq
        cuda.syncthreads()
        width = WARP // 2
        while width > 0:
            if lane < width:
                partial[tid] += partial[tid + width]
            cuda.syncthreads()
            width //= 2
        if s >= 0:
            acc, multiplier, correction = rowwise_adagrad_scale(
                old_acc + acc0, partial[tid - lane], dim, lr, eps, weight_decay)
            for j in range(lane, dim, WARP):
                g = _row_grad(src, offsets, order, scale, clip, piece_end, piece_count,
                              pieces, row, j)
                weights[s, j] = rowwise_element(weights[s, j], g, multiplier, correction)
            if lane == 0:
                weights[s, dim] = acc - acc0
        return
    if s < 0:
        return
    for j in range(lane, dim, WARP):
        g = _row_grad(src, offsets, order, scale, clip, piece_end, piece_count, pieces,
                      row, j)
        if kind == OPT_SGD:
            weights[s, j] = sgd_element(weights[s, j], g, lr)
        elif kind == OPT_ADAM:
            w, m, v = adam_element(weights[s, j], weights[s, dim + j], weights[s, 2 * dim + j], g,
                                   lr, beta1, beta2, bias1, bias2, eps, weight_decay)
            weights[s, j] = w
            weights[s, dim + j] = m
            weights[s, 2 * dim + j] = v
        elif kind == OPT_ADAGRAD:
            w, acc = adagrad_element(weights[s, j], weights[s, dim + j] + acc0, g, lr, eps)
            weights[s, j] = w
            weights[s, dim + j] = acc - acc0
