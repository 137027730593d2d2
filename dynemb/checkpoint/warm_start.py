"""Warm start: a dynamic module's rows from a trained TorchRec ``EmbeddingCollection`` /
``EmbeddingBagCollection`` (the reverse of :func:`dynemb.serving.to_static`).

Row ``i`` of a static table becomes id ``i`` of the dynamic table of the same name, or
``ids[name][i]`` from a mapping given per table (the ids the rows were trained for, e.g. the
raw ids a ``ManagedCollisionEmbeddingCollection`` or a hashing step mapped to rows). The
source is the module itself (sharded or not, alone or inside ``DistributedModelParallel``) or
its ``state_dict``; a sharded source's ``ShardedTensor`` gives each rank its local rows, so
a sharded source warm-starts a sharded module (each rank's rows travel to their dynemb
owners; an unsharded module on each rank would hold only that rank's shard).

Optimizer state comes from TorchRec's fused optimizer (``fused_optimizer.state_dict()`` of a
sharded module: fbgemm's ``momentum1`` per table) where the optimizers correspond:

===================  =====================================  ================================
dynemb optimizer     fbgemm state read                      dynemb state written
===================  =====================================  ================================
SGD                  none                                   none
ROWWISE_ADAGRAD      ``momentum1`` [rows]                   ``momentum1 - initial_acc`` [rows, 1]
ADAGRAD              ``momentum1`` [rows, dim]              ``momentum1 - initial_acc``
ADAM                 refused: fbgemm's CPU TBE has none, and its step is per table, not the
                     per-row step dynemb keeps; pass ``optimizer_state={}`` to start fresh
===================  =====================================  ================================

(``initial_acc``: the module's ``initial_accumulator_value``; dynemb's state columns hold the
accumulator's offset from it, see :class:`~dynemb.OptimizerConfig`.) A table whose source has
no state starts every row's state fresh, as a new row's.

The rows go in through ``write_rows`` (:mod:`dynemb.tables.row_writes`): they keep their
dtype where the tables agree (bit for bit), else are converted to the dynamic table's;
every input is checked before any table changes (a table the module lacks, another dim, a
mapping of another length or with an id twice, an optimizer state that does not map). Then
each table is written all or nothing, in name order (a sharded module: a collective per
table, every rank calls it); a table that does not fit raises ``TableFullError`` with the
tables before it written and the others unchanged.
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple

import torch
from torch import nn

from dynemb.bridges.sharded_tensors import row_pieces
from dynemb.foundations.validation import check_keys
from dynemb.module_interface import (DynamicModuleInterface, ShardedDynamicModuleInterface,
                                     local_module)
from dynemb.optimizer_config import OptimizerType

_WEIGHT = re.compile(r"(?:^|\.)(?:embeddings|embedding_bags)\.([^.]+)\.weight$")
_STATE = re.compile(r"^(.+)\.(momentum\d+)$")


class _TableRows(NamedTuple):
    """One table's rows held here: ``keys`` [n], ``rows`` [n, dim], ``state`` or None."""

    keys: torch.Tensor
    rows: torch.Tensor
    state: Optional[torch.Tensor]


