"""``DynamicEmbLoadPlanner``: ``torch.distributed.checkpoint.load`` of dynamic tables saved
by any world size.

Rank ``r`` of ``w`` saves its share of a table as ``...rank<r>_of_<w>.*`` (see
:mod:`dynemb.checkpoint.module_state`): its live entries only, so the names depend on the
world size and the sizes on how many rows each share held when it was saved. DCP's default
planner takes every size from the module it loads into, and a module holds other rows than
the checkpoint (a fresh one, none): it stops with ``Size mismatch between saved ... for
...dynamic_tables...``, and with ``Missing key in checkpoint state_dict`` for another world
size. This planner reads every saved entry at its saved size:

- same world size: rank ``r`` reads saved share ``r`` whole (it loads slot for slot);
- another world size: every rank reads ``1 / world_size`` of the entries of every saved
  share (contiguous ranges) and the module's ``load_state_dict`` sends each row to its new
  owner.

A checkpoint saved before fused optimizers saved their learning rate loads too: the
optimizer keeps its current one. It never loads into the live tables: what it reads goes to new host tensors, put into the
state dict in place of the module's own entries, and ``load_state_dict`` checks them before
anything changes. Row width and dtype are checked from the checkpoint's metadata before any
data is read.

Example::

    >>> import torch.distributed.checkpoint as dcp
    >>> state = model.state_dict()                                   # doctest: +SKIP
    >>> dcp.load(state, checkpoint_id=path, planner=DynamicEmbLoadPlanner())  # doctest: +SKIP
    >>> model.load_state_dict(state)                                 # doctest: +SKIP
"""
from __future__ import annotations

import re
from typing import Dict, List, Tuple

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from dynemb.checkpoint.module_state import NAMESPACE
from dynemb.checkpoint.table_state import ENTRY_FIELDS
from dynemb.rows.fused_optimizer import GROUP_STATE_KEY, PARAM_KEY

_SHARE = re.compile(rf"^(?P<base>(?:.*\.)?{NAMESPACE}\.[^.]+)\.rank(?P<rank>\d+)_of_"
                    rf"(?P<world>\d+)\.(?P<rest>.+)$")
_SIGNATURE = re.compile(rf"^(?:.*\.)?{NAMESPACE}\.[^.]+\.signature$")


class DynamicEmbLoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` that also loads dynamic tables, saved by any world size
    with any number of rows (see the module docstring). Everything else (dense layers,
    TorchRec tables, optimizer state) loads as the default planner loads it."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self._parts: Dict[str, Tuple[torch.Tensor, List[int]]] = {}
        self._insert: List[Tuple[Tuple, torch.Tensor]] = []
        self._keep_unsaved_learning_rates()
        self._read_signatures_as_saved()
        shares = self._own_shares()
        saved = self._saved_shares(set(shares))
        for base, (rank, world, entries) in shares.items():
            groups = saved.get(base)
            if not groups:
                continue  # the default plan reports the missing keys
            self._check_rows(base, entries, groups)
            for fqn in entries.values():
                self._drop(fqn)
            if (rank, world) in groups:
                wanted = {(rank, world): groups[(rank, world)]}
                split = (0, 1)  # the whole share
            else:
                wanted = groups
                split = (rank, world)
            anchor = self.mappings.get(next(iter(entries.values())))
            for (k, w), saved_entries in wanted.items():
                for rest, fqn in saved_entries.items():
                    self._read_part(fqn, rest, split, anchor)

    # -- which entries ------------------------------------------------------------------------
    def _keep_unsaved_learning_rates(self) -> None:
        """A checkpoint written before fused optimizers saved their param group holds no
        ``...dynamic_tables.param_group...`` entries: those keep their current values (the
        learning rate the optimizer was built with) instead of failing the load."""
        if self.metadata is None:
            return
        marker = f".{PARAM_KEY}.{GROUP_STATE_KEY}"
        saved = self.metadata.state_dict_metadata
        for fqn in [f for f in self.state_dict if marker in f and f not in saved]:
            del self.state_dict[fqn]

    def _read_signatures_as_saved(self) -> None:
        """A table signature written before signatures recorded the sharding scheme is
        shorter than this module's: it is read as saved, into a new tensor
        (``load_state_dict`` reads both kinds)."""
        if self.metadata is None:
            return
        saved = self.metadata.state_dict_metadata
        for fqn in [f for f in self.state_dict if _SIGNATURE.match(f)]:
            md = saved.get(fqn)
            if (isinstance(md, TensorStorageMetadata)
                    and md.size != self.state_dict[fqn].shape):
                anchor = self.mappings.get(fqn)
                self._drop(fqn)
                self._read_part(fqn, "signature", (0, 1), anchor)

    def _own_shares(self) -> Dict[str, Tuple[int, int, Dict[str, str]]]:
        shares: Dict[str, Tuple[int, int, Dict[str, str]]] = {}
        for fqn in self.state_dict:
            m = _SHARE.match(fqn)
            if m:
                entry = shares.setdefault(m["base"], (int(m["rank"]), int(m["world"]), {}))
                entry[2][m["rest"]] = fqn
        return shares

    def _saved_shares(self, bases) -> Dict[str, Dict[Tuple[int, int], Dict[str, str]]]:
        saved: Dict[str, Dict[Tuple[int, int], Dict[str, str]]] = {}
        for fqn in self.metadata.state_dict_metadata:
            m = _SHARE.match(fqn)
            if m and m["base"] in bases:
                group = (int(m["rank"]), int(m["world"]))
                saved.setdefault(m["base"], {}).setdefault(group, {})[m["rest"]] = fqn
        return saved

    def _check_rows(self, base, entries, groups) -> None:
        """Row width and dtype of the saved shares against this module's, before reading."""
        for rest, fqn in entries.items():
            if not rest.endswith(".rows"):
                continue
            mine = self.state_dict[fqn]
            for saved_entries in groups.values():
                md = self.metadata.state_dict_metadata.get(saved_entries.get(rest, ""))
                if not isinstance(md, TensorStorageMetadata):
                    continue
                if md.size[1:] != mine.shape[1:] or md.properties.dtype != mine.dtype:
                    raise ValueError(
                        f"table {base!r}: cannot load the checkpoint: rows of width "
                        f"{tuple(md.size[1:])} and dtype {md.properties.dtype} in the "
                        f"checkpoint, width {tuple(mine.shape[1:])} and dtype {mine.dtype} "
                        f"here (another dim, optimizer or embedding dtype)")

    def _drop(self, fqn: str) -> None:
        """Take one of the module's own entries out of the load (and of the user's dict)."""
        del self.state_dict[fqn]
        path = self.mappings.get(fqn, (fqn,))
        parent = self.original_state_dict
        for key in path[:-1]:
            parent = parent[key]
        parent.pop(path[-1], None)

    def _read_part(self, fqn, rest, split, anchor) -> None:
        """A new host tensor for this rank's part of saved entry ``fqn``."""
        md = self.metadata.state_dict_metadata[fqn]
        size = list(md.size)
        offsets = [0] * len(size)
        if rest.split(".")[-1] in ENTRY_FIELDS and size:
            part, parts = split
            lo, hi = size[0] * part // parts, size[0] * (part + 1) // parts
            offsets[0], size[0] = lo, hi - lo
        tensor = torch.empty(size, dtype=md.properties.dtype)
        self._parts[fqn] = (tensor, offsets)
        # where the user's (possibly nested) dict gets it: beside the entry it replaces
        path = anchor if anchor is not None else (fqn,)
        key = path[-1]
        cut = key.rfind(f"{NAMESPACE}.")
        name = key[:cut] + fqn[fqn.rfind(f"{NAMESPACE}."):] if cut >= 0 else fqn
        self._insert.append((tuple(path[:-1]) + (name,), tensor))

    # -- the plan -----------------------------------------------------------------------------
    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items = list(plan.items)
        for fqn, (tensor, offsets) in self._parts.items():
            if tensor.numel() == 0:
                continue
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.shape)
            items += create_read_items_for_chunk_list(
                fqn, self.metadata.state_dict_metadata[fqn], [chunk])
        for path, tensor in self._insert:
            parent = self.original_state_dict
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = tensor
        return LoadPlan(items, plan.storage_data, plan.planner_data)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        part = self._parts.get(index.fqn)
        if part is not None:
            return part[0]
        return super().lookup_tensor(index)
