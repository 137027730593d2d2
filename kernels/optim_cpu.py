"""CPU fused optimizer kernel: one pass over each touched row and its state (``prange`` over
rows; slots are unique, so no two iterations write the same row).

``reassoc`` lets numba vectorise row-wise AdaGrad's per-row sum of squares (a serial float32
loop otherwise: 1.07 -> 0.47 ms for 13k rows of dim 64, 1.74 -> 0.92 ms at dim 128, on 2
cores); only the summation order changes."""
from numba import float32, njit, prange

from .optim_common import (OPT_ADAGRAD, OPT_ADAM, OPT_ROWWISE_ADAGRAD, OPT_SGD, adagrad_element,
                           adam_element, rowwise_adagrad_scale, rowwise_element, rowwise_grad,
                           sgd_element)


@njit(cache=True, parallel=True, fastmath={"reassoc"})
def fused_update_cpu(weights, slots, grads, kind, dim, lr, eps, beta1, beta2, weight_decay,
                     bias1, bias2, acc0):
    """Update ``weights[slots[i]]`` [W] float32 with ``grads[i]`` [dim]; ``slots[i] < 0`` skips.

    ``acc0`` is added to AdaGrad accumulators on read and subtracted on write (see
    ``OptimizerConfig.initial_accumulator_value``). Scalars are float32.
    """
    for i in prange(slots.size):
        s = slots[i]
        if s < 0:
            continue
        if kind == OPT_SGD:
            for j in range(dim):
                weights[s, j] = sgd_element(weights[s, j], grads[i, j], lr)
        elif kind == OPT_ADAM:
            for j in range(dim):
                w, m, v = adam_element(weights[s, j], weights[s, dim + j],
                                       weights[s, 2 * dim + j], grads[i, j], lr, beta1, beta2,
                                       bias1, bias2, eps, weight_decay)
                weights[s, j] = w
                weights[s, dim + j] = m
                weights[s, 2 * dim + j] = v
        elif kind == OPT_ADAGRAD:
            for j in range(dim):
                w, acc = adagrad_element(weights[s, j], weights[s, dim + j] + acc0, grads[i, j],
                                         lr, eps)
                weights[s, j] = w
                weights[s, dim + j] = acc - acc0
        elif kind == OPT_ROWWISE_ADAGRAD:
            sum_sq = float32(0.0)
            if weight_decay == 0:
                for j in range(dim):
                    sum_sq += grads[i, j] * grads[i, j]
            else:
                for j in range(dim):
                    g = rowwise_grad(grads[i, j], weights[s, j], weight_decay)
                    sum_sq += g * g
            acc, multiplier, correction = rowwise_adagrad_scale(
                weights[s, dim] + acc0, sum_sq, dim, lr, eps, weight_decay)
            weights[s, dim] = acc - acc0
            for j in range(dim):
                weights[s, j] = rowwise_element(weights[s, j], grads[i, j], multiplier, correction)
