"""The attributes torch's ``_apply_optimizer_in_backward`` leaves on a parameter.

``torchrec.optim.apply_optimizer_in_backward`` (and torch's
``torch.distributed.optim._apply_optimizer_in_backward``, which it calls) records on each
parameter it is given the optimizer to train it with, ``_optimizer_classes`` and
``_optimizer_kwargs`` (one entry per call), beside the optimizer objects it built,
``_in_backward_optimizers``. TorchRec's sharders read the first two to pick a table's fused
optimizer; ``in_backward_optimizer_filter`` keeps the parameters that have the third out of
dense optimizers, and TorchRec's sharded modules set it on their weights (an
``EmptyFusedOptimizer``) to say "trained in backward by a fused optimizer".
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torchrec.optim.fused import EmptyFusedOptimizer

_CLASSES = "_optimizer_classes"
_KWARGS = "_optimizer_kwargs"
_IN_BACKWARD = "_in_backward_optimizers"


def marks_of(param: torch.Tensor) -> List[Tuple[type, Dict[str, Any]]]:
    """``(optimizer class, kwargs)`` of each ``apply_optimizer_in_backward`` call that marked
    ``param``, oldest first (kwargs copied: TorchRec's sharders edit the stored dict)."""
    classes = getattr(param, _CLASSES, None) or []
    kwargs = getattr(param, _KWARGS, None) or []
    return [(cls, dict(kw)) for cls, kw in zip(classes, kwargs)]


def mark_count(param: torch.Tensor) -> int:
    """How many optimizers were marked on ``param`` (cheap: for noticing a new mark)."""
    return len(getattr(param, _CLASSES, None) or ())


def is_trained_in_backward(param: torch.Tensor) -> bool:
    """Whether ``param`` says it is trained in backward (what ``in_backward_optimizer_filter``
    reads)."""
    return hasattr(param, _IN_BACKWARD)


def in_backward_optimizers(param: torch.Tensor) -> List[torch.optim.Optimizer]:
    return list(getattr(param, _IN_BACKWARD, None) or [])


def mark_trained_by_fused_optimizer(param: torch.Tensor) -> None:
    """Say on ``param`` that a fused optimizer trains it in backward, as TorchRec's sharded
    modules do: ``_in_backward_optimizers`` becomes ``[EmptyFusedOptimizer()]`` (the marks,
    if any, stay; empty lists are made where there are none, so that a later
    ``apply_optimizer_in_backward`` call can still append its own)."""
    setattr(param, _IN_BACKWARD, [EmptyFusedOptimizer()])
    for name in (_CLASSES, _KWARGS):
        if not hasattr(param, name):
            setattr(param, name, [])


def add_step_pre_hook(hook: Callable[[torch.optim.Optimizer, tuple, dict], None]):
    """Register ``hook`` to run before the ``step()`` of every optimizer (torch's global
    optimizer hook); returns its removable handle."""
    return register_optimizer_step_pre_hook(hook)