def warm_start(module: nn.Module, source: Any,
               ids: Optional[Mapping[str, torch.Tensor]] = None, *,
               optimizer_state: Optional[Mapping[str, Any]] = None) -> Dict[str, int]:
    """Write the rows of the TorchRec tables in ``source`` into the dynamic tables of the
    same names in ``module`` (see the module docstring); returns the rows written from this
    rank, per table.

    Args:
        module: a :class:`~dynemb.DynamicEmbCollection`, :class:`~dynemb.DynamicEmbBagCollection`
            or their sharded form (then every rank calls, each with its own share of
            ``source``), or a model holding one (``DistributedModelParallel`` included).
        source: a TorchRec ``EmbeddingCollection`` / ``EmbeddingBagCollection``, sharded or
            not, or a model holding one, or such a module's ``state_dict`` (weights under
            ``embeddings.<table>.weight`` / ``embedding_bags.<table>.weight``, any prefix).
        ids: per table, the id of each row ([num_embeddings] int64, distinct); a table left
            out maps row ``i`` to id ``i``.
        optimizer_state: TorchRec's fused optimizer state (``fused_optimizer.state_dict()``);
            None: the source module's ``fused_optimizer``, if it has one; ``{}``: none.

    Example::

        >>> from torchrec import EmbeddingCollection
        >>> tables = [EmbeddingConfig(name="t", embedding_dim=2, num_embeddings=3,
        ...                           feature_names=["f"])]
        >>> static = EmbeddingCollection(tables=tables)
        >>> ec = DynamicEmbCollection(tables)
        >>> warm_start(ec, static, ids={"t": torch.tensor([70, 80, 90])})
        {'t': 3}
        >>> torch.equal(ec.read_rows("t", torch.tensor([80]))[0],
        ...             static.embeddings["t"].weight[1:2].detach())
        True
    """
    module = _dynamic_module(module)
    local = local_module(module)
    weights, fused = _source(source, optimizer_state)
    tables = local.tables
    unknown = sorted(set(weights) - set(tables))
    if unknown:
        raise ValueError(f"warm_start: the source has tables {unknown} that the module lacks "
                         f"(its tables: {list(tables)})")
    ids = dict(ids or {})
    extra = sorted(set(ids) - set(weights))
    if extra:
        raise ValueError(f"warm_start: ids given for tables {extra} the source does not hold "
                         f"(its tables: {sorted(weights)})")
    states = _optimizer_states(fused)
    planned = {name: _table_rows(local.tables[name], name, weights[name], ids.get(name),
                                 states.get(name))
               for name in sorted(weights)}  # every check before any table changes
    target = module if isinstance(module, ShardedDynamicModuleInterface) else local
    for name, part in planned.items():  # sharded: a collective per table, in name order
        target.write_rows(name, part.keys, part.rows, optimizer_state=part.state)
    return {name: part.keys.numel() for name, part in planned.items()}


def _dynamic_module(model: nn.Module) -> nn.Module:
    """``model`` if it is a dynamic module (or a sharded one), else the one it holds (a
    model, ``DistributedModelParallel``); ``TypeError`` if it holds none or several."""
    if local_module(model) is not None:
        return model
    found = [(fqn, sub) for fqn, sub in model.named_modules()
             if isinstance(sub, (ShardedDynamicModuleInterface, DynamicModuleInterface))] \
        if isinstance(model, nn.Module) else []
    outer = [(fqn, sub) for fqn, sub in found  # a sharded module's own share is inside it
             if not any(fqn.startswith(f"{other}.") for other, _ in found if other != fqn)]
    if len(outer) != 1:
        held = [fqn for fqn, _ in outer]
        raise TypeError(f"warm_start writes into one dynamic module (DynamicEmbCollection, "
                        f"DynamicEmbBagCollection or their sharded form, or a model holding "
                        f"one); {type(model).__name__} holds {len(outer)}"
                        + (f": {held}, pass one of them" if held else ""))
    return outer[0][1]


def _source(source, optimizer_state) -> Tuple[Dict[str, Tuple[int, list]], Mapping]:
    """``({table: (global rows, row pieces)}, fused optimizer state)`` of ``source``."""
    if isinstance(source, nn.Module):
        state_dict = source.state_dict()
        if optimizer_state is None:
            fused = getattr(source, "fused_optimizer", None)
            optimizer_state = fused.state_dict() if fused is not None else {}
    elif isinstance(source, Mapping):
        state_dict = source
    else:
        raise TypeError(f"warm_start reads a TorchRec EmbeddingCollection / "
                        f"EmbeddingBagCollection or its state_dict, got "
                        f"{type(source).__name__}")
    weights: Dict[str, Tuple[int, list]] = {}
    found_at: Dict[str, str] = {}
    for key, value in state_dict.items():
        match = _WEIGHT.search(key)
        if match is None:
            continue
        name = match.group(1)
        if name in weights:
            raise ValueError(f"warm_start: the source holds table {name!r} twice "
                             f"({found_at[name]!r} and {key!r}); pass the state_dict of one "
                             f"TorchRec module")
        weights[name], found_at[name] = row_pieces(value, key), key
    if not weights:
        raise ValueError("warm_start: the source holds no TorchRec table weights "
                         "('embeddings.<table>.weight' or 'embedding_bags.<table>.weight')")
    return weights, optimizer_state or {}


