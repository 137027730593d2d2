"""``HashTableImages``: the part of :class:`~dynemb.hash_table.ScoredHashTable` that deals
with its slot arrays as a whole: where they live (a table group's views, see
:mod:`dynemb.tables.groups`), their image for checkpoints, loads that never evict, and the
reset to empty."""
from __future__ import annotations

from typing import Optional

import torch

from dynemb.kernel_backend import TableArrays
from dynemb.types import (EMPTY_KEY, TOMBSTONE_KEY, FindOrInsertResult, ScorePolicy,
                          TableFullError, pack_lfu_lru, unpack_lfu_lru)
from dynemb.validation import check_index_tensor, check_keys


class HashTableImages:
    """Where a :class:`~dynemb.hash_table.ScoredHashTable`'s arrays live, their checkpoint
    images and loads (its base class; the methods use the table's arrays, clock and insert
    path)."""

    @property
    def arrays(self) -> TableArrays:
        """The arrays the kernels take (replaced as a whole by :meth:`grow` and
        :meth:`use_storage`)."""
        return self._arrays

    def use_storage(self, arrays: TableArrays) -> None:
        """Copy the table into ``arrays`` (of the same capacity and bucket size, e.g. views
        of a table group's arrays, :mod:`dynemb.tables.groups`) and keep it there."""
        old = self._arrays
        if (arrays.capacity, arrays.bucket_size) != (old.capacity, old.bucket_size):
            raise ValueError(f"storage of {arrays.capacity} slots in buckets of "
                             f"{arrays.bucket_size} cannot hold a table of {old.capacity} in "
                             f"buckets of {old.bucket_size}")
        for new, now in zip(arrays[:4], old[:4]):
            if new.data_ptr() != now.data_ptr():
                new.copy_(now)
        self._arrays = arrays

    def tick(self) -> int:
        """Advance the clock for one scoring call made on :attr:`arrays` by its owner (a
        table group's claim) and return it; that call cannot be undone."""
        self._undoable = None
        self._clock += 1
        return self._clock

    def untick(self) -> None:
        """Take back the latest :meth:`tick` (its call was rolled back)."""
        self._clock -= 1

    def image(self):
        """``(keys, scores)``: the table's own slot arrays (views, not copies): slot ``s``
        holds ``keys[s]`` (``EMPTY_KEY`` / ``TOMBSTONE_KEY`` when free) with ``scores[s]``.
        What a checkpoint saves; :meth:`load_image` puts it back."""
        return self._arrays.keys, self._arrays.scores

    def load_image(self, keys: torch.Tensor, scores: torch.Tensor, clock: int) -> None:
        """Make the table exactly the one whose :meth:`image` is ``(keys, scores)`` and whose
        :attr:`clock` was ``clock``: same capacity, every key in its saved slot, no pins.

        Example::

            >>> from dynemb.hash_table import ScoredHashTable
            >>> table = ScoredHashTable(256)
            >>> _ = table.find_or_insert(torch.tensor([3, 4]))
            >>> keys, scores = (t.clone() for t in table.image())
            >>> copy = ScoredHashTable(256)
            >>> copy.load_image(keys, scores, table.clock)
            >>> bool((copy.find(torch.tensor([3, 4])) == table.find(torch.tensor([3, 4]))).all())
            True
        """
        for name, t in (("keys", keys), ("scores", scores)):
            if t.dtype != torch.int64 or t.shape != (self.capacity,):
                raise ValueError(f"{name} must be int64 of shape [{self.capacity}] (one entry "
                                 f"per slot), got {t.dtype} {tuple(t.shape)}")
        arrays = self._arrays
        if keys.data_ptr() != arrays.keys.data_ptr():
            arrays.keys.copy_(keys)
        if scores.data_ptr() != arrays.scores.data_ptr():
            arrays.scores.copy_(scores)
        arrays.refcnt.zero_()
        arrays.size.copy_(((arrays.keys != EMPTY_KEY) & (arrays.keys != TOMBSTONE_KEY)).sum())
        self._clock = int(clock)
        self._undoable = None

    def load_entries(self, keys: torch.Tensor, scores: torch.Tensor) -> FindOrInsertResult:
        """Insert distinct ``keys`` with exactly ``scores`` whatever the policy (a key stored
        already takes the given score), **never evicting**: for loading a checkpoint, where a
        lost key would be a lost row. Grows as allowed; if some key still finds no slot the
        table is unchanged (apart from growth) and :class:`TableFullError` is raised. Nothing
        is pinned. Returns the result (``slots``, ``inserted``, ``remap``).

        Example::

            >>> from dynemb.hash_table import ScoredHashTable
            >>> table = ScoredHashTable(256, policy=ScorePolicy.LFU)
            >>> slots = table.load_entries(torch.tensor([9, 5]), torch.tensor([40, 2])).slots
            >>> table.scores_at(slots).tolist()
            [40, 2]
        """
        check_keys(keys, self.device, kernels=self.kernels)
        check_index_tensor(scores, "scores", self.device)
        if scores.shape != keys.shape:
            raise ValueError(f"scores has shape {tuple(scores.shape)} but keys has "
                             f"{tuple(keys.shape)}")
        if torch.unique(keys).numel() != keys.numel():
            raise ValueError("keys must be distinct (one entry per key)")
        self._undoable = None
        counts = keys.new_ones(1).expand(keys.shape)
        remap = self._grow_for(keys) if self.grow_at_load_factor is not None else None
        while True:
            slots, inserted, prev_keys, prev_scores, failed, stats = self._find_or_insert_once(
                keys, counts, scores, False, ScorePolicy.CUSTOMIZED, allow_evict=False)
            self._clock -= 1  # loading is no scoring call
            if not bool(stats[0]):
                break
            self._clock += 1  # _rollback steps the clock back
            self._rollback(slots, inserted, prev_keys, prev_scores, pinned=False)
            new_capacity = self._next_capacity(self.capacity + 1)
            if new_capacity is None:
                raise TableFullError(
                    f"{int(stats[0])} of {keys.numel()} keys found no free slot (capacity "
                    f"{self.capacity}, size {self.size()}, buckets of {self.bucket_size}); "
                    f"nothing was inserted", keys[failed], remap)
            remap = compose_remaps(remap, self.grow(new_capacity))
        return FindOrInsertResult(keys, torch.arange(keys.numel(), device=self.device), slots,
                                  inserted, prev_keys, prev_scores, failed, remap)

    def reset(self) -> None:
        """Empty the table in place: every slot free (no key, score 0, no pin), size 0, clock
        back to 0. The capacity stays (a grown table keeps its slots); the arrays are the same
        tensors (views from :meth:`image` see the empty table). Pins end with their keys: a
        caller holding slots from before must drop them.

        Example::

            >>> from dynemb.hash_table import ScoredHashTable
            >>> table = ScoredHashTable(1024)
            >>> slots = table.find_or_insert(torch.tensor([7, 9]), pin=True).slots
            >>> table.reset()
            >>> table.size(), table.clock, table.pinned_count()
            (0, 0, 0)
            >>> table.find(torch.tensor([7])).tolist()
            [-1]
        """
        arrays = self._arrays
        arrays.keys.fill_(EMPTY_KEY)
        arrays.scores.zero_()
        arrays.refcnt.zero_()
        arrays.size.zero_()
        self._clock = 0
        self._undoable = None

    def set_clock(self, clock: int) -> None:
        """Advance the clock to at least ``clock`` (after loading scores of a later clock)."""
        self._clock = max(self._clock, int(clock))


def compose_remaps(first: Optional[torch.Tensor], then: torch.Tensor) -> torch.Tensor:
    """Remap of two successive growths (``first`` may be None)."""
    if first is None:
        return then
    out = first.clone()
    live = first >= 0
    out[live] = then[first[live]]
    return out


def restore_scores_at(table_scores: torch.Tensor, policy: ScorePolicy, slots: torch.Tensor,
                      scores: torch.Tensor) -> None:
    """:meth:`~dynemb.hash_table.ScoredHashTable.restore_scores` on a score array
    ``table_scores`` (a table's, or a table group's holding several tables of one
    ``policy``), unchecked."""
    if policy is ScorePolicy.LFU:
        table_scores.index_add_(0, slots, scores)
    elif policy is ScorePolicy.LFU_LRU:  # counts add up, the new last use stays
        counts, clocks = unpack_lfu_lru(table_scores[slots])
        table_scores.index_copy_(0, slots, pack_lfu_lru(counts + unpack_lfu_lru(scores)[0],
                                                        clocks))
    elif policy is ScorePolicy.STEP:
        table_scores.index_copy_(0, slots, scores)
