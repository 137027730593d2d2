"""What changed in a table since its latest dump: what an incremental dump writes.

A :class:`ChangeTracker` is attached to a table (``table.changes``) by every dump and load
of checkpoint files (:func:`start_tracking`); before that the table tracks nothing and pays
nothing. The table calls it at the few places where keys, scores or rows change:

- ``_claim`` (every mode's find-or-insert, pinned): :meth:`ChangeTracker.claimed` marks the
  returned slots as **touched** (found, inserted, rescored, loaded from the CACHE store) and
  logs the live keys the claim **evicted** (HBM_DIRECT and DEFAULT drop them; CACHE writes
  them back to its store);
- ``_apply_remap`` (the tier grew): :meth:`ChangeTracker.remapped` moves the touched marks
  with their keys;
- ``apply_gradients`` (the fused update): :meth:`ChangeTracker.updated` marks the batch's
  slots (a backward may run after the dump that followed its forward);
- CACHE ``_write_back``: :meth:`ChangeTracker.written_back` logs the keys whose store rows
  were (over)written. Keys the store itself evicts are not logged one by one: the table's
  ``store_evictions`` counter tells the dump that some were, and the dump then writes the
  store whole.

Marks are one ``index_fill_`` per call and the logs keep device tensors padded with
``EMPTY_KEY``, so the training step stays free of host syncs; a log is compacted (one sync)
only once it passes twice its compacted size (at least :data:`COMPACT_AT` entries).
Over-marking is harmless (a delta may hold a row that did not change, never miss one).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from dynemb.options import StorageMode
from dynemb.types import EMPTY_KEY

#: Logged keys (padding included) kept before a log is compacted.
COMPACT_AT = 1 << 20


class KeyLog:
    """Keys logged since the dump, as device tensors padded with ``EMPTY_KEY``."""

    def __init__(self):
        self._parts: List[torch.Tensor] = []
        self._logged = 0
        self._compact_at = COMPACT_AT

    def add(self, keys: torch.Tensor) -> None:
        self._parts.append(keys)
        self._logged += keys.numel()
        if self._logged > self._compact_at:
            kept = self.keys()
            self._parts, self._logged = [kept], kept.numel()
            self._compact_at = max(self._compact_at, 2 * kept.numel())

    def keys(self) -> torch.Tensor:
        """The distinct keys logged (sorted; padding dropped)."""
        if not self._parts:
            return torch.empty(0, dtype=torch.int64)
        keys = torch.cat([p.to(self._parts[0].device) for p in self._parts])
        return torch.unique(keys[keys != EMPTY_KEY])


class TierChanges:
    """Touched slots and evicted keys of one tier with slots of its own."""

    def __init__(self, capacity: int, device: torch.device):
        # one extra entry takes the marks of -1 slots (padding, failed keys), sync-free
        self._touched = torch.zeros(capacity + 1, dtype=torch.bool, device=device)
        self.evicted = KeyLog()

    @property
    def touched(self) -> torch.Tensor:
        """[capacity] bool: the slot changed since the dump."""
        return self._touched[:-1]

    def mark(self, slots: torch.Tensor) -> None:
        slots = slots.to(self._touched.device)
        padding = self._touched.numel() - 1
        self._touched.index_fill_(0, torch.where(slots >= 0, slots, padding), True)

    def remap(self, remap: torch.Tensor, capacity: int) -> None:
        """The tier grew to ``capacity`` slots: old slot ``s`` is now ``remap[s]``."""
        old = self.touched
        moved = torch.zeros(capacity + 1, dtype=torch.bool, device=old.device)
        remap = remap.to(old.device)
        moved.index_fill_(0, torch.where(old & (remap >= 0), remap, capacity), True)
        moved[-1] = False
        self._touched = moved


class ChangeTracker:
    """What changed in one table since dump ``dump_id`` (see the module docstring).

    ``generation`` is the owning collection's checkpoint-load count at that dump: a load
    since then (``load_state_dict``) makes the record meaningless, and an incremental dump
    checks it."""

    def __init__(self, table, dump_id: str, generation: int):
        self.dump_id = dump_id
        self.generation = generation
        self._tiers = [(table.tier, "device", TierChanges(table.tier.hash.capacity,
                                                          table.tier.device))]
        if table.mode is StorageMode.DEFAULT:
            host = table.host_tier
            self._tiers.append((host, "host", TierChanges(host.hash.capacity, host.device)))
        #: keys whose CACHE store rows were written since the dump
        self.stored = KeyLog()
        #: the ``store_evictions`` counter at the dump (CACHE)
        self.store_evictions = table.counters.snapshot()["store_evictions"]

    def tier(self, name: str) -> Optional[TierChanges]:
        """The changes of tier ``name`` ("device"; "host" in DEFAULT), None if untracked."""
        return next((c for _, n, c in self._tiers if n == name), None)

    def _of(self, tier) -> TierChanges:
        return next(c for t, _, c in self._tiers if t is tier)

    # -- hooks (called by the table) -----------------------------------------------------------
    def claimed(self, tier, result) -> None:
        changes = self._of(tier)
        changes.mark(result.slots)
        changes.evicted.add(torch.where(result.evicted, result.previous_keys, EMPTY_KEY))

    def remapped(self, tier, remap: torch.Tensor) -> None:
        self._of(tier).remap(remap, tier.hash.capacity)

    def updated(self, batch) -> None:
        if batch.slots is not None:
            self._tiers[0][2].mark(batch.slots)
        if batch.host_slots is not None and len(self._tiers) > 1:
            self._tiers[1][2].mark(batch.host_slots)

    def written_back(self, keys: torch.Tensor) -> None:
        self.stored.add(keys)


def start_tracking(tables: Dict[str, object], dump_id: str, generation: int) -> None:
    """Attach a fresh :class:`ChangeTracker` to every table (after a dump or a load)."""
    for table in tables.values():
        table.changes = ChangeTracker(table, dump_id, generation)