def _optimizer_states(fused: Mapping) -> Dict[str, Dict[str, Tuple[int, list]]]:
    """``{table: {"momentum1": (global rows, row pieces), ...}}`` of a fused optimizer's
    state dict (TorchRec's ``KeyedOptimizer``: ``state`` by parameter, ``<table>.<kind>``
    inside)."""
    out: Dict[str, Dict[str, Tuple[int, list]]] = {}
    for per_param in (fused.get("state") or {}).values():
        for key, value in per_param.items():
            match = _STATE.match(key)
            if match is not None and hasattr(value, "size"):
                out.setdefault(match.group(1), {})[match.group(2)] = row_pieces(value, key)
    return out


def _table_rows(table, name: str, weight, ids: Optional[torch.Tensor],
                state: Optional[Dict[str, Tuple[int, list]]]) -> _TableRows:
    """The keys, rows and state this rank writes into ``table``, checked."""
    num_rows, pieces = weight
    where = f"warm_start of table {name!r}"
    for _, piece in pieces:
        if piece.dim() != 2 or piece.shape[1] != table.dim:
            raise ValueError(f"{where}: the source's rows have shape {list(piece.shape)}, the "
                             f"dynamic table's dim is {table.dim}")
    if ids is not None:
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or \
                ids.shape != (num_rows,):
            raise ValueError(f"{where}: ids must be an int64 tensor of shape [{num_rows}] "
                             f"(one id per row of the source), got "
                             f"{getattr(ids, 'dtype', type(ids).__name__)} "
                             f"{list(getattr(ids, 'shape', []))}")
        unique, counts = torch.unique(ids, return_counts=True)
        if unique.numel() != num_rows:
            raise ValueError(f"{where}: ids must be distinct, id {int(unique[counts > 1][0])} "
                             f"is given to {int(counts.max())} rows")
        try:
            check_keys(ids, ids.device)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
    keys = [ids[first:first + piece.shape[0]] if ids is not None
            else torch.arange(first, first + piece.shape[0]) for first, piece in pieces]
    dtype = table.row_layout.dtype
    rows = [piece.detach().to(dtype) for _, piece in pieces]
    states = _state_rows(table, where, state, pieces) if state else None
    return _TableRows(_cat(keys, (0,), torch.int64), _cat(rows, (0, table.dim), dtype),
                      None if states is None else _cat(states, (0, table.state_dim),
                                                       torch.float32))


def _state_rows(table, where: str, state: Dict[str, Tuple[int, list]],
                pieces: List[Tuple[int, torch.Tensor]]) -> Optional[List[torch.Tensor]]:
    """dynemb's state of each row piece, from fbgemm's (see the module docstring)."""
    config = table.optimizer
    kind = config.type
    if kind is OptimizerType.SGD:
        raise ValueError(f"{where}: the source has optimizer state {sorted(state)} but the "
                         f"module trains with SGD, which keeps none; pass "
                         f"optimizer_state={{}} to leave it behind")
    if kind not in (OptimizerType.ROWWISE_ADAGRAD, OptimizerType.ADAGRAD) or \
            sorted(state) != ["momentum1"]:
        raise ValueError(f"{where}: the source's optimizer state {sorted(state)} does not map "
                         f"to {kind.name}'s (only fbgemm's row-wise AdaGrad and AdaGrad "
                         f"momentum1 import); pass optimizer_state={{}} to start it fresh")
    _, momentum = state["momentum1"]
    by_first = {first: piece for first, piece in momentum}
    rowwise = kind is OptimizerType.ROWWISE_ADAGRAD
    out = []
    for first, rows in pieces:
        m = by_first.get(first)
        want = (rows.shape[0],) if rowwise else tuple(rows.shape)
        if m is None or tuple(m.shape) != want:
            raise ValueError(f"{where}: momentum1 of {kind.name} must hold "
                             f"{list(want)} values for rows {first}..{first + rows.shape[0]}, "
                             f"got {None if m is None else list(m.shape)}")
        m = m.detach().to(torch.float32)
        out.append((m[:, None] if rowwise else m) - config.initial_accumulator_value)
    return out


def _cat(parts: List[torch.Tensor], empty_shape, dtype) -> torch.Tensor:
    if not parts:
        return torch.empty(empty_shape, dtype=dtype)
    return parts[0] if len(parts) == 1 else torch.cat(parts)
