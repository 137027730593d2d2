"""Per-element optimizer rules shared by ``optim_cpu.py`` and ``optim_cuda.py``.

The formulas are those of fbgemm's TBE fused optimizers (``split_weight_update_cpu`` and the
CUDA ``split_weight_update`` in fbgemm_gpu/codegen/genscript/optimizers.py). Every argument is
a float32 scalar and every constant is cast to float32, so both backends compute in float32.

Row layout: ``[embedding (dim) | state]``; the state is ``m`` then ``v`` (Adam, ``2 * dim``),
the accumulator (AdaGrad, ``dim``) or one accumulator (row-wise AdaGrad).
"""
import math

from numba import float32, njit

OPT_SGD = 0
OPT_ADAM = 1
OPT_ADAGRAD = 2
OPT_ROWWISE_ADAGRAD = 3

_ONE = float32(1.0)


@njit(cache=True, inline="always")
def sgd_element(w, g, lr):
    """``w - lr * g``."""
    return w - lr * g


@njit(cache=True, inline="always")
def adagrad_element(w, acc, g, lr, eps):
    """(new weight, new accumulator): ``acc += g^2; w -= lr * g / (sqrt(acc) + eps)``."""
    acc = acc + g * g
    return w - lr * g / (math.sqrt(acc) + eps), acc


@njit(cache=True, inline="always")
def adam_element(w, m, v, g, lr, beta1, beta2, bias1, bias2, eps, weight_decay):
    """(new weight, m, v). ``bias1 = 1 - beta1^step``, ``bias2 = 1 - beta2^step``.

    Weight decay is decoupled and scaled by the learning rate (fbgemm's ADAM, i.e. AdamW):
    ``w -= lr * (m / bias1 / (sqrt(v / bias2) + eps) + weight_decay * w)``.
    """
    m = beta1 * m + (_ONE - beta1) * g
    v = beta2 * v + (_ONE - beta2) * g * g
    return w - lr * (m / bias1 / (math.sqrt(v / bias2) + eps) + weight_decay * w), m, v


@njit(cache=True, inline="always")
def rowwise_grad(g, w, weight_decay):
    """The gradient row-wise AdaGrad squares: L2 weight decay adds ``weight_decay * w``."""
    return g + weight_decay * w


@njit(cache=True, inline="always")
def rowwise_adagrad_scale(acc, sum_sq, dim, lr, eps, weight_decay):
    """(new accumulator, multiplier, correction) of a row whose squared gradients sum to ``sum_sq``.

    The row then becomes ``correction * w - multiplier * g`` with the raw gradient ``g``: the
    same as ``w - multiplier * (g + weight_decay * w)``.
    """
    acc = acc + sum_sq / float32(dim)
    multiplier = lr / (math.sqrt(acc) + eps)
    return acc, multiplier, _ONE - multiplier * weight_decay


@njit(cache=True, inline="always")
def rowwise_element(w, g, multiplier, correction):
    return correction * w - multiplier * g
