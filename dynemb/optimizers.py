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

import enum
import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import torch

from dynemb.backends import backend_for_device
from dynemb.flat_table import RowLayout
from dynemb.kernels import optim_common, optim_cpu, round_common
from dynemb.types import SUPPORTED_DTYPES
from dynemb.validation import check_int

if TYPE_CHECKING:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType


class OptimizerType(enum.Enum):
    SGD = "sgd"
    ADAM = "adam"
    ADAGRAD = "adagrad"
    ROWWISE_ADAGRAD = "rowwise_adagrad"


_KIND_CODES = {
    OptimizerType.SGD: optim_common.OPT_SGD,
    OptimizerType.ADAM: optim_common.OPT_ADAM,
    OptimizerType.ADAGRAD: optim_common.OPT_ADAGRAD,
    OptimizerType.ROWWISE_ADAGRAD: optim_common.OPT_ROWWISE_ADAGRAD,
}
#: fbgemm's EmbOptimType name -> ours.
_FROM_FBGEMM = {
    "EXACT_SGD": OptimizerType.SGD,
    "ADAM": OptimizerType.ADAM,
    "EXACT_ADAGRAD": OptimizerType.ADAGRAD,
    "EXACT_ROWWISE_ADAGRAD": OptimizerType.ROWWISE_ADAGRAD,
}
#: fbgemm's WeightDecayMode values.
_WD_NONE, _WD_L2, _WD_DECOUPLE = 0, 1, 2
#: fbgemm options this module does not implement, with the value that means "off".
_UNSUPPORTED_OFF = {"max_norm": 0.0, "counter_based_regularization": None,
                    "cowclip_regularization": None, "global_weight_decay": None,
                    "ensemble_mode": None, "emainplace_mode": None}


