"""What changed in a table since its latest dump: what an incremental dump writes.

A :class:`ChangeTracker` is attached to a table (``table.changes``) by every dump and load
of checkpoint files (:func:`start_tracking`); before that the table tracks nothing and pays
nothing. The table calls it at the few places where keys, scores or rows change:

- ``_claim`` (every mode's find-or-insert, pinned): :meth:`ChangeTracker.claimed` marks the
  returned slots as **touched** (found, inserted, rescored, loaded from the CACHE store) and
  keeps, for a slot touched for the first time, the key it held at the dump: the keys that
  left the tier since (HBM_DIRECT and DEFAULT evictions drop them; CACHE moves them to its
  store) are among those;
- ``_apply_remap`` (the tier grew): :meth:`ChangeTracker.remapped` moves the marks with the
  keys;
- ``apply_gradients`` (the fused update): :meth:`ChangeTracker.updated` marks the batch's
  slots (a backward may run after the dump that followed its forward);
- CACHE ``_write_back``: :meth:`ChangeTracker.written_back` logs the keys whose store rows
  were (over)written. Keys the store itself evicts are not logged one by one: the table's
  ``store_evictions`` counter tells the dump that some were, and the dump then writes the
  store whole;
- expiry (:mod:`dynemb.tables.expiry`): :meth:`ChangeTracker.erased` marks the slots of the
  keys erased from a tier (the keys left it); keys erased from a CACHE store set
  :attr:`ChangeTracker.store_erased`, and the dump writes the store whole.

A tracked tier costs a bool and an int64 per slot, and its marks are two ``index_copy_`` /
``index_fill_`` per call: the training step stays free of host syncs. Over-marking is
harmless (a delta may hold a row that did not change, never miss one).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from dynemb.types import EMPTY_KEY, TOMBSTONE_KEY

#: Logged keys (padding included) kept before a log is compacted.
COMPACT_AT = 1 << 20


class KeyLog:
    """Keys logged since the dump (tensors, padding ``EMPTY_KEY`` allowed), compacted to the
    distinct keys (one sync) once past twice their last compacted count, at least
    :data:`COMPACT_AT`."""

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
    """The slots of one tier (with slots of its own) touched since the dump, and the key
    each of them held at the dump.

    The keys that left the tier since the dump are among those **base keys** (a key that
    left took a slot of the tier with it, and that slot was touched when the key left): the
    dump keeps those no longer in the tier. Holding one key per slot costs 8 bytes a slot,
    fixed, and never a host sync; keys inserted and evicted between two dumps never appear.
    """

    def __init__(self, capacity: int, device: torch.device):
        # one extra entry takes the marks of -1 slots (padding, failed keys), sync-free
        self._touched = torch.zeros(capacity + 1, dtype=torch.bool, device=device)
        self._base = torch.full((capacity + 1,), EMPTY_KEY, dtype=torch.int64, device=device)
        self._lost = KeyLog()  # base keys of touched slots a growth emptied (none expected)

    @property
    def capacity(self) -> int:
        return self._touched.numel() - 1

    def clear(self) -> None:
        """Nothing touched, nothing lost."""
        self._touched.zero_()
        self._base.fill_(EMPTY_KEY)
        self._lost = KeyLog()

    @property
    def touched(self) -> torch.Tensor:
        """[capacity] bool: the slot changed since the dump."""
        return self._touched[:-1]

    def mark(self, slots: torch.Tensor, before: torch.Tensor) -> None:
        """Slots ``slots`` [U] change now; ``before`` [U]: the key each held until now."""
        device = self._touched.device
        slots, before = slots.to(device), before.to(device)
        index = torch.where(slots >= 0, slots, self._touched.numel() - 1)
        first = ~self._touched[index]
        self._base.index_copy_(0, index, torch.where(first, before, self._base[index]))
        self._touched.index_fill_(0, index, True)

    def remap(self, remap: torch.Tensor, capacity: int) -> None:
        """The tier grew to ``capacity`` slots: old slot ``s`` is now ``remap[s]``."""
        touched, base = self.touched, self._base[:-1]
        remap = remap.to(touched.device)
        moved = touched & (remap >= 0)
        self._lost.add(torch.where(touched & ~moved, base, EMPTY_KEY))
        index = torch.where(moved, remap, capacity)
        self._touched = torch.zeros(capacity + 1, dtype=torch.bool, device=touched.device)
        self._touched.index_fill_(0, index, True)
        self._touched[-1] = False
        self._base = torch.full((capacity + 1,), EMPTY_KEY, dtype=torch.int64,
                                device=touched.device)
        self._base.index_copy_(0, index, base)

    def left_keys(self) -> torch.Tensor:
        """Distinct keys that may have left the tier since the dump (sorted): the base keys
        of the touched slots; the caller keeps those no longer in the tier."""
        keys = torch.cat([self._base[:-1][self.touched], self._lost.keys().to(
            self._base.device)])
        return torch.unique(keys[(keys != EMPTY_KEY) & (keys != TOMBSTONE_KEY)])


class ChangeTracker:
    """What changed in one table since dump ``dump_id`` (see the module docstring).

    ``generation`` is the owning collection's checkpoint-load count at that dump: a load
    since then (``load_state_dict``) makes the record meaningless, and an incremental dump
    checks it."""

    def __init__(self, table, dump_id: str, generation: int):
        self.dump_id = dump_id
        self.generation = generation
        self._tiers = [(tier, name, TierChanges(tier.hash.capacity, tier.device))
                       for name, tier in table.tracked_tiers()]
        #: keys whose CACHE store rows were written since the dump
        self.stored = KeyLog()
        #: the ``store_evictions`` counter at the dump (CACHE)
        self.store_evictions = table.counters.snapshot()["store_evictions"]
        #: keys expired from the CACHE store since the dump
        self.store_erased = False

    def fits(self, table) -> bool:
        """The tracker follows ``table``'s tiers at their current capacities."""
        tiers = [tier for _, tier in table.tracked_tiers()]
        return len(tiers) == len(self._tiers) and all(
            t is mine and c.capacity == t.hash.capacity
            for t, (mine, _, c) in zip(tiers, self._tiers))

    def restart(self, table, dump_id: str, generation: int) -> None:
        """Start over from dump ``dump_id``: nothing changed yet."""
        self.dump_id, self.generation = dump_id, generation
        for _, _, changes in self._tiers:
            changes.clear()
        self.stored = KeyLog()
        self.store_evictions = table.counters.snapshot()["store_evictions"]
        self.store_erased = False

    def tier(self, name: str) -> Optional[TierChanges]:
        """The changes of tier ``name`` (one of the table's ``tracked_tiers``), None if
        untracked."""
        return next((c for _, n, c in self._tiers if n == name), None)

    def _of(self, tier) -> TierChanges:
        return next(c for t, _, c in self._tiers if t is tier)

    # -- hooks (called by the table) -----------------------------------------------------------
    def claimed(self, tier, result) -> None:
        # a slot found holds its key; a slot inserted into held previous_keys
        before = torch.where(result.inserted, result.previous_keys, result.keys)
        self._of(tier).mark(result.slots, before)

    def remapped(self, tier, remap: torch.Tensor) -> None:
        self._of(tier).remap(remap, tier.hash.capacity)

    def updated(self, batch) -> None:
        """A backward updated the batch's rows (their keys stay: the slots' keys now)."""
        for (tier, _, changes), slots in zip(self._tiers, (batch.slots, batch.host_slots)):
            if slots is not None:
                changes.mark(slots, tier.hash.keys_at(slots.to(tier.device)))

    def written_back(self, keys: torch.Tensor) -> None:
        self.stored.add(keys)

    def erased(self, tier, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """``keys`` were erased from ``tier``'s ``slots`` (expiry)."""
        self._of(tier).mark(slots, keys)


def start_tracking(tables: Dict[str, object], dump_id: str, generation: int) -> None:
    """Attach a fresh :class:`ChangeTracker` to every table (after a dump or a load); a
    table's previous one is cleared in place when its tiers kept their capacities (no new
    memory to touch)."""
    for table in tables.values():
        previous = table.changes
        if previous is not None and previous.fits(table):
            previous.restart(table, dump_id, generation)
        else:
            table.changes = ChangeTracker(table, dump_id, generation)
