"""The attributes torch's ``_apply_optimizer_in_backward`` leaves on a parameter.

``torchrec.optim.apply_optimizer_in_backward`` (and torch's
``torch.distributed.optim._apply_optimizer_in_backward``, which it calls) records on each
parameter it is given the optimizer to train it with, ``_optimizer_classes`` and
``_optimizer_kwargs`` (one entry per call), beside the optimizer objects it built,
``_in_backward_optimizers``. TorchRec's sharders read the first two to pick a table's fused
optimizer; ``in_backward_optimizer_filter`` keeps the parameters that have the third out of
dense optimizers, and TorchRec's sharded modules set it on their weights (an
``EmptyFusedOptimizer``) to say "trained in backward by a fused optimizer".

torch offers no hook for "a parameter was marked": :class:`MarkList` is the list a watched
parameter keeps as its ``_optimizer_kwargs`` (the attribute torch appends to last), and it
calls back when a mark is appended, so that a dynamic module adopts the mark when it is made.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torchrec.optim.fused import EmptyFusedOptimizer

_CLASSES = "_optimizer_classes"
_KWARGS = "_optimizer_kwargs"
_IN_BACKWARD = "_in_backward_optimizers"


class MarkList(list):
    """``_optimizer_kwargs`` of a watched parameter: a list that calls ``on_mark()`` after
    each append (torch's ``_apply_optimizer_in_backward`` appends a mark's kwargs last, once
    its class and optimizer object are recorded). It pickles and copies as a plain list.

    Example::

        >>> seen = []
        >>> marks = MarkList([], lambda: seen.append("marked"))
        >>> marks.append({"lr": 0.1})
        >>> seen, list(marks)
        (['marked'], [{'lr': 0.1}])
    """

    def __init__(self, items, on_mark: Callable[[], None]):
        super().__init__(items)
        self._on_mark = on_mark

    def append(self, item) -> None:
        super().append(item)
        self._on_mark()

    def __reduce__(self):
        return list, (list(self),)


def watched_kwargs(name: str, value: Any, on_mark: Callable[[], None]) -> Any:
    """What a watched parameter stores when ``name`` is set to ``value``: the
    ``_optimizer_kwargs`` list as a :class:`MarkList` calling ``on_mark``, anything else as
    it is."""
    if name == _KWARGS and isinstance(value, list) and not isinstance(value, MarkList):
        return MarkList(value, on_mark)
    return value


def watch_existing_marks(param: torch.Tensor) -> None:
    """Set ``param``'s ``_optimizer_kwargs`` again, if it has them, so that a watched
    parameter (one whose ``__setattr__`` applies :func:`watched_kwargs`) watches them too."""
    if hasattr(param, _KWARGS):
        setattr(param, _KWARGS, list(getattr(param, _KWARGS)))


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


def mark_optimizers(param: torch.Tensor) -> List[torch.optim.Optimizer]:
    """The optimizer objects ``apply_optimizer_in_backward`` built for ``param``'s marks
    (torch's, one per mark; TorchRec's ``EmptyFusedOptimizer`` placeholders left out):
    schedulers may be attached to them."""
    return [opt for opt in in_backward_optimizers(param)
            if not isinstance(opt, EmptyFusedOptimizer) and getattr(opt, "param_groups", None)]


def mark_trained_by_fused_optimizer(param: torch.Tensor) -> None:
    """Say on ``param`` that a fused optimizer trains it in backward, as TorchRec's sharded
    modules do: ``_in_backward_optimizers`` becomes ``[EmptyFusedOptimizer()]`` unless the
    marks' own optimizer objects are there (they stay, for the schedulers attached to them;
    so do the marks; empty lists are made where there are none, so that a later
    ``apply_optimizer_in_backward`` call can still append its own)."""
    if not mark_optimizers(param):
        setattr(param, _IN_BACKWARD, [EmptyFusedOptimizer()])
    for name in (_CLASSES, _KWARGS):
        if not hasattr(param, name):
            setattr(param, name, [])


def add_step_pre_hook(hook: Callable[[torch.optim.Optimizer, tuple, dict], None]):
    """Register ``hook`` to run before the ``step()`` of every optimizer (torch's global
    optimizer hook); returns its removable handle."""
    return register_optimizer_step_pre_hook(hook)
