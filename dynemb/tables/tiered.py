"""DEFAULT: device + host tiers side by side; each key lives in one of them, chosen by a hash
of the key, with no cache management.

- prefetch: dedup only;
- forward: route each key to its tier, find or insert it there (evicting by score inside
  that tier when its bucket is full: the row is dropped), initialize new rows, gather the
  rows from both tiers (:meth:`TieredTable.lookup`);
- backward: re-read the rows from their tiers, update them, **write them back to their
  tier** (:meth:`TieredTable._update`; the host tier's rows cross to host memory there).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from dynemb.foundations.key_mixing import routes_to_first
from dynemb.options import DynamicEmbTableOptions, StorageMode, TableLayout
from dynemb.tables.base import DynamicTable, tier_row_bytes
from dynemb.tables.batch import TableBatch
from dynemb.tables.checkpoint_tiers import TierParts
from dynemb.tables.memory import MemoryBreakdown, PlannedRows
from dynemb.tables.tier import Tier
from dynemb.types import EMPTY_KEY, TOMBSTONE_KEY, TableFullError

class TieredTable(DynamicTable):
    """See the module docstring. ``host_tier`` holds the rows the hash sends to the host."""

    mode = StorageMode.DEFAULT

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.host_tier = Tier(self.layout, self.layout.host_tier_rows, self.dim,
                              self.state_dim, self.options, torch.device("cpu"), None)

    @classmethod
    def planned_rows(cls, layout: TableLayout, options: DynamicEmbTableOptions) -> PlannedRows:
        """The device tier's rows and the host tier's (``layout.host_tier_rows``).

        Example::

            >>> from dynemb.options import choose_storage_mode
            >>> from dynemb.tables.tiered import TieredTable
            >>> options = DynamicEmbTableOptions(global_hbm_for_values=256 * 32)  # 256 rows of 32 bytes
            >>> layout = choose_storage_mode(options, name="t", num_embeddings=1024, width=8,
            ...                              config_dtype=torch.float32)
            >>> TieredTable.planned_rows(layout, options)  # 256 of the 1664 slots for 1024 ids
            PlannedRows(device_rows=256, host_rows=1408, host_hash_slots=1408, host_exact=True)
        """
        host = layout.host_tier_rows
        return PlannedRows(layout.device_capacity, host_rows=host, host_hash_slots=host)

    def _resolve(self, batch: TableBatch) -> None:
        """Nothing at prefetch: the tiers are looked up in forward."""

    def _tier_name(self, tier: Tier) -> str:
        return "the host tier" if tier is self.host_tier else "the device tier"

    # -- forward -------------------------------------------------------------------------------
    def lookup(self, batch: TableBatch) -> torch.Tensor:
        keys = batch.keys
        valid = keys != EMPTY_KEY
        on_device = valid & routes_to_first(
            keys, self.tier.hash.capacity, self.tier.hash.capacity + self.host_tier.hash.capacity)
        dev_keys = torch.where(on_device, keys, EMPTY_KEY)
        host_keys = torch.where(valid & ~on_device, keys, EMPTY_KEY).cpu()
        if batch.training:
            self._claim_tiers(batch, dev_keys, host_keys)
        else:
            self._find_tiers(batch, dev_keys, host_keys)
        rows, stored = self._gather_tiers(batch.slots, batch.host_slots)
        out = self._with_fallback(rows[:, :self.dim].float(), stored, batch.fallback)
        if not batch.training:
            self.release(batch)
        return out

    def _gather_tiers(self, dev_slots, host_slots):
        """Whole rows of each key from its tier, and which keys have one."""
        on_host = (host_slots >= 0).to(self.device)
        rows = torch.where(on_host[:, None], self.host_tier.gather(host_slots).to(self.device),
                           self.tier.gather(dev_slots))
        return rows, on_host | (dev_slots >= 0)

    def _find_tiers(self, batch: TableBatch, dev_keys, host_keys) -> None:
        batch.slots = self.tier.hash.find(dev_keys, allow_padding=True)
        batch.host_slots = self.host_tier.hash.find(host_keys, allow_padding=True)
        self.tier.hash.retain(batch.slots)
        self.host_tier.hash.retain(batch.host_slots)
        self._hold(batch)
        stored = (batch.slots >= 0) | (batch.host_slots >= 0).to(self.device)
        self.counters.add("hits", stored.sum())
        self.counters.add("misses", batch.num_unique.sum() - stored.sum())
        batch.fallback = self._eval_rows(batch.keys)

    def _claim_tiers(self, batch: TableBatch, dev_keys, host_keys) -> None:
        if self.admission is not None:
            present = (self.tier.hash.find(dev_keys, allow_padding=True) >= 0) | (
                self.host_tier.hash.find(host_keys, allow_padding=True) >= 0).to(self.device)
            admitted = self._admit(batch, present)
            dev_keys = torch.where(admitted, dev_keys, EMPTY_KEY)
            host_keys = torch.where(admitted.cpu(), host_keys, EMPTY_KEY)
        # The host tier first: a failure there leaves nothing to undo, while a failure on the
        # device (which, on CUDA, records its failures instead of raising) undoes the host
        # claim. Rows are initialized only once both claims stand.
        host = self._claim(self.host_tier, host_keys, batch.counts, batch.score)
        try:
            dev = self._claim(self.tier, dev_keys, batch.counts, batch.score)
        except TableFullError:
            self.host_tier.hash.undo(host)
            raise
        self._initialize(self.tier, dev, dev_keys)
        self._initialize(self.host_tier, host, host_keys)
        batch.slots, batch.host_slots = dev.slots, host.slots
        self._hold(batch)
        hits = (self._count_claim(self.tier, batch, dev, misses=False)
                + self._count_claim(self.host_tier, batch, host, misses=False))
        self.counters.add("misses", self._unique_count(batch) - hits)

    # -- backward ------------------------------------------------------------------------------
    def _update(self, batch: TableBatch, grads, lr: float, step: int) -> None:
        """Gather the rows as they are now (another lookup's backward may have updated them
        since this forward), update them, write them back to their tiers."""
        dev_slots = self._live_slots(self.tier, batch.slots, batch)
        host_slots = self._live_slots(self.host_tier, batch.host_slots, batch)
        rows, stored = self._gather_tiers(dev_slots, host_slots)
        rows = rows.contiguous()
        local = torch.where(stored, torch.arange(stored.numel(), device=self.device), -1)
        self._fused_update(rows, local, grads, batch.keys, lr, step)
        on_dev = dev_slots >= 0
        self.tier.flat.weights.index_copy_(0, dev_slots[on_dev], rows[on_dev])
        on_host = host_slots >= 0
        self.host_tier.flat.weights.index_copy_(0, host_slots[on_host],
                                                rows[on_host.to(self.device)].cpu())

    def _release_more(self, batch: TableBatch) -> None:
        if batch.host_slots is not None:
            self.host_tier.hash.release(batch.host_slots)

    # -- reads and sizes -----------------------------------------------------------------------
    def _row_sources(self):
        return (("tier", self.host_tier),)

    def _rows_backing(self) -> int:
        return self.host_tier.hash.size()

    def _host_memory(self) -> MemoryBreakdown:
        values, state = tier_row_bytes(self.host_tier, self.row_layout)
        return MemoryBreakdown(host_values_bytes=values, host_optimizer_bytes=state,
                               host_hash_bytes=self.host_tier.hash.nbytes())

    # -- checkpoint ----------------------------------------------------------------------------
    def _host_checkpoint_tier(self) -> TierParts:
        """The host tier, saved slot for slot like the device tier."""
        return TierParts(self.host_tier.hash, self.host_tier.flat)

    def tracked_tiers(self) -> List[Tuple[str, Tier]]:
        """Both tiers: each has slots of its own."""
        return [("device", self.tier), ("host", self.host_tier)]

    def _insert_saved_rows(self, keys: torch.Tensor, scores: torch.Tensor,
                           rows: torch.Tensor) -> None:
        """Each saved row goes to the tier its key routes to now (the tiers' capacities may
        differ from those it was saved under)."""
        dev_cap, host_cap = self.tier.hash.capacity, self.host_tier.hash.capacity
        on_device = routes_to_first(keys.to(self.device), dev_cap,
                                    dev_cap + host_cap).to(keys.device)
        self._insert_into_tier("device", self.tier, keys[on_device], scores[on_device],
                               rows[on_device])
        self._insert_into_tier("host", self.host_tier, keys[~on_device], scores[~on_device],
                               rows[~on_device])

    def check_routing(self, tier: str, keys: torch.Tensor, where: str,
                      capacities: Optional[Dict[str, int]] = None) -> None:
        """Lookups look for a key only in the tier :func:`routes_to_first` gives it under
        the tiers' capacities: a saved ``device`` or ``host`` key elsewhere is an error
        (an example: :mod:`dynemb.tables.checkpoint_tiers`)."""
        if tier not in ("device", "host"):
            return
        if capacities is None:
            capacities = dict(device=self.tier.hash.capacity, host=self.host_tier.hash.capacity)
        device, host = capacities["device"], capacities["host"]
        live = keys[(keys != EMPTY_KEY) & (keys != TOMBSTONE_KEY)]
        wrong = routes_to_first(live, device, device + host) != (tier == "device")
        if bool(wrong.any()):
            other = "host" if tier == "device" else "device"
            raise ValueError(f"{where}: {int(wrong.sum())} keys belong to the {other} tier "
                             f"(e.g. key {int(live[wrong][0])}); lookups would not find them")