@dataclass(frozen=True)
class OptimizerConfig:
    """A fused optimizer and its hyperparameters (defaults are fbgemm TBE's defaults).

    - ``learning_rate``: default for ``fused_update``'s ``lr`` (which is what the kernel uses).
    - ``eps``: added to ``sqrt(...)``, outside the square root (1e-8, fbgemm's default).
    - ``beta1``, ``beta2``: Adam's decay rates (0.9, 0.999).
    - ``weight_decay``: ADAM decoupled ``lr * wd * w``; ROWWISE_ADAGRAD L2 (added to the
      gradient before squaring). SGD and ADAGRAD take none: fbgemm's EXACT_SGD and
      EXACT_ADAGRAD have no weight decay, so ``weight_decay`` must be 0 for them.
    - ``initial_accumulator_value``: where ADAGRAD / ROWWISE_ADAGRAD accumulators start
      (fbgemm starts at 0). State columns hold ``accumulator - initial_accumulator_value``, so
      a row whose state is zero-filled (a new row) starts exactly there.
    - ``max_gradient``: gradient clipping (None = off), fbgemm's ``gradient_clipping=True`` with
      its ``max_gradient``: each element of the gradient of every lookup *output* is clamped
      to ``[-max_gradient, max_gradient]`` before the gradients of a row are summed: give
      ``fused_update`` an :class:`OccurrenceGrads` with ``clip`` (the collections do), or
      apply :func:`clip_gradients` before reducing yourself; a summed ``[rows, dim]``
      gradient is never clipped (a sum of clipped gradients may exceed ``max_gradient``).

    Example::

        >>> cfg = OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD, learning_rate=0.05)
        >>> cfg.state_dim(64)
        1
    """

    type: OptimizerType = OptimizerType.SGD
    learning_rate: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    max_gradient: Optional[float] = None

    def __post_init__(self):
        if not isinstance(self.type, OptimizerType):
            raise TypeError(f"type must be an OptimizerType, got {self.type!r}")
        for name in ("learning_rate", "eps", "beta1", "beta2", "weight_decay",
                     "initial_accumulator_value"):
            _check_number(getattr(self, name), name)
        for name in ("learning_rate", "eps", "weight_decay", "initial_accumulator_value"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must lie in [0, 1), got {getattr(self, name)}")
        if self.weight_decay and self.type in (OptimizerType.SGD, OptimizerType.ADAGRAD):
            raise ValueError(f"weight_decay must be 0 for {self.type.value} (fbgemm's exact "
                             f"{self.type.value} has no weight decay), got {self.weight_decay}")
        if self.max_gradient is not None:
            _check_number(self.max_gradient, "max_gradient")
            if self.max_gradient <= 0:
                raise ValueError(f"max_gradient must be > 0 or None, got {self.max_gradient}")

    def state_dim(self, dim: int) -> int:
        """Optimizer state columns per row of width ``dim``: SGD 0, ADAM 2*dim (m then v),
        ADAGRAD dim, ROWWISE_ADAGRAD 1."""
        check_int(dim, "dim")
        return {OptimizerType.SGD: 0, OptimizerType.ADAM: 2 * dim,
                OptimizerType.ADAGRAD: dim, OptimizerType.ROWWISE_ADAGRAD: 1}[self.type]

    @classmethod
    def from_fbgemm(cls, optimizer: "EmbOptimType", /, **fused_params) -> "OptimizerConfig":
        """The config that trains like fbgemm's TBE with ``optimizer`` (an ``EmbOptimType``) and
        TorchRec ``fused_params``.

        Reads ``learning_rate``, ``eps``, ``beta1``, ``beta2``, ``weight_decay``,
        ``weight_decay_mode``, ``gradient_clipping`` and ``max_gradient`` (fbgemm's default 1.0
        when clipping is on); other keys (placement, caching, precision) are ignored, except
        optimizer features this module lacks (``max_norm``, counter-based or CowClip
        regularization, global weight decay, ensemble / EMA modes), which raise. Weight
        decay that fbgemm ignores is dropped: any for EXACT_SGD / EXACT_ADAGRAD, and for
        EXACT_ROWWISE_ADAGRAD unless ``weight_decay_mode`` is L2. ADAM applies it whatever the
        mode, like fbgemm.

        Note: fbgemm's CPU row-wise AdaGrad ignores weight decay altogether on its fast path
        (pooled lookups, fp32 weights, a table used by one feature); this config follows the
        general path, which applies it.

        Example::

            >>> from fbgemm_gpu.split_embedding_configs import EmbOptimType
            >>> OptimizerConfig.from_fbgemm(EmbOptimType.EXACT_ADAGRAD, learning_rate=0.1).type
            <OptimizerType.ADAGRAD: 'adagrad'>
        """
        name = getattr(optimizer, "name", None)
        if name not in _FROM_FBGEMM:
            raise ValueError(f"optimizer {name or repr(optimizer)} is not supported; supported: "
                             f"{', '.join(_FROM_FBGEMM)}")
        kind = _FROM_FBGEMM[name]
        params = dict(fused_params)
        given = params.pop("optimizer", None)
        if given is not None and getattr(given, "name", given) != name:
            raise ValueError(f"fused_params['optimizer'] is {given!r} but optimizer is {name}")
        kwargs = {key: float(params.pop(key)) for key in ("learning_rate", "eps", "beta1",
                                                           "beta2", "weight_decay")
                  if key in params}
        mode = int(params.pop("weight_decay_mode", _WD_NONE))
        if kind in (OptimizerType.SGD, OptimizerType.ADAGRAD):
            kwargs.pop("weight_decay", None)
        elif kind is OptimizerType.ROWWISE_ADAGRAD and kwargs.get("weight_decay"):
            if mode == _WD_NONE:
                kwargs.pop("weight_decay")
            elif mode != _WD_L2:
                raise ValueError(f"weight_decay_mode {mode} is not supported for row-wise "
                                 f"AdaGrad (only NONE=0 and L2=1)")
        elif kind is OptimizerType.ADAM and mode not in (_WD_NONE, _WD_L2, _WD_DECOUPLE):
            raise ValueError(f"weight_decay_mode {mode} is not supported for Adam")
        if params.get("gradient_clipping", False):
            kwargs["max_gradient"] = float(params.get("max_gradient", 1.0))
        for key, off in _UNSUPPORTED_OFF.items():
            if params.get(key, off) not in (off, None):
                raise ValueError(f"fused_params[{key!r}] is not supported, got {params[key]!r}")
        extra = params.get("extra_optimizer_config")
        if getattr(extra, "use_rowwise_bias_correction", False):
            raise ValueError("fused_params['extra_optimizer_config'].use_rowwise_bias_correction "
                             "is not supported")
        return cls(kind, **kwargs)


def _check_number(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def clip_gradients(grads: torch.Tensor, config: OptimizerConfig) -> torch.Tensor:
    """``grads`` clamped to ``[-max_gradient, max_gradient]`` (unchanged when clipping is off).

    Call it on the gradients of the lookup outputs, before summing the gradients of a row:
    that is where fbgemm clips.

    Example::

        >>> cfg = OptimizerConfig(max_gradient=1.0)
        >>> clip_gradients(torch.tensor([[-3.0, 0.5]]), cfg)
        tensor([[-1.0000,  0.5000]])
    """
    if config.max_gradient is None:
        return grads
    return grads.clamp(-config.max_gradient, config.max_gradient)


@dataclass(frozen=True)
class OccurrenceGrads:
    """The gradients of a lookup's occurrences, summed per row inside the optimizer kernel.

    Row ``i``'s gradient is the sum over ``k`` in ``offsets[i]:offsets[i + 1]`` of
    ``src[order[k]]``, each clamped to ``[-clip, clip]`` (when ``clip`` is set) and times
    ``scale[k]`` (when ``scale`` is set). So backward hands the kernel the output gradients
    [N, dim] and a CSR of the occurrences of each row, never a summed ``[rows, dim]`` tensor.

    Example::

        >>> g = OccurrenceGrads.from_inverse(torch.tensor([[1.0], [2.0], [4.0]]),
        ...                                  torch.tensor([1, 0, 1]), 2)
        >>> g.offsets.tolist(), g.order.tolist()
        ([0, 1, 3], [1, 0, 2])
        >>> g.dense().flatten().tolist()  # row 0: 2.0; row 1: 1.0 + 4.0
        [2.0, 5.0]
    """

    src: torch.Tensor
    offsets: torch.Tensor
    order: torch.Tensor
    scale: Optional[torch.Tensor] = None
    clip: Optional[float] = None

    @classmethod
    def from_inverse(cls, src: torch.Tensor, inverse: torch.Tensor, num_rows: int, *,
                     scale: Optional[torch.Tensor] = None,
                     clip: Optional[float] = None) -> "OccurrenceGrads":
        """Occurrence ``i`` (``src[i]``, ``scale[i]``) belongs to row ``inverse[i]`` of
        ``num_rows``. No host sync on CUDA."""
        offsets, order = occurrence_csr(inverse, num_rows)
        return cls(src.to(torch.float32).contiguous(), offsets, order,
                   None if scale is None else scale.to(torch.float32)[order].contiguous(), clip)

    @classmethod
    def of_rows(cls, grads: torch.Tensor) -> "OccurrenceGrads":
        """One occurrence per row: ``grads`` [U, dim] is each row's gradient."""
        rows = torch.arange(grads.shape[0] + 1, dtype=torch.int64, device=grads.device)
        return cls(grads.to(torch.float32).contiguous(), rows, rows[:-1])

    @property
    def num_rows(self) -> int:
        return self.offsets.numel() - 1

    def dense(self) -> torch.Tensor:
        """The summed gradient of every row, [rows, dim] (for tests and reference paths)."""
        g = self.src.index_select(0, self.order)
        if self.clip is not None:
            g = g.clamp(-self.clip, self.clip)
        if self.scale is not None:
            g = g * self.scale.unsqueeze(1)
        rows = torch.repeat_interleave(torch.arange(self.num_rows, device=g.device),
                                       self.offsets.diff())
        return torch.zeros(self.num_rows, g.shape[1], device=g.device).index_add_(0, rows, g)

    def kernel_args(self):
        """(src, offsets, order, scale, clip) as the backends' ``fused_update`` takes them."""
        scale = (self.scale if self.scale is not None else
                 torch.empty(0, dtype=torch.float32, device=self.src.device))
        return (self.src, self.offsets, self.order, scale,
                -1.0 if self.clip is None else float(self.clip))


def occurrence_csr(inverse: torch.Tensor, num_rows: int):
    """(offsets [num_rows + 1], order [N]) int64: ``order[offsets[u]:offsets[u + 1]]`` are the
    positions ``i`` with ``inverse[i] == u``, in input order. A numba counting sort on CPU;
    a stable sort and a cumulative sum on CUDA (no host sync)."""
    inverse = inverse.to(torch.int64).contiguous()
    if inverse.device.type == "cpu":
        offsets = torch.empty(num_rows + 1, dtype=torch.int64)
        order = torch.empty_like(inverse)
        optim_cpu.occurrence_csr_cpu(inverse.numpy(), num_rows, offsets.numpy(), order.numpy())
        return offsets, order
    return _occurrence_csr_torch(inverse, num_rows)


def _occurrence_csr_torch(inverse: torch.Tensor, num_rows: int):
    order = torch.sort(inverse, stable=True).indices
    counts = torch.zeros(num_rows, dtype=torch.int64, device=inverse.device)
    counts.index_add_(0, inverse, torch.ones_like(inverse))
    offsets = torch.zeros(num_rows + 1, dtype=torch.int64, device=inverse.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return offsets, order


def fused_update(weights: torch.Tensor, slots: torch.Tensor,
                 grads: Union[torch.Tensor, OccurrenceGrads], *, dim: int,
                 config: OptimizerConfig, lr: float, step: int, backend=None,
                 keys: Optional[torch.Tensor] = None, seed: int = 0, table_id: int = 0,
                 stochastic_rounding: bool = True) -> None:
    """Apply one optimizer step to the rows at ``slots``, in place.

    For each ``i`` with ``slots[i] >= 0``, row ``weights[slots[i]]`` (laid out as
    :class:`~dynemb.flat_table.RowLayout` says: the embedding, then the optimizer state)
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
    _check_number(lr, "lr")
    check_int(step, "step")
    _check_inputs(weights, slots, grads, dim, state_dim)
    chosen = backend_for_device(weights.device, backend)
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
        table_id=table_id, stochastic=stochastic_rounding, backend=chosen.name))
    layout.state(rows).copy_(logical[:, dim:])
    weights.index_copy_(0, slots[live], rows[live])


def round_rows(values: torch.Tensor, dtype: torch.dtype, *, keys: torch.Tensor, step: int,
               seed: int = 0, table_id: int = 0, stochastic: bool = True,
               backend=None) -> torch.Tensor:
    """``values`` [N, D] float32 rounded to ``dtype`` (float16 or bfloat16).

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
    chosen = backend_for_device(values.device, backend)
    src = values.to(torch.float32).contiguous()
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    if src.numel():
        chosen.round_rows(src, out, keys.contiguous(), int(seed), int(table_id), int(step),
                          _ROUNDED_FORMATS[dtype], bool(stochastic))
    return out


_ROUNDED_FORMATS = {torch.float16: round_common.FMT_FLOAT16,
                    torch.bfloat16: round_common.FMT_BFLOAT16}


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
    if keys.device != device:
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
        if t.device != weights.device:
            raise ValueError(f"{name} is on {t.device} but weights are on {weights.device}")
    # On the GPU this check would stall the host; slots come from the table there.
    if slots.numel() and weights.device.type == "cpu" and int(slots.max()) >= weights.shape[0]:
        raise ValueError(f"slots must be < {weights.shape[0]} (rows of weights), got "
                         f"{int(slots.max())}")
