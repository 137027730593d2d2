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

A dense optimizer given a handle (``torch.optim.Adam(model.parameters())``) could not train
the table: once a handle says which fused optimizer trains its table (a mark, the module's
``optimizer=``, a sharder's ``fused_params``), it is marked as trained in backward, as
TorchRec marks its sharded weights, so ``in_backward_optimizer_filter`` leaves it out and a
dense optimizer that holds it anyway finds no gradient on it (as TorchRec's weights after
their optimizer in backward ran). A handle of a table with no configured optimizer in a
dense optimizer makes that optimizer's ``step()`` raise ``ValueError``
(:func:`refuse_untrained_tables`): the dense optimizer would not train it, and the table
would train with the default.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, data_type_to_dtype

from dynemb.bridges.optimizer_marks import (add_step_pre_hook, in_backward_optimizers,
                                            is_trained_in_backward, mark_count,
                                            mark_trained_by_fused_optimizer, marks_of)
from dynemb.foundations.marked_optimizer import fused_params_of_mark


class TableWeight(torch.nn.Parameter):
    """The parameter handle of one dynamic table (see the module docstring); ``table`` names
    it in messages."""

    table: str = "?"


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
        for config in configs:
            self.register_parameter(config.name, _handle(
                config.name, (config.num_embeddings, config.embedding_dim),
                data_type_to_dtype(config.data_type)))
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
        if self.trained_in_backward:
            self.mark_trained_in_backward()
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
    table that no optimizer configuration reaches: it would not train the table, which would
    train with the default fused optimizer. An optimizer found clean is checked again only
    when its number of parameters changes."""
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _CHECKED.get(optimizer) == count:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            if isinstance(param, TableWeight) and not is_trained_in_backward(param) and \
                    optimizer not in in_backward_optimizers(param):
                raise ValueError(
                    f"{type(optimizer).__name__} holds the parameter of dynamic table "
                    f"{param.table!r}, which it cannot train: dynamic tables are trained in "
                    f"backward by their fused optimizer, which nothing configured (it would "
                    f"train with the default SGD, learning_rate=0.01). Give the tables their "
                    f"optimizer with apply_optimizer_in_backward(<optimizer class>, "
                    f"<module>.parameters(), {{...}}), the module's optimizer=OptimizerConfig"
                    f"(...) or the sharder's fused_params; dense optimizers then skip them "
                    f"(torchrec.optim.optimizers.in_backward_optimizer_filter leaves them out)")
    try:
        _CHECKED[optimizer] = count
    except TypeError:  # an optimizer that cannot be weakly referenced: checked every step
        pass
