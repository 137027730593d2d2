"""DEFAULT: device + host tiers side by side; each key lives in one of them, chosen by a hash
of the key (:func:`~dynemb.foundations.key_mixing.routes_to_first` over the tiers'
capacities), with no cache management.

Its group (:mod:`dynemb.tables.group_tiers`) dedups in prefetch; the forward routes each key
to its tier, finds or inserts it there (evicting by score inside that tier when its bucket
is full: the row is dropped), initializes new rows and gathers the rows from both tiers; the
backward updates each row in its tier.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from dynemb.foundations.key_mixing import routes_to_first
from dynemb.options import DynamicEmbTableOptions, StorageMode, TableLayout
from dynemb.tables.base import DynamicTable, tier_row_bytes
from dynemb.tables.checkpoint_tiers import TierParts
from dynemb.tables.memory import MemoryBreakdown, PlannedRows
from dynemb.tables.tier import Tier
from dynemb.types import EMPTY_KEY, TOMBSTONE_KEY


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

    def _tier_name(self, tier: Tier) -> str:
        return "the host tier" if tier is self.host_tier else "the device tier"

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
