"""``DynamicEmbFusedOptimizer``: the TorchRec-style optimizer object of a dynamic collection.

Its one param group holds the learning rate the next backward uses, and whatever an LR
scheduler adds to it (``initial_lr``, ...). TorchRec's ``KeyedOptimizer.state_dict`` saves
only ``state`` (per parameter key) unless ``save_param_groups(True)``, so the group's
hyper-parameters are saved as the ``state`` of one parameter key, :data:`PARAM_KEY`::

    {"state": {"dynamic_tables": {"param_group": {"lr": 0.05, "initial_lr": 0.1}}}}

Inside a ``CombinedOptimizer`` (DMP's ``fused_optimizer`` holds one per sharded module) the
key takes the module's prefix, ``"sparse.ec.dynamic_tables"``; ``torch.distributed.checkpoint``
flattens the dict like any other (the values are small Python objects it saves as bytes).
Loading it puts the saved hyper-parameters back into the param group (before TorchRec checks
the saved ``param_groups``, so a group to which a scheduler added ``initial_lr`` after or
before the save loads either way).
"""
from __future__ import annotations

import math
import numbers
from copy import deepcopy
from typing import Any, Dict, Mapping

import torch
from torchrec.optim.fused import FusedOptimizer

#: The parameter key under which the learning rate (the param group) is saved.
PARAM_KEY = "dynamic_tables"
#: The entry of that key's state holding the param group's hyper-parameters.
GROUP_STATE_KEY = "param_group"


def checked_lr(value: Any, name: str = "lr") -> float:
    """``value`` as a float if it is a usable learning rate: a real number (or a one-element
    tensor), not a bool or a string, finite and >= 0.

    Example::

        >>> checked_lr(0.5)
        0.5
        >>> checked_lr("0.1")
        Traceback (most recent call last):
        ...
        TypeError: lr must be a number, got '0.1'
    """
    is_scalar_tensor = isinstance(value, torch.Tensor) and value.numel() == 1
    if isinstance(value, bool) or not (isinstance(value, numbers.Real) or is_scalar_tensor):
        raise TypeError(f"{name} must be a number, got {value!r}")
    lr = float(value)
    if not math.isfinite(lr) or lr < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return lr


class _ParamGroupState:
    """The hyper-parameters of an optimizer's first param group, as a stateful object:
    ``KeyedOptimizer.state_dict`` saves what ``state_dict`` returns, ``load_state_dict``
    gets it back (TorchRec's stateful-object convention for optimizer state)."""

    def __init__(self, optimizer: "DynamicEmbFusedOptimizer"):
        self._optimizer = optimizer

    @property
    def _group(self) -> Dict[str, Any]:
        return self._optimizer.param_groups[0]

    def state_dict(self) -> Dict[str, Any]:
        return {k: deepcopy(v) for k, v in self._group.items() if k != "params"}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """The group's hyper-parameters become the saved ones (as ``torch.optim.Optimizer``
        replaces its groups); the current lr stays if none was saved. A saved lr that is not
        a finite number >= 0 raises with the group unchanged."""
        if not isinstance(saved, Mapping):
            raise TypeError(f"the saved {GROUP_STATE_KEY!r} must be a dict of "
                            f"hyper-parameters, got {type(saved).__name__}")
        if "lr" in saved:
            checked_lr(saved["lr"], f"the saved {GROUP_STATE_KEY}['lr']")
        group = self._group
        kept = {"params": group["params"], "lr": group["lr"]}
        group.clear()  # the same dict: schedulers hold it
        group.update(kept)
        group.update({k: deepcopy(v) for k, v in saved.items() if k != "params"})


class DynamicEmbFusedOptimizer(FusedOptimizer):
    """The optimizer object of a :class:`~dynemb.DynamicEmbCollection`, TorchRec style: updates happen
    in backward, so ``step`` and ``zero_grad`` do nothing; ``param_groups[0]["lr"]`` is the
    learning rate used by the next backward (LR schedulers work on it).

    ``state_dict()`` holds the param group's hyper-parameters (the lr and what schedulers
    add, such as ``initial_lr``) under the parameter key :data:`PARAM_KEY`, so saving the
    optimizer (alone, in a ``CombinedOptimizer``, or with ``torch.distributed.checkpoint``)
    saves the learning rate and loading it restores it; a state dict without it is refused,
    naming the key. Rows and their optimizer state are the module's ``state_dict``'s.

    Example::

        >>> ec = DynamicEmbCollection(tables=[EmbeddingConfig(
        ...     name="t", embedding_dim=8, num_embeddings=1024, feature_names=["f"])])
        >>> ec.fused_optimizer.param_groups[0]["lr"] = 0.01
        >>> ec.fused_optimizer.lr
        0.01
        >>> saved = ec.fused_optimizer.state_dict()
        >>> saved
        {'state': {'dynamic_tables': {'param_group': {'lr': 0.01}}}}
        >>> ec.fused_optimizer.param_groups[0]["lr"] = 0.5
        >>> ec.fused_optimizer.load_state_dict(saved)
        >>> ec.fused_optimizer.lr
        0.01
    """

    def __init__(self, lr: float):
        checked_lr(lr)
        # a placeholder parameter: KeyedOptimizer keys state and groups by parameter
        anchor = torch.empty(0)
        group = {"params": [anchor], "lr": lr}
        state = {anchor: {GROUP_STATE_KEY: _ParamGroupState(self)}}
        super().__init__({PARAM_KEY: anchor}, state, [group])

    @property
    def lr(self) -> float:
        """The learning rate of the next backward; raises if ``param_groups[0]["lr"]`` is not
        a finite number >= 0."""
        return checked_lr(self.param_groups[0]["lr"], "fused_optimizer.param_groups[0]['lr']")

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """``KeyedOptimizer.load_state_dict``; a state dict without the param group's state
        under :data:`PARAM_KEY` (not one a :class:`DynamicEmbFusedOptimizer` saved) raises
        ``ValueError`` naming it, the group unchanged."""
        state = state_dict.get("state") if isinstance(state_dict, Mapping) else None
        if not isinstance(state, Mapping) or PARAM_KEY not in state:
            raise ValueError(
                f"the optimizer state dict has no state[{PARAM_KEY!r}] (the param group: lr "
                f"and what schedulers add): not one a DynamicEmbFusedOptimizer saved")
        super().load_state_dict(state_dict)

    def step(self, closure: Any = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = False) -> None:
        return None
