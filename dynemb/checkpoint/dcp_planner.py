"""``DynamicEmbLoadPlanner``: ``torch.distributed.checkpoint.load`` of dynamic tables saved
by any world size.

Rank ``r`` of ``w`` saves its share of a table as ``...rank<r>_of_<w>.*`` (see
:mod:`dynemb.checkpoint.module_state`): its live entries only, the per-entry tensors as byte
items (:mod:`dynemb.checkpoint.dcp_bytes`), which DCP's default planner loads whatever the
module holds. So it loads a checkpoint of the same world size, in place; the names depend on
the world size, and another one needs this planner, which reads whatever was saved:

- same world size: rank ``r`` reads saved share ``r`` whole (it loads slot for slot);
- another world size: every rank reads every saved share and keeps ``1 / world_size`` of
  its entries (contiguous ranges; one share's entries are in memory at a time beyond
  these), and the module's ``load_state_dict`` sends each row to its new owner.

Either way the shares load into whichever storage mode each table has now (a per-rank budget
may make a table HBM_DIRECT on 2 ranks and CACHE on 1): the tiers read are the saved ones.

It never loads into the live tables: what it reads goes to new host tensors, put into the
state dict in place of the module's own entries, and ``load_state_dict`` checks them before
anything changes. Row width and dtype are checked as each share's rows are read, before
anything loads.

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
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   MetadataIndex, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from dynemb.checkpoint.module_state import NAMESPACE
from dynemb.checkpoint.table_state import ENTRY_FIELDS

_SHARE = re.compile(rf"^(?P<base>(?:.*\.)?{NAMESPACE}\.[^.]+)\.rank(?P<rank>\d+)_of_"
                    rf"(?P<world>\d+)\.(?P<rest>.+)$")


class DynamicEmbLoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` that also loads dynamic tables, saved by any world size
    with any number of rows (see the module docstring). Everything else (dense layers,
    TorchRec tables, optimizer state) loads as the default planner loads it."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self._parts: Dict[str, Tuple[torch.Tensor, List[int]]] = {}
        self._byte_parts: Dict[str, Tuple[str, Tuple[int, int], Tuple]] = {}
        self._insert: List[Tuple[Tuple, torch.Tensor]] = []
        # saved rows read as byte items: (table, this module's row width and dtype)
        self._row_formats: Dict[str, Tuple[str, Tuple[int, ...], torch.dtype]] = {}
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
        """Row width and dtype of the saved shares against this module's: from the
        checkpoint's metadata before reading where it records them (rows saved as a
        tensor), else as each share's rows are read (saved as a byte item, see
        :mod:`dynemb.checkpoint.dcp_bytes`), before anything loads."""
        for rest, fqn in entries.items():
            if not rest.endswith(".rows"):
                continue
            mine = self.state_dict[fqn]
            for saved_entries in groups.values():
                saved_fqn = saved_entries.get(rest, "")
                md = self.metadata.state_dict_metadata.get(saved_fqn)
                if isinstance(md, TensorStorageMetadata):
                    self._check_row_format(base, tuple(md.size[1:]), md.properties.dtype,
                                           tuple(mine.shape[1:]), mine.dtype)
                elif saved_fqn:
                    self._row_formats[saved_fqn] = (base, tuple(mine.shape[1:]), mine.dtype)

    @staticmethod
    def _check_row_format(base, saved_width, saved_dtype, width, dtype) -> None:
        if saved_width != width or saved_dtype != dtype:
            raise ValueError(
                f"table {base!r}: cannot load the checkpoint: rows of width {saved_width} and "
                f"dtype {saved_dtype} in the checkpoint, width {width} and dtype {dtype} here "
                f"(another dim, optimizer or embedding dtype)")

    def _drop(self, fqn: str) -> None:
        """Take one of the module's own entries out of the load (and of the user's dict)."""
        del self.state_dict[fqn]
        path = self.mappings.get(fqn, (fqn,))
        parent = self.original_state_dict
        for key in path[:-1]:
            parent = parent[key]
        parent.pop(path[-1], None)

    def _read_part(self, fqn, rest, split, anchor) -> None:
        """This rank's part of saved entry ``fqn``: a new host tensor (a byte item: what it
        holds, once read, see :meth:`load_bytes`), put in the user's dict beside the entry
        it replaces."""
        path = anchor if anchor is not None else (fqn,)
        key = path[-1]
        cut = key.rfind(f"{NAMESPACE}.")
        name = key[:cut] + fqn[fqn.rfind(f"{NAMESPACE}."):] if cut >= 0 else fqn
        path = tuple(path[:-1]) + (name,)
        md = self.metadata.state_dict_metadata[fqn]
        if isinstance(md, BytesStorageMetadata):
            self._byte_parts[fqn] = (rest, split, path)
            return
        size = list(md.size)
        offsets = [0] * len(size)
        if rest.split(".")[-1] in ENTRY_FIELDS and size:
            offsets[0], size[0] = _part_range(size[0], split)
        tensor = torch.empty(size, dtype=md.properties.dtype)
        self._parts[fqn] = (tensor, offsets)
        self._insert.append((path, tensor))

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
        for fqn in self._byte_parts:
            index = MetadataIndex(fqn)
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=index,
                                  dest_offsets=torch.Size([0]), storage_index=index,
                                  storage_offsets=torch.Size([0]), lengths=torch.Size([0])))
        for path, tensor in self._insert:
            self._put(path, tensor)
        return LoadPlan(items, plan.storage_data, plan.planner_data)

    def load_bytes(self, read_item: ReadItem, value) -> None:
        part = self._byte_parts.get(read_item.dest_index.fqn)
        if part is None:
            return super().load_bytes(read_item, value)
        fqn = read_item.dest_index.fqn
        rest, split, path = part
        saved = torch.load(value, weights_only=True)
        if fqn in self._row_formats:
            self._check_row_format(self._row_formats[fqn][0], tuple(saved.shape[1:]),
                                   saved.dtype, *self._row_formats[fqn][1:])
        if rest.split(".")[-1] in ENTRY_FIELDS and saved.dim():
            lo, n = _part_range(saved.shape[0], split)
            saved = saved[lo:lo + n].clone() if n < saved.shape[0] else saved
        self._put(path, saved)

    def _put(self, path: Tuple, tensor: torch.Tensor) -> None:
        parent = self.original_state_dict
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = tensor

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        part = self._parts.get(index.fqn)
        if part is not None:
            return part[0]
        return super().lookup_tensor(index)


def _part_range(n: int, split: Tuple[int, int]) -> Tuple[int, int]:
    """Offset and length of part ``split = (part, parts)`` of ``n`` contiguous entries."""
    part, parts = split
    lo, hi = n * part // parts, n * (part + 1) // parts
    return lo, hi - lo
