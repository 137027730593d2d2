"""``FollowedLearningRate``: the one learning rate of a module's fused update, and the param
groups that may set it.

A dynamic module's tables train with one learning rate, ``fused_optimizer.param_groups[0]
["lr"]``. Where the tables' optimizer came from a torch optimizer object, its param group
sets that rate as well, as it sets the rate of TorchRec's tables: the optimizer objects
``apply_optimizer_in_backward`` built for the marks (a scheduler may be attached to
``param._in_backward_optimizers[0]``), or the param group of a dense optimizer holding the
tables' parameters (``torch.optim.Adam(model.parameters())`` with its scheduler). At each
step the rate is the value of whichever of them changed since the last step (a scheduler
on ``fused_optimizer`` works as before); it is written back into the fused optimizer and the
marks' optimizers (theirs alone: a dense optimizer's group also sets its dense parameters'
rate), so each of them reads what the tables train with. Two that changed to different
values in one step raise ``ValueError`` naming them (one module trains with one rate).
"""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple


class FollowedGroup(NamedTuple):
    """A param group whose ``"lr"`` sets the tables' rate: ``name`` for messages,
    ``writable`` when the tables' rate is written back into it."""
    name: str
    group: dict
    writable: bool


class FollowedLearningRate:
    """The param groups besides the fused optimizer's (``own``) that set a module's
    learning rate (see the module docstring).

    Example::

        >>> own = {"lr": 0.01}             # fused_optimizer.param_groups[0]
        >>> mark = {"lr": 0.1}
        >>> rate = FollowedLearningRate()
        >>> rate.follow(own, [FollowedGroup("the mark's Adagrad", mark, True)])
        >>> own["lr"]                      # the mark's rate, from now on
        0.1
        >>> mark["lr"] = 0.05              # a scheduler on the mark's optimizer
        >>> rate.current(own), own["lr"]
        (0.05, 0.05)
        >>> own["lr"] = 0.02               # set by hand on the fused optimizer
        >>> rate.current(own), mark["lr"]
        (0.02, 0.02)
    """

    def __init__(self):
        self._followed: List[FollowedGroup] = []
        self._seen: Dict[int, Any] = {}

    def __getstate__(self) -> Dict[str, Any]:
        # the followed groups belong to optimizer objects outside the module: a copy of
        # the module follows its own fused optimizer only
        return {"_followed": [], "_seen": {}}

    @property
    def followed(self) -> List[str]:
        """The names of the groups followed besides the fused optimizer's."""
        return [f.name for f in self._followed]

    def follow(self, own: dict, groups: List[FollowedGroup]) -> None:
        """Follow ``groups`` from now on; ``own`` (and every writable group) takes the
        first one's rate."""
        self._followed = list(groups)
        if groups:
            lr = groups[0].group["lr"]
            for group in [own, *(f.group for f in groups[1:] if f.writable)]:
                group["lr"] = lr
        self._remember(own)

    def current(self, own: dict) -> Any:
        """The rate of the next update, written into ``own`` (see the module docstring);
        unchecked."""
        if not self._followed:
            return own["lr"]
        everyone = [FollowedGroup("fused_optimizer", own, True), *self._followed]
        changed = [f for f in everyone
                   if _differs(f.group.get("lr"), self._seen.get(id(f.group)))]
        if not changed:
            return own["lr"]
        values = [f.group.get("lr") for f in changed]
        if any(_differs(v, values[0]) for v in values[1:]):
            raise ValueError(
                "the tables train with one learning rate, but since the last step "
                + " and ".join(f"{f.name} changed it to {f.group.get('lr')!r}"
                               for f in changed)
                + "; drive it from one of them")
        for followed in everyone:
            if followed.writable:
                followed.group["lr"] = values[0]
        self._remember(own)
        return values[0]

    def _remember(self, own: dict) -> None:
        self._seen = {id(group): group.get("lr")
                      for group in [own, *(f.group for f in self._followed)]}


def _differs(a: Any, b: Any) -> bool:
    if a is b:
        return False
    try:
        return bool(a != b)
    except (TypeError, RuntimeError):
        return True
