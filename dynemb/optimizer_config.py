"""``OptimizerConfig``: which fused optimizer a dynamic table trains with, and its
hyper-parameters, checked when built (see :mod:`dynemb.rows.optimizers` for the update rules)."""
from __future__ import annotations

import enum
import math
import numbers
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from dynemb.foundations.validation import check_int

if TYPE_CHECKING:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType


class OptimizerType(enum.Enum):
    SGD = "sgd"
    ADAM = "adam"
    ADAGRAD = "adagrad"
    ROWWISE_ADAGRAD = "rowwise_adagrad"


#: The float fields of OptimizerConfig (``max_gradient`` may also be None).
_HYPERPARAMETERS = ("learning_rate", "eps", "beta1", "beta2", "weight_decay",
                    "initial_accumulator_value")
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
        for name in _HYPERPARAMETERS:  # stored as plain floats
            object.__setattr__(self, name, check_number(getattr(self, name), name))
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
            object.__setattr__(self, "max_gradient",
                               check_number(self.max_gradient, "max_gradient"))
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
        when clipping is on), and dynemb's ``initial_accumulator_value`` (AdaGrad's, which
        fbgemm lacks: a mark of ``torch.optim.Adagrad`` may carry it); other keys (placement, caching, precision) are ignored, except
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
        kwargs = {key: check_number(params.pop(key), f"fused_params[{key!r}]")
                  for key in ("learning_rate", "eps", "beta1", "beta2", "weight_decay",
                              "initial_accumulator_value")
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
            kwargs["max_gradient"] = check_number(params.get("max_gradient", 1.0),
                                                  "fused_params['max_gradient']")
        for key, off in _UNSUPPORTED_OFF.items():
            if params.get(key, off) not in (off, None):
                raise ValueError(f"fused_params[{key!r}] is not supported, got {params[key]!r}")
        extra = params.get("extra_optimizer_config")
        if getattr(extra, "use_rowwise_bias_correction", False):
            raise ValueError("fused_params['extra_optimizer_config'].use_rowwise_bias_correction "
                             "is not supported")
        return cls(kind, **kwargs)


class DefaultOptimizerNotice:
    """Says once, at a module's first training use, that no optimizer was configured.

    A dynamic module built without ``optimizer=`` may still get one from its sharder's
    ``fused_params`` when DistributedModelParallel shards it, so construction says nothing;
    the module calls :meth:`at_training` on each training forward, and the first one warns
    (``UserWarning``) naming the default it trains with. ``torchrec.optim.
    apply_optimizer_in_backward`` on the module's table parameters configures it too, as does
    a torch optimizer built over them (see :mod:`dynemb.modules.table_weights`); the warning
    names these places.

    Example::

        >>> notice = DefaultOptimizerNotice("DynamicEmbCollection", given=False)
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     notice.at_training(OptimizerConfig())
        ...     notice.at_training(OptimizerConfig())
        >>> len(seen), "learning_rate=0.01" in str(seen[0].message)
        (1, True)
    """

    def __init__(self, owner: str, given: bool) -> None:
        self.owner = owner
        self.given = bool(given)
        self._said = self.given

    def configured(self) -> None:
        """The optimizer was configured after construction (by a mark of
        ``apply_optimizer_in_backward``): no warning will come."""
        self.given = self._said = True

    def at_training(self, config: OptimizerConfig) -> None:
        """Warn if no optimizer was configured and this is the first call."""
        if self._said:
            return
        self._said = True
        warnings.warn(default_optimizer_message(self.owner, config), UserWarning, stacklevel=3)


def default_optimizer_message(owner: str, config: OptimizerConfig) -> str:
    """The text of :class:`DefaultOptimizerNotice`'s warning."""
    return (f"{owner} trains with the default optimizer {config} (fbgemm's EXACT_SGD "
            f"defaults): no optimizer was configured. Pass optimizer=OptimizerConfig(...) "
            f"to the module, fused_params={{'optimizer': EmbOptimType..., "
            f"'learning_rate': ...}} to its sharder, or mark the tables' parameters with "
            f"torchrec.optim.apply_optimizer_in_backward(RowWiseAdagrad, "
            f"module.parameters(), {{'lr': ...}}) or build a torch.optim SGD / Adagrad / "
            f"Adam / AdamW over them (model.parameters()) before the first training step")


def check_number(value, name: str) -> float:
    """``value`` as a float if it is a finite real number; a bool, a string, a tensor or
    anything else raises ``TypeError``, NaN and infinities (and ints too large for a float)
    ``ValueError``, naming ``name``.

    Example::

        >>> check_number(2, "eps")
        2.0
        >>> check_number("0.1", "learning_rate")
        Traceback (most recent call last):
        ...
        TypeError: learning_rate must be a number, got '0.1'
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {value}")
    return number


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
