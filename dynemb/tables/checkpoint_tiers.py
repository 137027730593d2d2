"""What a checkpoint sees of a table (:class:`CheckpointTiers`, which every
:class:`~dynemb.tables.base.DynamicTable` is): its tiers by name and where each keeps its keys
and rows (:class:`TierParts`), how saved entries go back in by key, and which entries are
current. Each storage mode's class says what differs for it (``_host_checkpoint_tier``,
``_insert_saved_rows``, ``current_entries``, ``check_routing``, ``tracked_tiers``).

=============  =====================================================================
tier           what it is
=============  =====================================================================
``device``     the device tier (every mode)
``host``       DEFAULT: the host tier; CACHE: the backing store
``admission``  the admission counter's table (keys and scores, no rows), when on
=============  =====================================================================
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

from dynemb.rows.admission import AdmissionCounter
from dynemb.stores.backing_store import BackingStore
from dynemb.rows.flat_table import FlatTable
from dynemb.rows.hash_table import ScoredHashTable
from dynemb.tables.tier import Tier
from dynemb.types import TableFullError

#: The tier names a table may checkpoint, in the order they are saved.
TIER_NAMES = ("device", "host", "admission")


@dataclasses.dataclass
class TierParts:
    """Where one tier of a table keeps its keys and rows.

    ``hash`` is None for a user backing store (saved from its ``export``); ``flat`` is None
    for the admission counter (keys and scores only) and a user store; ``store`` is the
    backing store the tier is (CACHE), whose changes are logged by key rather than per slot.
    """

    hash: Optional[ScoredHashTable]
    flat: Optional[FlatTable]
    store: Optional[BackingStore] = None

    @property
    def rows(self) -> Optional[torch.Tensor]:
        """[capacity, width] rows, one per slot of :attr:`hash` (None without a flat table)."""
        return None if self.flat is None else self.flat.weights

    def size(self) -> int:
        """Live keys of the tier."""
        return self.hash.size() if self.hash is not None else self.store.size()


class CheckpointTiers:
    """The checkpoint face of a table (mixed into :class:`~dynemb.tables.base.DynamicTable`,
    whose ``name``, ``tier`` and ``admission`` it reads)."""

    name: str
    tier: Tier
    admission: Optional[AdmissionCounter]

    def checkpoint_tiers(self) -> Dict[str, TierParts]:
        """The tiers a checkpoint of this table saves, by name, and where each keeps its keys
        and rows: ``device``; ``host`` where the mode has one (DEFAULT's host tier, CACHE's
        backing store); ``admission`` when admission is on. See
        :mod:`dynemb.tables.checkpoint_tiers`.

        Example::

            >>> from dynemb.rows.optimizers import OptimizerConfig
            >>> from dynemb.options import DynamicEmbTableOptions, choose_storage_mode
            >>> from dynemb.tables import build_table
            >>> options = DynamicEmbTableOptions(global_hbm_for_values=256 * 32)  # 256 rows
            >>> layout = choose_storage_mode(options, name="t", num_embeddings=1024, width=8,
            ...                              config_dtype=torch.float32)
            >>> table = build_table("t", 0, 8, layout, options, OptimizerConfig(),
            ...                     torch.device("cpu"))
            >>> parts = table.checkpoint_tiers()
            >>> table.mode.name, sorted(parts), parts["host"].size()
            ('DEFAULT', ['device', 'host'], 0)
            >>> table.check_routing("device", torch.arange(100), "tier 'device'")  # DEFAULT only
            Traceback (most recent call last):
            ...
            ValueError: tier 'device': ... keys belong to the host tier (e.g. key ...); ...
        """
        parts = {"device": TierParts(self.tier.hash, self.tier.flat)}
        host = self._host_checkpoint_tier()
        if host is not None:
            parts["host"] = host
        if self.admission is not None:
            parts["admission"] = TierParts(self.admission.table, None)
        return parts

    def _host_checkpoint_tier(self) -> Optional[TierParts]:
        """The mode's ``host`` tier, None where it has none."""
        return None

    def tracked_tiers(self) -> List[Tuple[str, Tier]]:
        """``(name, tier)`` of the tiers whose slots a
        :class:`~dynemb.checkpoint.changes.ChangeTracker` follows (the device tier; DEFAULT's
        host tier too), in the order of a batch's ``slots`` and ``host_slots``."""
        return [("device", self.tier)]

    def remap_tier_rows(self, tier: str, remap: torch.Tensor, capacity: int) -> None:
        """Move the rows of checkpoint tier ``tier`` after its hash table grew to
        ``capacity`` slots (old slot ``s`` is now ``remap[s]``). For a table being loaded:
        held batches and change marks are not remapped."""
        self.checkpoint_tiers()[tier].flat.remap(remap, capacity)

    def insert_saved_entries(self, tier: str, keys: torch.Tensor, scores: torch.Tensor,
                             rows: Optional[torch.Tensor]) -> None:
        """Insert live entries a checkpoint saved for ``tier`` by key, with their scores,
        evicting nothing: into the admission counter, or wherever the mode keeps rows
        (HBM_DIRECT: the device tier; CACHE: the backing store, the cache refills from it;
        DEFAULT: the tier each key routes to). Raises :class:`TableFullError` for keys that
        find no free slot."""
        if keys.numel() == 0:
            return
        if tier == "admission":
            h = self.admission.table
            h.load_entries(keys.to(h.device), scores.to(h.device))
            return
        self._insert_saved_rows(keys, scores, rows)

    def _insert_saved_rows(self, keys: torch.Tensor, scores: torch.Tensor,
                           rows: torch.Tensor) -> None:
        """The mode's part of :meth:`insert_saved_entries` (entries with rows)."""
        raise NotImplementedError

    def _insert_into_tier(self, name: str, tier: Tier, keys: torch.Tensor,
                          scores: torch.Tensor, rows: torch.Tensor) -> None:
        """Saved entries into the tier ``name`` by key, never evicting."""
        if keys.numel() == 0:
            return
        try:
            result = tier.hash.load_entries(keys.to(tier.device), scores.to(tier.device))
        except TableFullError as err:
            if err.remap is not None:
                self.remap_tier_rows(name, err.remap, tier.hash.capacity)
            raise TableFullError(f"table {self.name!r}: {err.failed_keys.numel()} keys of the "
                                 f"checkpoint found no free slot in its {name} tier "
                                 f"({tier.hash.capacity} rows): give the table more capacity",
                                 err.failed_keys, None) from None
        if result.remap is not None:
            self.remap_tier_rows(name, result.remap, tier.hash.capacity)
        tier.flat.weights.index_copy_(0, result.slots,
                                      rows.to(tier.device, tier.flat.weights.dtype))

    def current_entries(self, tier: str, keys: torch.Tensor, scores: torch.Tensor,
                        rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Of live entries read from checkpoint tier ``tier``, those whose row is their key's
        current one (all of them, but for CACHE's store: see :class:`CacheTable
        <dynemb.tables.cache.CacheTable>`)."""
        return keys, scores, rows

    def check_routing(self, tier: str, keys: torch.Tensor, where: str,
                      capacities: Optional[Dict[str, int]] = None) -> None:
        """Raise ``ValueError`` (starting with ``where``) if a live key of ``keys``, saved
        for ``tier``, sits in a tier lookups would not look for it in (``capacities``: the
        tier capacities, by name, the keys were placed under; this table's by default).
        Only DEFAULT routes keys between tiers: see :class:`TieredTable
        <dynemb.tables.tiered.TieredTable>`."""
