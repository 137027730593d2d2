"""``TableWeights``: one parameter handle per dynamic table, for TorchRec's way of choosing
the tables' optimizer.

A dynamic table is a hash table, not a tensor, so a dynamic module holds no weight for
``apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {...})`` to
mark. Each module therefore carries, as its child ``table_weights``, one
:class:`TableWeight` per table: an ``nn.Parameter`` of TorchRec's shape
``[num_embeddings, embedding_dim]`` and the table's dtype, on the meta device (no memory, and
the dense optimizer objects ``apply_optimizer_in_backward`` builds on it hold no memory
either). The handles never get a gradient: what the mark says is read by the module
(:meth:`TableWeights.marked_fused_params`) and the fused optimizer trains the rows in
backward. They are not module state (``state_dict`` holds the rows, under
``dynamic_tables``) and ``.to()`` leaves them where they are.

A mark is adopted when it is made: the handles watch their ``_optimizer_kwargs``
(:class:`~dynemb.bridges.optimizer_marks.MarkList`) and, once every handle of the module
carries its mark, call :attr:`TableWeights.on_mark` (the module adopts the optimizer then, so
what follows the marks, an LR scheduler on ``fused_optimizer``, a learning rate set by hand,
a checkpoint load, sees it). The marks' own optimizer objects stay on the handles, and a
scheduler on one of them sets the tables' learning rate
(:mod:`dynemb.modules.learning_rates`).

A dense optimizer that holds the handles (``torch.optim.Adam(model.parameters())``, as
TorchRec's BERT4Rec example trains TorchRec's tables) configures the tables of a module that
nothing else configured, from its class and the param group holding them
(:meth:`TableWeights.dense_optimizer`), and its group's learning rate is followed at every
step. Once a handle's table has its optimizer (a mark, the module's ``optimizer=``, a
sharder's ``fused_params``, a dense optimizer), the handle is marked as trained in backward,
as TorchRec marks its sharded weights, so ``in_backward_optimizer_filter`` leaves it out and
a dense optimizer that holds it finds no gradient on it (as TorchRec's weights after their
optimizer in backward ran). A dense optimizer that holds a handle of a table already trained
with the default optimizer (it was built after the module's first training step) makes its
``step()`` raise ``ValueError`` (:func:`refuse_untrained_tables`).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, data_type_to_dtype

from dynemb.bridges.dense_optimizers import HeldBy, optimizers_holding
from dynemb.bridges.optimizer_marks import (add_step_pre_hook, in_backward_optimizers,
                                            is_trained_in_backward, mark_count,
                                            mark_optimizers, mark_trained_by_fused_optimizer,
                                            marks_of, watch_existing_marks,
                                            watched_kwargs)
from dynemb.foundations.marked_optimizer import fused_params_of_group, fused_params_of_mark
from dynemb.modules.learning_rates import FollowedGroup


class TableWeight(torch.nn.Parameter):
    """The parameter handle of one dynamic table (see the module docstring); ``table`` names
    it in messages."""

    table: str = "?"
    #: called when a mark is appended (see the module docstring)
    on_mark: Optional[Callable[[], None]] = None
    #: its table trained with the default optimizer (nothing configured one in time)
    trains_with_default: bool = False

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, watched_kwargs(name, value, self._marked))

    def _marked(self) -> None:
        if self.on_mark is not None:
            self.on_mark()


class TableWeights(torch.nn.Module):
    """One :class:`TableWeight` per table, by table name (see the module docstring).

    Example::

        >>> from torchrec.optim import RowWiseAdagrad
        >>> from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
        >>> ec = DynamicEmbCollection([EmbeddingConfig(
        ...     name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"])])
        >>> [(name, tuple(p.shape)) for name, p in ec.named_parameters()]
        [('table_weights.t', (64, 4))]
        >>> apply_optimizer_in_backward(RowWiseAdagrad, ec.parameters(), {"lr": 0.1})
        >>> ec.table_weights.marked_fused_params()["learning_rate"]
        0.1
    """

    def __init__(self, configs: List[BaseEmbeddingConfig], owner: str):
        super().__init__()
        self.owner = owner
        self.trained_in_backward = False
        self.trains_with_default = False
        #: called once every handle carries a new mark (the module adopts it)
        self.on_mark: Optional[Callable[[], None]] = None
        for config in configs:
            self.register_parameter(config.name, self._watched(_handle(
                config.name, (config.num_embeddings, config.embedding_dim),
                data_type_to_dtype(config.data_type))))
        install_dense_optimizer_guard()

    def __setstate__(self, state: Dict[str, Any]) -> None:
        """Unpickled or deep-copied, the handles come back as plain meta parameters without
        their marks: they become handles again, marked as trained in backward if they were."""
        super().__setstate__(state)
        for name, param in list(self.named_parameters(recurse=False)):
            if not isinstance(param, TableWeight):
                param = _handle(name, tuple(param.shape), param.dtype)
                self.register_parameter(name, param)
            param.table = name
            self._watched(param)
        if self.trained_in_backward:
            self.mark_trained_in_backward()
        if self.trains_with_default:
            self.mark_trains_with_default()

    def _watched(self, handle: TableWeight) -> TableWeight:
        handle.on_mark = self._handle_marked
        watch_existing_marks(handle)
        return handle

    def _handle_marked(self) -> None:
        """A handle got a mark: the module is told once every handle carries one (torch
        marks them one by one; until the last, the marks are incomplete)."""
        on_mark = getattr(self, "on_mark", None)
        if on_mark is not None and all(self.marks_signature()):
            on_mark()
        install_dense_optimizer_guard()  # e.g. unpickled in a new process

    # -- what nn.Module would do to parameters -----------------------------------------------
    def _apply(self, fn, recurse=True):
        return self  # handles of hash tables: they stay on meta whatever .to() asks

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        pass  # the module saves the rows themselves (dynamic_tables.*)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        pass

    # -- marks -------------------------------------------------------------------------------
    def marks_signature(self) -> Tuple[int, ...]:
        """How many marks each handle carries: changes when ``apply_optimizer_in_backward``
        marks one (read at every training step, so it is cheap)."""
        return tuple(mark_count(p) for p in self.parameters(recurse=False))

    def marked_fused_params(self) -> Optional[Dict[str, Any]]:
        """The fused params (:func:`~dynemb.foundations.marked_optimizer.fused_params_of_mark`)
        the marks
        of the handles configure, None if no handle is marked. The module's tables share one
        optimizer, so every handle must carry the same one mark: two marks on a handle (as
        TorchRec's sharders refuse), marks that differ, or some tables marked and others
        not raise ``ValueError``."""
        marks = {name: marks_of(p) for name, p in self.named_parameters(recurse=False)}
        marked = {name: m for name, m in marks.items() if m}
        if not marked:
            return None
        where = f"{self.owner}"
        twice = [name for name, m in marked.items() if len(m) > 1]
        if twice:
            raise ValueError(f"{where}: table {twice[0]!r} was given {len(marked[twice[0]])} "
                             f"optimizers by apply_optimizer_in_backward; a table trains "
                             f"with one")
        unmarked = [name for name in marks if name not in marked]
        if unmarked:
            raise ValueError(f"{where}: tables {sorted(marked)} were given an optimizer by "
                             f"apply_optimizer_in_backward but tables {unmarked} were not; "
                             f"the tables of one dynamic module train with one fused "
                             f"optimizer: mark every table's parameter (module.parameters()) "
                             f"with the same one, or use two modules")
        (first, (mark,)), *others = marked.items()
        for name, (other,) in others:
            if other[0] is not mark[0] or other[1] != mark[1]:
                raise ValueError(f"{where}: tables {first!r} and {name!r} were given different "
                                 f"optimizers ({_named(mark)} and {_named(other)}); the "
                                 f"tables of one dynamic module train with one fused "
                                 f"optimizer: use two modules for two optimizers")
        return fused_params_of_mark(*mark)

    def mark_groups(self) -> List[FollowedGroup]:
        """The param groups of the marks' own optimizer objects, whose learning rate the
        tables follow (see :mod:`dynemb.modules.learning_rates`)."""
        return [FollowedGroup(f"the optimizer of table {name!r}'s mark "
                              f"({type(opt).__name__})", group, True)
                for name, param in self.named_parameters(recurse=False)
                for opt in mark_optimizers(param) for group in opt.param_groups[:1]]

    def dense_optimizer(self) -> Optional[Tuple[Dict[str, Any], List[FollowedGroup]]]:
        """``(fused params, [its param group])`` of the dense optimizer that holds the handles
        (see the module docstring), None if none holds any. Every handle must be held, by
        one param group of one optimizer (the tables of one module train with one optimizer):
        anything else, or an option the fused optimizer cannot follow, raises
        ``ValueError`` naming the optimizer and the tables."""
        names = [name for name, _ in self.named_parameters(recurse=False)]
        handles = [param for _, param in self.named_parameters(recurse=False)]
        own = {id(opt) for param in handles for opt in in_backward_optimizers(param)}
        held = {names[i]: [h for h in found if id(h.optimizer) not in own]
                for i, found in optimizers_holding(handles).items()}
        holders: Dict[int, HeldBy] = {id(h.group): h for hs in held.values() for h in hs}
        if not holders:
            return None
        where = self.owner
        twice = [name for name, hs in held.items() if len(hs) > 1]
        if twice:
            raise ValueError(f"{where}: the parameter of dynamic table {twice[0]!r} is held by "
                             f"{' and '.join(h.describe() for h in held[twice[0]])}; its "
                             f"fused optimizer follows one (nothing was changed)")
        if len(holders) > 1:
            raise ValueError(f"{where}: the tables' parameters are held by "
                             f"{' and '.join(h.describe() for h in holders.values())}; the "
                             f"tables of one dynamic module train with one optimizer: hold "
                             f"them in one param group, or use two modules (nothing was "
                             f"changed)")
        (holder,) = holders.values()
        free = [name for name, hs in held.items() if not hs]
        if free:
            raise ValueError(f"{where}: {holder.describe()} holds the parameters of tables "
                             f"{sorted(set(names) - set(free))} but not of tables {free}; "
                             f"the tables of one dynamic module train with one optimizer "
                             f"(nothing was changed)")
        try:
            params = fused_params_of_group(holder.optimizer, holder.group)
        except ValueError as err:
            raise ValueError(f"{where}: {holder.describe()} holds the tables' parameters: "
                             f"{err} (nothing was changed)") from None
        return params, [FollowedGroup(holder.describe(), holder.group, False)]

    def mark_trains_with_default(self) -> None:
        """Say on every handle that its table trains with the default optimizer (a dense
        optimizer found holding it later is refused, see :func:`refuse_untrained_tables`)."""
        self.trains_with_default = True
        for param in self.parameters(recurse=False):
            param.trains_with_default = True

    def mark_trained_in_backward(self) -> None:
        """Say on every handle that the fused optimizer trains its table (once the module's
        optimizer is configured): ``in_backward_optimizer_filter`` then leaves them out."""
        self.trained_in_backward = True
        for param in self.parameters(recurse=False):
            mark_trained_by_fused_optimizer(param)


def _handle(name: str, shape: Tuple[int, ...], dtype: torch.dtype) -> TableWeight:
    handle = TableWeight(torch.empty(shape, dtype=dtype, device="meta"))
    handle.table = name
    return handle


def _named(mark) -> str:
    cls, kwargs = mark
    return f"{getattr(cls, '__name__', cls)}({kwargs})"


# -- dense optimizers ----------------------------------------------------------------------------
_GUARD: List[Any] = []  # the hook's handle, once installed
#: optimizers whose params were checked, with how many params they had then
_CHECKED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()


def install_dense_optimizer_guard() -> None:
    """Run :func:`refuse_untrained_tables` before every optimizer step (torch's global
    optimizer hook, installed once per process, at the first dynamic module)."""
    if not _GUARD:
        _GUARD.append(add_step_pre_hook(refuse_untrained_tables))


def refuse_untrained_tables(optimizer: torch.optim.Optimizer, args=(), kwargs=None) -> None:
    """Raise ``ValueError`` if ``optimizer`` (about to step) holds the handle of a dynamic
    table that already trained with the default fused optimizer (``optimizer`` was built
    after the module's first training step, so it could not configure the table, and does
    not train it). An optimizer found clean is checked again only when its number of
    parameters changes."""
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _CHECKED.get(optimizer) == count:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            if isinstance(param, TableWeight) and param.trains_with_default and \
                    not is_trained_in_backward(param) and \
                    optimizer not in in_backward_optimizers(param):
                raise ValueError(
                    f"{type(optimizer).__name__} holds the parameter of dynamic table "
                    f"{param.table!r}, which it cannot train: the table already trains with "
                    f"the default fused optimizer (SGD, learning_rate=0.01), since "
                    f"{type(optimizer).__name__} did not exist at its first training step. "
                    f"Build the optimizer before the first training step (it then configures "
                    f"the tables' fused optimizer from its class and param group), or give "
                    f"the tables their optimizer with apply_optimizer_in_backward(<optimizer "
                    f"class>, <module>.parameters(), {{...}}), the module's optimizer="
                    f"OptimizerConfig(...) or the sharder's fused_params")
    try:
        _CHECKED[optimizer] = count
    except TypeError:  # an optimizer that cannot be weakly referenced: checked every step
        pass
