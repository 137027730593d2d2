"""HOST_ONLY: the table's one tier (hash table + flat table) lives in host memory, pinned when
the module is on CUDA; nothing of it on the device (a device budget of 0 bytes).

- prefetch: HBM_DIRECT's (:class:`~dynemb.tables.hbm_direct.HbmDirectTable`: admission
  first, find or insert, evict by score, new rows from the initializer, pins; eval: find
  only), by the CPU kernels on the host tier.
- forward: gather the embedding columns on the host, copy them to the module's device.
- backward: gather the rows as they are now, copy them to the module's device, run the
  fused optimizer update there (the kernels of HBM_DIRECT, so both train the same rows),
  write them back to host memory.
The batch (unique keys, inverse, counts, fallback rows) stays on the module's device, as the
module reads it; only the slots are host tensors. Counters and the admission counter stay
on the device, as in every mode. The tier allocates ``max_capacity`` rows up front and does
not grow. Checkpoints save it as the ``device`` tier of the other modes: the table's own
tier, wherever it lives, so a checkpoint moves between HOST_ONLY and HBM_DIRECT tables.
"""
from __future__ import annotations

from typing import Dict

import torch

from dynemb.options import DynamicEmbTableOptions, StorageMode, TableLayout
from dynemb.tables.base import DynamicTable
from dynemb.tables.batch import TableBatch
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
        >>> batch = table.prefetch(torch.tensor([7, 9, 7]), training=True)
        >>> table.lookup(batch).shape, table.stats()["rows_backing"]
        (torch.Size([2, 8]), 2)
    """

    mode = StorageMode.HOST_ONLY
    _grows = False

    def _build_tier(self) -> Tier:
        """The host tier, by the CPU kernels; its rows pinned when the module is on CUDA."""
        tier = Tier(self.layout, self.layout.max_capacity, self.dim, self.state_dim,
                    self.options, HOST, None)
        if self.device.type == "cuda":
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

    # -- forward and backward ------------------------------------------------------------------
    def lookup(self, batch: TableBatch) -> torch.Tensor:
        embeddings = self.tier.flat.weights[:, :self.dim]
        rows = embeddings.index_select(0, batch.slots.clamp(min=0))
        rows = rows.to(self.device, non_blocking=self.device.type == "cuda").float()
        return self._with_fallback(rows, (batch.slots >= 0).to(self.device), batch.fallback)

    lookup_occurrences = DynamicTable.lookup_occurrences

    def rows_in_place(self, batch: TableBatch):
        """As HBM_DIRECT's where the module is on the host too (its rows are where it
        pools); None on another device."""
        if self.device != self.tier.device:
            return None
        return super().rows_in_place(batch)

    def _update(self, batch: TableBatch, grads, lr: float, step: int) -> None:
        """Gather the rows as they are now to the module's device, update them there, write
        them back to the host tier."""
        slots = self._live_slots(self.tier, batch.slots, batch)
        stored = slots >= 0
        rows = self.tier.gather(slots).to(self.device)
        local = torch.where(stored.to(self.device),
                            torch.arange(slots.numel(), device=self.device), -1)
        self._fused_update(rows, local, grads, batch.keys, lr, step)
        self.tier.flat.weights.index_copy_(0, slots[stored], rows[stored.to(self.device)].to(HOST))

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
