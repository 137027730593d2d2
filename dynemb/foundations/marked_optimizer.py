"""The fused optimizer an optimizer class and its kwargs stand for, as
``apply_optimizer_in_backward(optimizer_class, params, optimizer_kwargs)`` names them.

TorchRec users pick the tables' optimizer by marking the tables' parameters:
``apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": 0.02})``.
:func:`fused_params_of_mark` turns such a mark into fbgemm-style ``fused_params`` (what
TorchRec's sharders make of it, and what
:meth:`~dynemb.optimizer_config.OptimizerConfig.from_fbgemm` reads), so that the tables train
as that optimizer trains the rows of each batch:

- ``torch.optim.SGD`` -> SGD; ``torch.optim.Adagrad`` -> ADAGRAD;
  ``torchrec.optim.RowWiseAdagrad`` -> ROWWISE_ADAGRAD (its ``weight_decay`` is L2, added to
  the gradient); ``torch.optim.Adam`` -> ADAM; ``torch.optim.AdamW`` (or ``Adam`` with
  ``decoupled_weight_decay=True``) -> ADAM with its decoupled weight decay. Hyper-parameters
  left out take the class's own defaults (``RowWiseAdagrad``'s ``eps`` is 1e-10), so a marked
  table trains the same sharded or not.
- TorchRec's placeholders ``torchrec.optim.SGD`` / ``Adagrad`` / ``Adam``, which never run and
  only carry fbgemm's options, pass their kwargs on as fused params (fbgemm's defaults).

A dense optimizer that holds a table's handle (``torch.optim.Adam(model.parameters())``)
configures it the same way from its class and the param group holding the handle
(:func:`fused_params_of_group`).

What the fused optimizer cannot do raises ``ValueError`` naming it: another class (LAMB,
LARS, Shampoo...), SGD momentum or weight decay, AdaGrad's ``lr_decay`` or weight decay,
Adam's L2 ``weight_decay`` or AMSGrad, ``maximize``. Options that only say how a dense
optimizer runs (``foreach``, ``fused``, ``capturable``, ``differentiable``) are ignored.
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, Mapping, NamedTuple, Tuple

import torch
import torchrec.optim as torchrec_optim

#: fbgemm's WeightDecayMode.L2 (see OptimizerConfig.from_fbgemm)
_WD_L2 = 1
#: kwargs that only say how a dense optimizer computes, not what
_HOW_NOT_WHAT = frozenset({"foreach", "fused", "capturable", "differentiable"})
#: kwargs without effect once what they modify is refused (SGD's dampening damps momentum)
_INERT = frozenset({"dampening"})
#: fbgemm options a mark may add to a torch optimizer's kwargs (as TorchRec passes them on)
_FBGEMM_EXTRAS = frozenset({"gradient_clipping", "max_gradient"})


class FbgemmOptimizerName:
    """An fbgemm ``EmbOptimType`` by name, which is all ``OptimizerConfig.from_fbgemm`` reads
    (dynemb does not need fbgemm installed)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"EmbOptimType.{self.name}"

    def __eq__(self, other) -> bool:
        return getattr(other, "name", None) == self.name

    def __hash__(self) -> int:
        return hash(self.name)


class _Rule(NamedTuple):
    """How one optimizer class maps: the fbgemm optimizer, its kwargs renamed to fused
    params, and the kwargs that must keep the value that means "off"."""
    fbgemm: str
    renamed: Mapping[str, str]
    off: Mapping[str, Any]


_SGD = _Rule("EXACT_SGD", {"lr": "learning_rate"},
             {"momentum": 0, "weight_decay": 0, "nesterov": False, "maximize": False})
_ADAGRAD = _Rule("EXACT_ADAGRAD", {"lr": "learning_rate", "eps": "eps",
                                   "initial_accumulator_value": "initial_accumulator_value"},
                 {"lr_decay": 0, "weight_decay": 0, "maximize": False})
_ROWWISE_ADAGRAD = _Rule("EXACT_ROWWISE_ADAGRAD",
                         {"lr": "learning_rate", "eps": "eps", "weight_decay": "weight_decay",
                          "initial_accumulator_value": "initial_accumulator_value"},
                         {"lr_decay": 0, "maximize": False})
_ADAM = _Rule("ADAM", {"lr": "learning_rate", "eps": "eps"},
              {"weight_decay": 0, "amsgrad": False, "maximize": False})
_ADAMW = _Rule("ADAM", {"lr": "learning_rate", "eps": "eps", "weight_decay": "weight_decay"},
               {"amsgrad": False, "maximize": False})

#: the classes that really run as dense optimizers: their semantics and defaults
_RULES: Dict[type, _Rule] = {
    torch.optim.SGD: _SGD,
    torch.optim.Adagrad: _ADAGRAD,
    torchrec_optim.RowWiseAdagrad: _ROWWISE_ADAGRAD,
    torch.optim.Adam: _ADAM,
    torch.optim.AdamW: _ADAMW,
}
#: TorchRec's placeholders: fbgemm options, fbgemm defaults
_PLACEHOLDERS: Dict[type, str] = {
    torchrec_optim.SGD: "EXACT_SGD",
    torchrec_optim.Adagrad: "EXACT_ADAGRAD",
    torchrec_optim.Adam: "ADAM",
}


def supported_classes() -> Tuple[str, ...]:
    return tuple(f"{c.__module__.split('.')[0]}.optim.{c.__name__}"
                 for c in (*_RULES, *_PLACEHOLDERS))


