"""Fused optimizers for embedding rows: the update of a row and its state in one kernel pass.

The rules are those of fbgemm's TBE fused optimizers (``fbgemm_gpu`` 1.8), so a table trained
here follows a TorchRec table trained with the same ``EmbOptimType`` and fused params. With
``g`` the row's gradient summed over the batch, ``lr`` the learning rate and ``t`` the 1-based
step:

- SGD (``EXACT_SGD``): ``w -= lr * g``.
- ADAGRAD (``EXACT_ADAGRAD``): ``acc += g^2; w -= lr * g / (sqrt(acc) + eps)``, per element.
- ROWWISE_ADAGRAD (``EXACT_ROWWISE_ADAGRAD``): one accumulator per row;
  ``acc += mean_j((g_j + wd * w_j)^2); k = lr / (sqrt(acc) + eps); w = (1 - k * wd) * w - k * g``
  (fbgemm's ``WeightDecayMode.L2``).
- ADAM (``ADAM``): ``m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
  w -= lr * (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + wd * w)``, i.e. AdamW with the
  decay scaled by ``lr``. fbgemm runs ADAM on GPU only (its CPU TBE rejects it).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from dynemb.backends.numba_backends import resolve_kernels
from dynemb.rows.flat_table import RowLayout
from dynemb.backends import protocol as codes
from dynemb.backends.protocol import KernelBackend
from dynemb.rows.occurrence_grads import OccurrenceGrads, occurrence_csr
from dynemb.optimizer_config import (OptimizerConfig, OptimizerType, check_number,
                                     clip_gradients)
from dynemb.types import SUPPORTED_DTYPES
from dynemb.foundations.validation import check_int, same_device

__all__ = ["OccurrenceGrads", "OptimizerConfig", "OptimizerType", "clip_gradients",
           "fused_update", "occurrence_csr", "round_rows"]

_KIND_CODES = {
    OptimizerType.SGD: codes.OPT_SGD,
    OptimizerType.ADAM: codes.OPT_ADAM,
    OptimizerType.ADAGRAD: codes.OPT_ADAGRAD,
    OptimizerType.ROWWISE_ADAGRAD: codes.OPT_ROWWISE_ADAGRAD,
}


def fused_update(weights: torch.Tensor, slots: torch.Tensor,
                 grads: Union[torch.Tensor, OccurrenceGrads], *, dim: int,
                 config: OptimizerConfig, lr: float, step: int, backend=None,
                 keys: Optional[torch.Tensor] = None, seed: int = 0, table_id: int = 0,
                 stochastic_rounding: bool = True,
                 kernels: Optional[KernelBackend] = None) -> None:
    """Apply one optimizer step to the rows at ``slots``, in place.

    For each ``i`` with ``slots[i] >= 0``, row ``weights[slots[i]]`` (laid out as
    :class:`~dynemb.rows.flat_table.RowLayout` says: the embedding, then the optimizer state)
    takes the gradient ``grads[i]``.

    Args:
        weights: [C, W] float32, float16 or bfloat16, ``W >= RowLayout(dim, state_dim,
            dtype).width``. Math is in float32 and the optimizer state is float32 whatever
            the dtype; the embedding is stored in the weights' dtype.
        slots: [U] int64 rows to update, unique; entries < 0 are skipped.
        grads: [U, dim] the summed gradient of each row (float32; other float dtypes are
            converted), already clipped if clipping is on (see :func:`clip_gradients`); or an
            :class:`OccurrenceGrads` of ``U`` rows, summed (and clipped) by the kernel.
        dim: embedding width.
        config: the optimizer; ``config.learning_rate`` is not read, ``lr`` is.
        lr: learning rate of this step.
        step: 1-based global step (Adam's bias correction ``1 - beta^step``).
        backend: None picks it from ``weights.device``; "cpu" or "cuda" (under the CUDA
            simulator the "cuda" backend runs on CPU tensors).
        kernels: the kernels the owning table resolved, instead of ``backend``.
        keys: [U] int64, the key of each row: float16 / bfloat16 weights with
            ``stochastic_rounding`` need them (the rounding noise follows the key, not the
            slot); float32 weights ignore them, as they do ``seed`` and ``table_id``.
        seed, table_id: with ``keys``, ``step`` and the column, fix the rounding noise.
        stochastic_rounding: round the updated float16 / bfloat16 embedding stochastically
            (unbiased, see :func:`round_rows`); False rounds to nearest.

    Note:
        float32 weights are updated in place by one kernel. float16 / bfloat16 rows are
        gathered, widened to float32, updated by the same kernel, rounded and scattered back.

    Example::

        >>> cfg = OptimizerConfig(OptimizerType.SGD)
        >>> w = torch.zeros(4, 2)
        >>> fused_update(w, torch.tensor([2, -1]), torch.ones(2, 2), dim=2, config=cfg,
        ...              lr=0.5, step=1)
        >>> w[2]
        tensor([-0.5000, -0.5000])
        >>> h = torch.zeros(4, 2, dtype=torch.float16)
        >>> fused_update(h, torch.tensor([2]), torch.full((1, 2), 1e-4), dim=2, config=cfg,
        ...              lr=1.0, step=1, keys=torch.tensor([7]))
    """
    if not isinstance(config, OptimizerConfig):
        raise TypeError(f"config must be an OptimizerConfig, got {type(config).__name__}")
    state_dim = config.state_dim(dim)
    check_number(lr, "lr")
    check_int(step, "step")
    _check_inputs(weights, slots, grads, dim, state_dim)
    chosen = resolve_kernels(weights.device, backend, kernels)
    if weights.dtype != torch.float32:
        _check_rounding_inputs(keys, slots.numel(), weights.device, stochastic_rounding)
    if not slots.numel():
        return
    if not isinstance(grads, OccurrenceGrads):
        grads = OccurrenceGrads.of_rows(grads)
    bias1 = 1.0 - config.beta1 ** int(step)
    bias2 = 1.0 - config.beta2 ** int(step)
    args = (_KIND_CODES[config.type], dim, float(lr), config.eps, config.beta1, config.beta2,
            config.weight_decay, bias1, bias2, config.initial_accumulator_value)
    if weights.dtype == torch.float32:
        chosen.fused_update(weights, slots.contiguous(), *grads.kernel_args(), *args)
        return
    layout = RowLayout(dim, state_dim, weights.dtype)
    live = slots >= 0
    rows = weights.index_select(0, slots.clamp(min=0))
    logical = layout.to_logical(rows).contiguous()
    local = torch.where(live, torch.arange(slots.numel(), device=slots.device), -1)
    chosen.fused_update(logical, local, *grads.kernel_args(), *args)
    row_keys = keys if keys is not None else torch.zeros_like(slots)
    layout.embeddings(rows).copy_(round_rows(
        logical[:, :dim], weights.dtype, keys=row_keys, step=int(step), seed=seed,
        table_id=table_id, stochastic=stochastic_rounding, kernels=chosen))
    layout.state(rows).copy_(logical[:, dim:])
    weights.index_copy_(0, slots[live], rows[live])


def round_rows(values: torch.Tensor, dtype: torch.dtype, *, keys: torch.Tensor, step: int,
               seed: int = 0, table_id: int = 0, stochastic: bool = True,
               backend=None, kernels: Optional[KernelBackend] = None) -> torch.Tensor:
    """``values`` [N, D] float32 rounded to ``dtype`` (float16 or bfloat16), by ``kernels``
    (what the caller resolved) or else the ``backend`` of the values' device.

    Stochastic rounding rounds each value to one of its two neighbours in ``dtype``, the
    upper one with probability ``(value - lower) / (upper - lower)``: the expected result is
    ``value``, so small updates are kept on average instead of always rounded away. The
    random bits of element ``(i, j)`` depend only on ``(seed, table_id, keys[i], step, j)``.
    ``stochastic=False`` rounds to nearest (ties to even), like ``values.to(dtype)``.
    Values exactly representable in ``dtype`` are returned exactly; NaN and inf are kept;
    finite values beyond ``dtype``'s range round to inf.

    Example::

        >>> x = torch.full((1, 10000), 1.0 + 2 ** -12)  # 1/4 of the way from 1.0 to 1.0 + 2^-10
        >>> up = round_rows(x, torch.float16, keys=torch.tensor([5]), step=1) > 1.0
        >>> round(up.float().mean().item(), 2)
        0.25
        >>> round_rows(x, torch.float16, keys=torch.tensor([5]), step=1, stochastic=False).max()
        tensor(1., dtype=torch.float16)
    """
    if dtype not in _ROUNDED_FORMATS:
        raise ValueError(f"dtype must be one of {tuple(_ROUNDED_FORMATS)}, got {dtype}")
    if values.dim() != 2:
        raise ValueError(f"values must be 2-D, got shape {tuple(values.shape)}")
    _check_rounding_inputs(keys, values.shape[0], values.device, stochastic)
    chosen = resolve_kernels(values.device, backend, kernels)
    src = values.to(torch.float32).contiguous()
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    if src.numel():
        chosen.round_rows(src, out, keys.contiguous(), int(seed), int(table_id), int(step),
                          _ROUNDED_FORMATS[dtype], bool(stochastic))
    return out


_ROUNDED_FORMATS = {torch.float16: codes.FMT_FLOAT16,
                    torch.bfloat16: codes.FMT_BFLOAT16}


def _check_rounding_inputs(keys, rows: int, device: torch.device, stochastic) -> None:
    if not isinstance(stochastic, bool):
        raise TypeError(f"stochastic_rounding must be a bool, got {stochastic!r}")
    if keys is None:
        if stochastic:
            raise ValueError("keys are needed to round float16 / bfloat16 rows "
                             "stochastically (pass stochastic_rounding=False to round to "
                             "nearest)")
        return
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64 or (
            tuple(keys.shape) != (rows,)):
        got = f"{keys.dtype} {tuple(keys.shape)}" if isinstance(keys, torch.Tensor) else keys
        raise ValueError(f"keys must be an int64 tensor of shape ({rows},), got {got}")
    if not same_device(keys.device, device):
        raise ValueError(f"keys are on {keys.device} but the rows on {device}")


def _check_inputs(weights, slots, grads, dim, state_dim) -> None:
    for t, name in ((weights, "weights"), (slots, "slots")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(grads, (torch.Tensor, OccurrenceGrads)):
        raise TypeError(f"grads must be a torch.Tensor or OccurrenceGrads, got "
                        f"{type(grads).__name__}")
    if weights.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"weights must have a dtype in {SUPPORTED_DTYPES}, got {weights.dtype}")
    width = RowLayout(dim, state_dim, weights.dtype).width
    if weights.dim() != 2 or weights.shape[1] < width:
        raise ValueError(f"weights must be [C, W] with W >= {width} (RowLayout(dim, state, "
                         f"{weights.dtype}).width), got {tuple(weights.shape)}")
    if not weights.is_contiguous():
        raise ValueError("weights must be contiguous")
    if slots.dtype != torch.int64 or slots.dim() != 1:
        raise TypeError(f"slots must be a 1-D int64 tensor, got {slots.dtype} with shape "
                        f"{tuple(slots.shape)}")
    if isinstance(grads, OccurrenceGrads):
        if grads.src.dim() != 2 or grads.src.shape[1] != dim or grads.num_rows != slots.numel():
            raise ValueError(f"grads must give {slots.numel()} rows of width {dim}, got "
                             f"{grads.num_rows} rows of {tuple(grads.src.shape)} occurrences")
        grads = grads.src
    elif not grads.is_floating_point() or tuple(grads.shape) != (slots.numel(), dim):
        raise ValueError(f"grads must be a float tensor of shape [{slots.numel()}, {dim}], got "
                         f"{grads.dtype} {tuple(grads.shape)}")
    for t, name in ((slots, "slots"), (grads, "grads")):
        if not same_device(t.device, weights.device):
            raise ValueError(f"{name} is on {t.device} but weights are on {weights.device}")
    # On the GPU this check would stall the host; slots come from the table there.
    if slots.numel() and weights.device.type == "cpu" and int(slots.max()) >= weights.shape[0]:
        raise ValueError(f"slots must be < {weights.shape[0]} (rows of weights), got "
                         f"{int(slots.max())}")
