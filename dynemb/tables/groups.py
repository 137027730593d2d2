"""Table groups: tables of one shape that train as one, one kernel call per phase.

A module's HBM_DIRECT (CACHE, or on the host HOST_ONLY) tables that agree on everything the
kernels read (mode, device and kernels, dtype, dim and row width, optimizer, score policy,
bucket size, admission or not, stash mode) form a :class:`TableGroup`; such a table with no
partner is a group of one, so that it trains on the same path. A table that grows grows in
its group, where and as much as it would alone (:meth:`GroupStorage.grow_tables
<dynemb.tables.group_storage.GroupStorage.grow_tables>`); tables with admission each admit
their own keys before the group claims them (a CACHE table counting its store's keys as
stored). The group's tables live in one set of arrays
(hash keys, scores, pins, rows, counters), each table in its own contiguous part: the record
:class:`~dynemb.tables.group_storage.GroupStorage`. The tables stay whole tables: their hash
tables, flat tables and counters are views of their parts, and everything read per table
(``read_rows``, ``stats``, checkpoints, exports) is unchanged.

DEFAULT tables on the host kernels group too, as a
:class:`~dynemb.tables.group_tiers.TieredGroup` (two records: their device tiers and their
host tiers; it claims in forward, as such a table alone does).

A training batch of the group is one :class:`GroupBatch`: one dedup, one claim, one
initialization, one gather, one fused update and one release for all its tables, each with
the results its table alone would give. The group is organised by phase, each an object or
functions over the record, one code path on every kernel backend: the training prefetch and
the eval lookup (:mod:`dynemb.tables.group_prefetch`; CACHE tables write their evicted rows
back and load their new rows through :mod:`dynemb.tables.group_stores`; keys that find no
slot: :mod:`dynemb.tables.group_failures`); the update (:mod:`dynemb.tables.group_update`);
the gather (the batch's, :class:`GroupBatch`) and the release (the record's). Which tables group:
:func:`~dynemb.tables.group_signature.group_signature`.

Example::

    >>> from dynemb.options import DynamicEmbTableOptions, choose_storage_mode
    >>> from dynemb.rows.optimizers import OptimizerConfig
    >>> from dynemb.tables import build_table
    >>> def table(name):
    ...     layout = choose_storage_mode(DynamicEmbTableOptions(), name=name, num_embeddings=512,
    ...                                  width=4, config_dtype=torch.float32)
    ...     return build_table(name, 0, 4, layout, DynamicEmbTableOptions(), OptimizerConfig(),
    ...                        torch.device("cpu"))
    >>> tables = {name: table(name) for name in ("a", "b")}
    >>> [group.names for group in group_tables(tables)]
    [('a', 'b')]
"""
from __future__ import annotations

from typing import Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import torch

from dynemb.options import StorageMode
from dynemb.tables.base import DynamicTable
from dynemb.tables.group_batch import GroupBatch
from dynemb.tables.group_prefetch import GroupPrefetch
from dynemb.tables.group_signature import group_signature
from dynemb.tables.group_storage import GroupStorage
from dynemb.tables.group_tiers import TieredGroup
from dynemb.tables.group_stores import GroupStores

__all__ = ["GroupBatch", "TableGroup", "group_of_one", "group_signature", "group_tables"]


def group_tables(tables: Mapping[str, DynamicTable], *, apart: bool = False
                 ) -> List["TableGroup"]:
    """The groups of ``tables``, in table order: every table is in one, a table with no
    partner in a group of one (``apart``: every table; so is a table whose
    :func:`group_signature` is None).

    A group of one cost what the table's own path cost, or less, while tables had one
    (``benchmarks/README.md``, ``bench_group_of_one``; on CUDA 30 launches a step against 80,
    ``benchmarks/step_census.py``)."""
    by_signature: Dict[Hashable, List[DynamicTable]] = {}
    for name, table in tables.items():
        signature = group_signature(table)
        alone = apart or signature is None
        by_signature.setdefault((signature, name) if alone else signature, []).append(table)
    return [TieredGroup(members) if members[0].mode is StorageMode.DEFAULT
            else TableGroup(members) for members in by_signature.values()]


def group_of_one(table: DynamicTable):
    """``table`` as a group of one over its arrays as they are (views of its module's group
    included: nothing is copied and the module's group stays whole), for work on one table
    outside its module's steps (:func:`~dynemb.tables.fill.fill_to_load_factor`)."""
    kind = TieredGroup if table.mode is StorageMode.DEFAULT else TableGroup
    return kind([table], in_place=True)


