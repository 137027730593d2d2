"""HBM_DIRECT: the whole table lives in one device tier (hash table + flat table).

Its group (:mod:`dynemb.tables.groups`) claims every key in prefetch (admission first),
evicting by score when a bucket is full (the evicted row is simply dropped: the table is the
only copy); new rows start from the initializer; the forward gathers the embedding columns
by slot and the backward updates the rows in place. The device tier doubles (up to
``max_capacity``) when ``init_capacity`` starts it smaller.
"""
from __future__ import annotations

import torch

from dynemb.options import DynamicEmbTableOptions, StorageMode, TableLayout
from dynemb.tables.base import DynamicTable
from dynemb.tables.memory import PlannedRows


class HbmDirectTable(DynamicTable):
    """See the module docstring.

    Example::

        >>> from dynemb.options import choose_storage_mode
        >>> from dynemb.tables import build_table
        >>> layout = choose_storage_mode(DynamicEmbTableOptions(), name="t", num_embeddings=1024,
        ...                              width=8, config_dtype=torch.float32)
        >>> layout.mode
        <StorageMode.HBM_DIRECT: 'hbm_direct'>
        >>> table = build_table("t", 0, 8, layout, DynamicEmbTableOptions(), OptimizerConfig(),
        ...                     torch.device("cpu"))
        >>> table.tier.hash.capacity, table.stats()["rows_device"]  # the slots for 1024 ids
        (1664, 0)
    """

    mode = StorageMode.HBM_DIRECT

    @property
    def _grows(self) -> bool:
        return self.layout.init_capacity < self.layout.max_capacity

    @classmethod
    def planned_rows(cls, layout: TableLayout, options: DynamicEmbTableOptions) -> PlannedRows:
        """The device tier at the most it grows to, ``max_capacity`` rows; nothing on the host.

        Example::

            >>> from dynemb.options import choose_storage_mode
            >>> options = DynamicEmbTableOptions(max_capacity=512)
            >>> layout = choose_storage_mode(options, name="t", num_embeddings=1000, width=8,
            ...                              config_dtype=torch.float32)
            >>> HbmDirectTable.planned_rows(layout, options)  # max_capacity 512
            PlannedRows(device_rows=512, host_rows=0, host_hash_slots=0, host_exact=True)
        """
        return PlannedRows(device_rows=layout.max_capacity)

    # -- checkpoint ----------------------------------------------------------------------------
    def _insert_saved_rows(self, keys: torch.Tensor, scores: torch.Tensor,
                           rows: torch.Tensor) -> None:
        """Saved rows go to the device tier: it is the whole table."""
        self._insert_into_tier("device", self.tier, keys, scores, rows)