def fused_params_of_mark(optimizer_class: type, kwargs: Mapping[str, Any]) -> Dict[str, Any]:
    """fbgemm-style ``fused_params`` that train a table as ``optimizer_class(**kwargs)`` trains
    the rows of each batch (see the module docstring); what it cannot map raises
    ``ValueError``.

    Example::

        >>> from torchrec.optim import RowWiseAdagrad
        >>> params = fused_params_of_mark(RowWiseAdagrad, {"lr": 0.02})
        >>> params["optimizer"], params["learning_rate"], params["eps"]
        (EmbOptimType.EXACT_ROWWISE_ADAGRAD, 0.02, 1e-10)
        >>> fused_params_of_mark(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
        Traceback (most recent call last):
        ...
        ValueError: torch.optim.SGD with momentum=0.9 cannot train dynamic tables: ...
    """
    name = f"{optimizer_class.__module__.split('.')[0]}.optim." \
           f"{getattr(optimizer_class, '__name__', optimizer_class)}"
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"the kwargs of {name} must be a dict, got {kwargs!r}")
    if optimizer_class in _PLACEHOLDERS:
        params = dict(kwargs)
        if "lr" in params:  # as TorchRec's merge_fused_params renames it
            params["learning_rate"] = params.pop("lr")
        params["optimizer"] = FbgemmOptimizerName(_PLACEHOLDERS[optimizer_class])
        return params
    rule = _RULES.get(optimizer_class)
    if rule is None:
        raise ValueError(f"{name} cannot train dynamic tables: their fused optimizer has "
                         f"no such update rule. Supported: {', '.join(supported_classes())}")
    given = dict(kwargs)
    if optimizer_class is torch.optim.Adam and given.get("decoupled_weight_decay"):
        rule = _ADAMW  # Adam(decoupled_weight_decay=True) is AdamW
    given.pop("decoupled_weight_decay", None)
    settings = {**_defaults(optimizer_class), **given}
    for key, off in rule.off.items():
        if key in settings and settings[key] != off:
            raise ValueError(_refusal(name, key, settings[key]))
    params: Dict[str, Any] = {"optimizer": FbgemmOptimizerName(rule.fbgemm)}
    params.update({fused: settings[key] for key, fused in rule.renamed.items()
                   if key in settings})
    if "betas" in settings and rule.fbgemm == "ADAM":
        params["beta1"], params["beta2"] = _betas(name, settings["betas"])
    if rule is _ROWWISE_ADAGRAD:
        params["weight_decay_mode"] = _WD_L2
    known = {*rule.renamed, *rule.off, "betas", *_HOW_NOT_WHAT,
             *(_INERT if rule is _SGD else ())}
    for key in given:
        if key in _FBGEMM_EXTRAS:
            params[key] = given[key]
        elif key not in known:
            raise ValueError(f"{name}: {key}={given[key]!r} is not an option dynemb's fused "
                             f"optimizer can follow (known: {', '.join(sorted(known))}, "
                             f"{', '.join(sorted(_FBGEMM_EXTRAS))})")
    return params


def fused_params_of_group(optimizer: torch.optim.Optimizer, group: Mapping[str, Any]
                          ) -> Dict[str, Any]:
    """fbgemm-style ``fused_params`` that train a table as ``optimizer`` trains the rows of
    each batch in its param group ``group``: :func:`fused_params_of_mark` of the optimizer's
    class and the group's values of the optimizer's own options (what schedulers add to a
    group, such as ``initial_lr``, is left out).

    Example::

        >>> weight = torch.nn.Parameter(torch.zeros(2))
        >>> adagrad = torch.optim.Adagrad([weight], lr=0.2, initial_accumulator_value=0.1)
        >>> params = fused_params_of_group(adagrad, adagrad.param_groups[0])
        >>> params["optimizer"], params["learning_rate"], params["initial_accumulator_value"]
        (EmbOptimType.EXACT_ADAGRAD, 0.2, 0.1)
    """
    defaults = getattr(optimizer, "defaults", None) or {}
    kwargs = {key: group[key] for key in defaults if key in group}
    return fused_params_of_mark(type(optimizer), kwargs)


def _defaults(optimizer_class: type) -> Dict[str, Any]:
    """The keyword defaults of ``optimizer_class.__init__``."""
    return {key: p.default for key, p in inspect.signature(optimizer_class.__init__)
            .parameters.items() if p.default is not inspect.Parameter.empty}


def _betas(name: str, betas) -> Tuple[Any, Any]:
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"{name}: betas must be a pair (beta1, beta2), got {betas!r}") from None
    return beta1, beta2


_WHY = {
    "momentum": "the fused SGD has no momentum",
    "nesterov": "the fused SGD has no momentum",
    "weight_decay": "its weight decay is not one the fused optimizer applies (SGD and AdaGrad "
                    "have none; Adam's is L2 on the gradient: use torch.optim.AdamW for "
                    "decoupled weight decay)",
    "lr_decay": "the fused AdaGrad has no learning rate decay (use an LR scheduler on the "
                "module's fused_optimizer)",
    "amsgrad": "the fused Adam has no AMSGrad",
    "maximize": "the fused optimizers minimize",
}


def _refusal(name: str, key: str, value: Any) -> str:
    return f"{name} with {key}={value!r} cannot train dynamic tables: {_WHY[key]}"