class TableGroup:
    """Tables of one :func:`group_signature` in one set of arrays, a
    :class:`~dynemb.tables.group_storage.GroupStorage` (building it copies each table into
    its part of them), and the phases that work on it: the training prefetch and the eval
    lookup (:class:`~dynemb.tables.group_prefetch.GroupPrefetch`) and, through the batches
    it makes, the update and the release."""

    def __init__(self, tables: Sequence[DynamicTable], *, in_place: bool = False):
        self.storage = storage = GroupStorage(tables, in_place=in_place)
        stores = GroupStores(storage) if storage.mode is StorageMode.CACHE else None
        self._prefetch = GroupPrefetch(storage, stores)

    @property
    def names(self) -> Tuple[str, ...]:
        return self.storage.names

    @property
    def tables(self) -> List[DynamicTable]:
        return self.storage.tables

    def intact(self, tables: Mapping[str, DynamicTable]) -> bool:
        """Whether ``tables`` still holds the group's tables, each in its part of the group's
        arrays (see :meth:`GroupStorage.intact`)."""
        return self.storage.intact(tables)

    def live_batches(self) -> List[GroupBatch]:
        """The group's batches still referenced anywhere, their pins ended or not: a late
        backward of one updates the rows still holding its keys."""
        return self.storage.live_batches()

    def view_parts_again(self) -> None:
        """After unpickling (see :meth:`GroupStorage.view_parts_again`)."""
        self.storage.view_parts_again()

    # -- what a module's prefetch runs over (dynemb.modules.batch_claims) ---------------------
    def claims_apart(self) -> bool:
        """Whether :meth:`claim_batch` only claims (:meth:`undo_batch` takes it back
        exactly): for tables without admission (which counts keys before it claims)."""
        return not self.storage.admits

    def claim_batch(self, keys: Sequence[torch.Tensor],
                    occurrences: Sequence[Optional[torch.Tensor]],
                    scores: Sequence[Optional[int]]) -> GroupBatch:
        """Claim and pin the rows of every table's ``keys`` (one tensor per table, group
        order) for training. ``occurrences``: per table, what each id stands for (None: 1);
        ``scores``: per table, the CUSTOMIZED score (None for other policies).

        A key that finds no slot (its bucket full of pinned rows) raises the
        ``TableFullError`` the first refusing table raises alone, the group unchanged; or,
        on the CUDA kernels, is served zeros and its table raises at a later prefetch
        (:mod:`dynemb.tables.group_failures`).

        The rows are claimed but neither filled nor counted yet: :meth:`finish_batch` does
        that, or :meth:`undo_batch` takes the claim back."""
        return self._prefetch.claim_batch(keys, occurrences, scores)

    def finish_batch(self, batch: GroupBatch) -> GroupBatch:
        """Fill the rows :meth:`claim_batch` claimed and count them."""
        return self._prefetch.finish_batch(batch)

    def undo_batch(self, batch: GroupBatch) -> None:
        """Take back a :meth:`claim_batch` that :meth:`finish_batch` did not follow; a
        finished batch's pins just end."""
        self._prefetch.undo_batch(batch)

    def prefetch(self, keys: Sequence[torch.Tensor], occurrences: Sequence[Optional[torch.Tensor]],
                 scores: Sequence[Optional[int]]) -> GroupBatch:
        """:meth:`claim_batch` then :meth:`finish_batch`."""
        return self._prefetch.prefetch(keys, occurrences, scores)

    def lookup_batch(self, keys: Sequence[torch.Tensor],
                     occurrences: Sequence[Optional[torch.Tensor]]) -> GroupBatch:
        """A read-only (eval) lookup of every table's ``keys``
        (:meth:`GroupPrefetch.lookup_batch <dynemb.tables.group_prefetch.GroupPrefetch.lookup_batch>`)."""
        return self._prefetch.lookup_batch(keys, occurrences)

    def check_failures(self, wait: bool = False) -> None:
        """Raise the ``TableFullError`` of keys of earlier batches that found no slot, where
        the kernels report them later (:mod:`dynemb.tables.group_failures`; ``wait``: for
        the last batch's count too)."""
        self._prefetch.failures.check(wait)

    def __repr__(self) -> str:
        return f"TableGroup({list(self.names)}, rows={self.storage.row_offset[-1]})"
