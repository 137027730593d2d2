"""Storage policies: what a storage mode means to the rest of dynemb, one object per mode.

A :class:`~dynemb.options.StorageMode` names where a table's rows live; its policy says what
follows from that for the code around the table: where a new row's values come from, what
becomes of an evicted row, which memory holds how many rows (at the start, for the
allocation checks; at the most, for the planner), where a lookup reads its rows, and whether
the table trains in a group. Code outside the tables layer and :mod:`dynemb.options` asks
``storage_policy(layout.mode)`` and never tests the mode itself, so a new mode is one new
policy here (and its table class), not a search through the package.

=============  ===============  ===============  ===============  ==========  ======
policy         table class      new rows         evicted rows     row reads   groups
=============  ===============  ===============  ===============  ==========  ======
HBM_DIRECT     HbmDirectTable   initializer      dropped          device      yes
CACHE          CacheTable       store load       written back     cached      yes
DEFAULT        TieredTable      initializer      dropped          cached      yes
HOST_ONLY      HostOnlyTable    initializer      dropped          host        yes
=============  ===============  ===============  ===============  ==========  ======

Example::

    >>> from dynemb.options import choose_storage_mode
    >>> options = DynamicEmbTableOptions(caching=True, global_hbm_for_values=512 * 32)
    >>> layout = choose_storage_mode(options, name="t", num_embeddings=5000, width=8,
    ...                              config_dtype=torch.float32)
    >>> policy = storage_policy(layout.mode)
    >>> policy.new_rows, policy.evicted_rows, policy.backing_store
    (<NewRows.STORE_LOAD: 'store_load'>, <EvictedRows.WRITTEN_BACK: 'written_back'>, True)
    >>> policy.upfront_device_rows(layout), policy.upfront_host_rows(layout)  # the store grows
    (512, 0)
"""
from __future__ import annotations

import enum
from typing import Dict, Type

from dynemb.options import DynamicEmbTableOptions, StorageMode, TableLayout
from dynemb.tables.base import DynamicTable
from dynemb.tables.cache import CacheTable
from dynemb.tables.hbm_direct import HbmDirectTable
from dynemb.tables.host_only import HostOnlyTable
from dynemb.tables.memory import PlannedRows
from dynemb.tables.tiered import TieredTable


class NewRows(enum.Enum):
    """Where a key new to the table takes its row from (scores follow the score policy)."""

    #: the table's initializer (``options.initializer``)
    INITIALIZER = "initializer"
    #: the backing store's row and score where the store has the key, else the
    #: initializer's row; loaded in prefetch
    STORE_LOAD = "store_load"


class EvictedRows(enum.Enum):
    """What becomes of the row of a key the score policy evicts."""

    #: gone: the key starts from a new row if it comes back
    DROPPED = "dropped"
    #: written to the backing store with its score, in prefetch
    WRITTEN_BACK = "written_back"


class RowReads(enum.Enum):
    """Where a lookup finds the rows it gathers."""

    #: every row is in device memory
    DEVICE = "device"
    #: the device holds some rows (a cache or a tier); the rest are in host memory or a store
    CACHED = "cached"
    #: every row is in host memory
    HOST = "host"


class StoragePolicy:
    """What the rest of dynemb needs to know of one storage mode (see the module docstring).
    One instance per mode: :data:`HBM_DIRECT`, :data:`CACHE`, :data:`DEFAULT`,
    :data:`HOST_ONLY`; :func:`storage_policy` finds it."""

    mode: StorageMode
    table_class: Type[DynamicTable]
    new_rows: NewRows = NewRows.INITIALIZER
    evicted_rows: EvictedRows = EvictedRows.DROPPED
    row_reads: RowReads = RowReads.DEVICE
    #: whether tables of this mode can train as one group (:mod:`dynemb.tables.groups`; a
    #: table whose rows live away from the module's device never does)
    groups: bool = False

    def __repr__(self) -> str:
        return f"<StoragePolicy {self.mode.name}>"

    @property
    def backing_store(self) -> bool:
        """Whether the table keeps its rows in a backing store (``options.backing_store``)
        that its device rows cache: rows move between them in prefetch."""
        return self.evicted_rows is EvictedRows.WRITTEN_BACK

    def planned_rows(self, layout: TableLayout, options: DynamicEmbTableOptions) -> PlannedRows:
        """The rows a table of ``layout`` holds at its largest, by memory
        (``planned_rows`` of its table class)."""
        return self.table_class.planned_rows(layout, options)

    def upfront_device_rows(self, layout: TableLayout) -> int:
        """Device rows (one hash slot each) the table allocates when it is built."""
        return layout.init_capacity

    def upfront_host_rows(self, layout: TableLayout) -> int:
        """Host rows (one hash slot each) the table allocates when it is built."""
        return 0

    def upfront_rows_text(self, layout: TableLayout, options: DynamicEmbTableOptions) -> str:
        """The rows allocated up front, in words, for an error that says they do not fit."""
        raise NotImplementedError

    def allocate_less_text(self, layout: TableLayout) -> str:
        """The options that make a table of this mode allocate less up front, in words."""
        raise NotImplementedError


