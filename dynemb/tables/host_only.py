"""HOST_ONLY: the table's one tier (hash table + flat table) lives in host memory, pinned when
the module is on CUDA; nothing of it on the device (a device budget of 0 bytes).

Its group (:mod:`dynemb.tables.groups`; the record in host memory) claims as HBM_DIRECT's
does (admission first, find or insert, evict by score, new rows from the initializer, pins),
by the CPU kernels; on a module on CUDA the keys are deduplicated there, the rows are
gathered on the host and copied to the module's device, and the backward gathers the rows
as they are now, updates them there (the kernels of HBM_DIRECT, so both train the same
rows) and writes them back to host memory (:attr:`~dynemb.tables.group_storage.GroupStorage.
serves_elsewhere`). Counters and the admission counter stay on the module's device, as in
every mode. The tier allocates ``max_capacity`` rows up front and does
not grow. Checkpoints save it as the ``device`` tier of the other modes: the table's own
tier, wherever it lives, so a checkpoint moves between HOST_ONLY and HBM_DIRECT tables.
"""
from __future__ import annotations

from typing import Dict

import torch

from dynemb.options import DynamicEmbTableOptions, StorageMode, TableLayout
from dynemb.tables.hbm_direct import HbmDirectTable
from dynemb.tables.memory import MemoryBreakdown, PlannedRows
from dynemb.tables.tier import Tier

HOST = torch.device("cpu")


class HostOnlyTable(HbmDirectTable):
    """See the module docstring.

    Example::

        >>> from dynemb.options import choose_storage_mode
        >>> from dynemb.tables import build_table
        >>> options = DynamicEmbTableOptions(local_hbm_for_values=0, max_capacity=256)
        >>> layout = choose_storage_mode(options, name="t", num_embeddings=100, width=8,
        ...                              config_dtype=torch.float32)
        >>> table = build_table("t", 0, 8, layout, options, OptimizerConfig(),
        ...                     torch.device("cpu"))
        >>> table.mode.name, table.tier.device.type, table.stats()["rows_device"]
        ('HOST_ONLY', 'cpu', 0)
        >>> table.stats()["rows_backing"], table.tier.hash.capacity
        (0, 256)
    """

    mode = StorageMode.HOST_ONLY
    _grows = False

    def _build_tier(self) -> Tier:
        """The host tier, by the CPU kernels; its rows pinned when the module is on CUDA."""
        tier = Tier(self.layout, self.layout.max_capacity, self.dim, self.state_dim,
                    self.options, HOST, None)
        if self.device != HOST:  # the rows cross to the module's device every step
            tier.flat.weights = tier.flat.weights.pin_memory()
        return tier

    @classmethod
    def planned_rows(cls, layout: TableLayout, options: DynamicEmbTableOptions) -> PlannedRows:
        """``max_capacity`` rows and hash slots, all in host memory.

        Example::

            >>> from dynemb.options import choose_storage_mode
            >>> options = DynamicEmbTableOptions(local_hbm_for_values=0, max_capacity=512)
            >>> layout = choose_storage_mode(options, name="t", num_embeddings=1000, width=8,
            ...                              config_dtype=torch.float32)
            >>> HostOnlyTable.planned_rows(layout, options)
            PlannedRows(device_rows=0, host_rows=512, host_hash_slots=512, host_exact=True)
        """
        return PlannedRows(0, host_rows=layout.max_capacity, host_hash_slots=layout.max_capacity)

    # -- sizes ---------------------------------------------------------------------------------
    def stats(self) -> Dict[str, object]:
        """As every mode's, the rows counted in ``rows_backing`` (host memory): no device
        rows and no device capacity; ``load_factor`` is the host tier's."""
        out = super().stats()
        out["rows_backing"], out["rows_device"] = out["rows_device"], 0
        out["device_capacity"] = 0
        return out

    def _rows_backing(self) -> int:
        return self.tier.hash.size()

    def memory_breakdown(self) -> MemoryBreakdown:
        """Every mode's breakdown with the tier's rows and hash table on the host side."""
        out = super().memory_breakdown()
        out.host_values_bytes, out.values_bytes = out.values_bytes, 0
        out.host_optimizer_bytes, out.optimizer_bytes = out.optimizer_bytes, 0
        out.host_hash_bytes, out.hash_bytes = out.hash_bytes, 0
        return out
