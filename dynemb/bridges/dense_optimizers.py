"""The torch optimizers that hold given parameters in one of their param groups.

A dense optimizer built over ``model.parameters()`` (``torch.optim.Adam(model.parameters())``,
TorchRec's BERT4Rec example) holds the parameter handles of the model's dynamic tables, and
trains TorchRec's own tables with its class and param group; a dynamic module follows it
(:mod:`dynemb.modules.table_weights`). torch offers no hook at an optimizer's construction,
so the optimizers are found among the live objects (:func:`optimizers_holding`): a walk of
the garbage collector's objects, done before a module's first training step only, and only
for a module that nothing else configured.
"""
from __future__ import annotations

import gc
from typing import Dict, List, NamedTuple, Sequence

import torch


class HeldBy(NamedTuple):
    """One param group holding parameters: the optimizer, the group's index and the group
    itself (the dict schedulers edit)."""
    optimizer: torch.optim.Optimizer
    index: int
    group: dict

    def describe(self) -> str:
        return f"{type(self.optimizer).__name__} (param group {self.index})"


def optimizers_holding(params: Sequence[torch.Tensor]) -> Dict[int, List[HeldBy]]:
    """For each of ``params`` (by position), the param groups of live optimizers that hold
    it. A group shared by several optimizer objects (TorchRec's ``KeyedOptimizerWrapper`` and
    ``CombinedOptimizer`` share their inner optimizer's groups) is listed once, under the
    optimizer whose class is a plain ``torch.optim`` one where there is one.

    Example::

        >>> weight = torch.nn.Parameter(torch.zeros(2))
        >>> adam = torch.optim.Adam([weight], lr=0.1)
        >>> [held.describe() for held in optimizers_holding([weight])[0]]
        ['Adam (param group 0)']
    """
    wanted = {id(p): i for i, p in enumerate(params)}
    found: Dict[int, Dict[int, HeldBy]] = {i: {} for i in range(len(params))}
    # type(obj), not isinstance: isinstance reads __class__, which lazy proxies answer by
    # importing things
    optimizers = [obj for obj in gc.get_objects()
                  if issubclass(type(obj), torch.optim.Optimizer)]
    for optimizer in optimizers:
        for index, group in enumerate(getattr(optimizer, "param_groups", None) or ()):
            for param in group.get("params", ()) if isinstance(group, dict) else ():
                i = wanted.get(id(param))
                if i is None or param is not params[i]:
                    continue
                held = found[i].get(id(group))
                if held is None or not _plain(held.optimizer) and _plain(optimizer):
                    found[i][id(group)] = HeldBy(optimizer, index, group)
    return {i: list(groups.values()) for i, groups in found.items()}


def _plain(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer).__module__.startswith("torch.optim")