class HbmDirectPolicy(StoragePolicy):
    """HBM_DIRECT: the whole table in device memory, starting at ``init_capacity`` rows and
    growing up to ``max_capacity``."""

    mode = StorageMode.HBM_DIRECT
    table_class = HbmDirectTable
    groups = True

    def upfront_rows_text(self, layout: TableLayout, options: DynamicEmbTableOptions) -> str:
        if options.init_capacity is not None:
            source = "init_capacity"
        elif options.max_capacity is not None:
            source = "init_capacity, which defaults to max_capacity"
        else:
            source = ("init_capacity, which defaults to max_capacity, which defaults to room "
                      "for num_embeddings ids")
        return f"the {layout.init_capacity} rows allocated up front ({source})"

    def allocate_less_text(self, layout: TableLayout) -> str:
        return (f"set init_capacity to start smaller (the table grows up to max_capacity="
                f"{layout.max_capacity} as rows arrive), or a memory budget "
                f"(local_hbm_for_values / global_hbm_for_values) with caching=True to keep only "
                f"the hot rows on the device (a backing store that grows as rows arrive holds "
                f"the rest)")


class CachePolicy(StoragePolicy):
    """CACHE: the device rows of the memory budget cache a backing store that holds every
    row and grows as rows arrive."""

    mode = StorageMode.CACHE
    table_class = CacheTable
    new_rows = NewRows.STORE_LOAD
    evicted_rows = EvictedRows.WRITTEN_BACK
    row_reads = RowReads.CACHED
    groups = True

    def upfront_rows_text(self, layout: TableLayout, options: DynamicEmbTableOptions) -> str:
        return f"the {layout.init_capacity} device rows of the memory budget"

    def allocate_less_text(self, layout: TableLayout) -> str:
        return "lower the memory budget (local_hbm_for_values / global_hbm_for_values)"


class TieredPolicy(StoragePolicy):
    """DEFAULT: the device rows of the memory budget and a host tier with the rest of
    ``max_capacity``, both allocated up front; each key lives in one of them."""

    mode = StorageMode.DEFAULT
    table_class = TieredTable
    row_reads = RowReads.CACHED
    groups = True  # both tiers (dynemb.tables.group_tiers)

    def upfront_host_rows(self, layout: TableLayout) -> int:
        return layout.host_tier_rows

    def upfront_rows_text(self, layout: TableLayout, options: DynamicEmbTableOptions) -> str:
        return (f"the {layout.init_capacity} device rows of the memory budget and the "
                f"{self.upfront_host_rows(layout)} rows of the host tier, allocated up front,")

    def allocate_less_text(self, layout: TableLayout) -> str:
        return ("with caching=False the host tier holds max_capacity minus the device rows from "
                "the start: lower max_capacity, or set caching=True (its backing store grows "
                "as rows arrive)")


class HostOnlyPolicy(StoragePolicy):
    """HOST_ONLY: all ``max_capacity`` rows in host memory from the start, none on the
    device."""

    mode = StorageMode.HOST_ONLY
    table_class = HostOnlyTable
    row_reads = RowReads.HOST
    groups = True  # its record by the host kernels, its update where the module is

    def upfront_device_rows(self, layout: TableLayout) -> int:
        return 0

    def upfront_host_rows(self, layout: TableLayout) -> int:
        return layout.max_capacity

    def upfront_rows_text(self, layout: TableLayout, options: DynamicEmbTableOptions) -> str:
        return (f"the {self.upfront_host_rows(layout)} host rows of max_capacity, allocated "
                f"up front,")

    def allocate_less_text(self, layout: TableLayout) -> str:
        return "lower max_capacity (a HOST_ONLY table holds all of it in host memory)"


HBM_DIRECT = HbmDirectPolicy()
CACHE = CachePolicy()
DEFAULT = TieredPolicy()
HOST_ONLY = HostOnlyPolicy()

#: The policy of every storage mode.
POLICIES: Dict[StorageMode, StoragePolicy] = {
    policy.mode: policy for policy in (HBM_DIRECT, CACHE, DEFAULT, HOST_ONLY)}


def storage_policy(mode: StorageMode) -> StoragePolicy:
    """The policy of ``mode`` (a table's ``layout.mode`` or ``table.mode``).

    Example::

        >>> storage_policy(StorageMode.HOST_ONLY).row_reads
        <RowReads.HOST: 'host'>
    """
    return POLICIES[mode]
