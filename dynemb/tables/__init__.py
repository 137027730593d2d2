"""One dynamic table on one rank, one class per storage mode; the groups that run its
batches (:mod:`dynemb.tables.groups`: every table is in one).

=============  ==================================  =========================================
mode           class                               where rows are written back
=============  ==================================  =========================================
HBM_DIRECT     :class:`HbmDirectTable`             nowhere: the device tier is the table
CACHE          :class:`CacheTable`                 ``cache.py``: evicted rows go to the
                                                   backing store in prefetch
DEFAULT        :class:`TieredTable`                ``group_tiers.py``: each row is updated
                                                   in its (device or host) tier
HOST_ONLY      :class:`HostOnlyTable`              ``group_storage.py``: rows updated on the
                                                   module's device go back to host memory
=============  ==================================  =========================================

What each mode means to the code around its table (new rows, evicted rows, rows per memory,
grouping) is its :mod:`~dynemb.tables.policies` entry: ``storage_policy(layout.mode)``.
"""
from __future__ import annotations

from typing import Dict, Optional, Type

import torch

from dynemb.rows.optimizers import OptimizerConfig
from dynemb.options import DynamicEmbTableOptions, StorageMode, TableLayout
from dynemb.tables.base import DynamicTable
from dynemb.tables.lookup_batch import TableBatch
from dynemb.tables.cache import CacheTable
from dynemb.tables.hbm_direct import HbmDirectTable
from dynemb.tables.host_only import HostOnlyTable
from dynemb.tables.memory import MemoryBreakdown, PlannedRows
from dynemb.tables.policies import POLICIES, StoragePolicy, storage_policy
from dynemb.tables.tiered import TieredTable

#: The table class of each storage mode (its policy's, :mod:`dynemb.tables.policies`).
TABLE_CLASSES: Dict[StorageMode, Type[DynamicTable]] = {
    mode: policy.table_class for mode, policy in POLICIES.items()}


def build_table(name: str, table_id: int, dim: int, layout: TableLayout,
                options: DynamicEmbTableOptions, optimizer: OptimizerConfig,
                device: torch.device, backend: Optional[str] = None) -> DynamicTable:
    """The table of ``layout.mode`` (its policy's ``table_class``).

    Example::

        >>> from dynemb.options import choose_storage_mode
        >>> layout = choose_storage_mode(DynamicEmbTableOptions(), name="t",
        ...                              num_embeddings=1024, width=8, config_dtype=torch.float32)
        >>> type(build_table("t", 0, 8, layout, DynamicEmbTableOptions(), OptimizerConfig(),
        ...                  torch.device("cpu"))).__name__
        'HbmDirectTable'
    """
    table_class = storage_policy(layout.mode).table_class
    return table_class(name, table_id, dim, layout, options, optimizer, device, backend)


__all__ = ["DynamicTable", "HbmDirectTable", "CacheTable", "TieredTable", "HostOnlyTable", "TableBatch",
           "MemoryBreakdown", "PlannedRows", "StoragePolicy", "TABLE_CLASSES", "build_table",
           "storage_policy"]
