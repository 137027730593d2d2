"""Public enums, result types and limits of the hash table."""
from __future__ import annotations

import enum
from typing import NamedTuple, Optional, Tuple

import torch

from dynemb.backends import protocol as codes
from dynemb.backends.protocol import EMPTY_KEY, TOMBSTONE_KEY

#: Reserved int64 keys (``EMPTY_KEY``, ``TOMBSTONE_KEY``): the table rejects them (they mark
#: empty and erased slots).
RESERVED_KEYS = (EMPTY_KEY, TOMBSTONE_KEY)

#: Largest bucket of a hash table (slots; buckets are powers of two up to it): the CUDA insert
#: kernel tracks the slots of a bucket in two 64-bit masks.
MAX_BUCKET_SIZE = codes.MAX_BUCKET_SIZE

#: dtypes a table's rows can have (optimizer state is float32 whatever the row dtype).
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class ScorePolicy(enum.Enum):
    """How a slot's score is set. Larger score = more worth keeping; eviction takes the lowest.

    The table's clock advances by one at every ``find_or_insert`` and every
    ``find(..., update_scores=True)`` call (one call per batch, i.e. per training step).

    - ``LRU``: score = clock at insertion and at every scored hit (recency).
    - ``LFU``: score = number of occurrences seen (a batch adds its occurrence count).
    - ``STEP``: score = clock at insertion, unchanged by hits (age: oldest goes first).
    - ``CUSTOMIZED``: the caller passes the scores; a hit sets the score to the given value.
      Duplicates of a key in one batch take the largest given score. The modules take one
      score per table and training batch (``set_scores``).
    - ``NO_EVICTION``: scores are unused; a key whose bucket is full is not inserted and is
      reported as failed.
    - ``LFU_LRU``: frequency first, recency breaks ties: score = ``count << 40 | clock``, the
      number of occurrences seen (as LFU) in the high 23 bits and the clock of the latest use
      (as LRU) in the low 40 (:func:`pack_lfu_lru` / :func:`unpack_lfu_lru`). Both parts
      saturate (count at ``2**23 - 1``, clock at ``2**40 - 1``) and never wrap.
    """

    LRU = "lru"
    LFU = "lfu"
    STEP = "step"
    CUSTOMIZED = "customized"
    NO_EVICTION = "no_eviction"
    LFU_LRU = "lfu_lru"

    @property
    def code(self) -> int:
        return _POLICY_CODES[self]


_POLICY_CODES = {
    ScorePolicy.LRU: codes.POLICY_LRU,
    ScorePolicy.LFU: codes.POLICY_LFU,
    ScorePolicy.STEP: codes.POLICY_STEP,
    ScorePolicy.CUSTOMIZED: codes.POLICY_CUSTOMIZED,
    ScorePolicy.NO_EVICTION: codes.POLICY_NO_EVICTION,
    ScorePolicy.LFU_LRU: codes.POLICY_LFU_LRU,
}

#: Bits of an LFU_LRU score that hold the clock (the count is above them), and the largest
#: count and clock it records (larger ones saturate).
LFU_LRU_CLOCK_BITS = codes.LFU_LRU_CLOCK_BITS
LFU_LRU_MAX_COUNT = codes.LFU_LRU_MAX_COUNT
LFU_LRU_MAX_CLOCK = codes.LFU_LRU_MAX_CLOCK


def pack_lfu_lru(counts: torch.Tensor, clocks: torch.Tensor) -> torch.Tensor:
    """LFU_LRU scores (int64) of keys used ``counts`` times, the last time at ``clocks``
    (both int64 tensors, broadcast; each part saturated to its bits).

    Example::

        >>> pack_lfu_lru(torch.tensor([3]), torch.tensor([17])).tolist()  # 3 << 40 | 17
        [3298534883345]
    """
    counts = counts.to(torch.int64).clamp(0, LFU_LRU_MAX_COUNT)
    clocks = clocks.to(torch.int64).clamp(0, LFU_LRU_MAX_CLOCK)
    return (counts << LFU_LRU_CLOCK_BITS) | clocks


def unpack_lfu_lru(scores: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(counts, clocks)`` of LFU_LRU ``scores``: e.g. the keys of a dump used at or after
    table clock ``t`` are those with ``unpack_lfu_lru(scores)[1] >= t``.

    Example::

        >>> counts, clocks = unpack_lfu_lru(torch.tensor([3298534883345]))
        >>> counts.tolist(), clocks.tolist()
        ([3], [17])
    """
    scores = scores.to(torch.int64).clamp(min=0)
    return scores >> LFU_LRU_CLOCK_BITS, scores & LFU_LRU_MAX_CLOCK


class FindOrInsertResult(NamedTuple):
    """Outcome of ``ScoredHashTable.find_or_insert``, one entry per *unique* key.

    Shapes: ``U`` unique keys, ``N`` input keys.

    - ``keys`` [U]: the unique keys; ``inverse`` [N]: ``keys[inverse] == input``.
    - ``slots`` [U]: the slot of each key, -1 where ``failed``.
    - ``inserted`` [U]: the key was not in the table and now has a slot.
    - ``previous_keys`` / ``previous_scores`` [U]: what the slot held before an insert;
      a live key there was evicted (see ``evicted``): write its row back before reusing it.
    - ``failed`` [U]: no slot could be found (bucket full of pinned slots, or NO_EVICTION).
    - ``remap`` [old capacity] or None: set when the table grew during the call; row
      ``remap[s]`` of the new table holds what row ``s`` held (-1: empty).
    """

    keys: torch.Tensor
    inverse: torch.Tensor
    slots: torch.Tensor
    inserted: torch.Tensor
    previous_keys: torch.Tensor
    previous_scores: torch.Tensor
    failed: torch.Tensor
    remap: Optional[torch.Tensor]

    @property
    def evicted(self) -> torch.Tensor:
        """[U] bool: the insert of ``keys[i]`` displaced the live key ``previous_keys[i]``."""
        return self.inserted & (self.previous_keys != EMPTY_KEY) & (
            self.previous_keys != TOMBSTONE_KEY)

    @property
    def input_slots(self) -> torch.Tensor:
        """[N]: the slot of every input key, duplicates included."""
        return self.slots[self.inverse]


class EraseResult(NamedTuple):
    """Per input key: ``erased`` (it was removed) and ``pinned`` (found but kept: pinned)."""

    erased: torch.Tensor
    pinned: torch.Tensor


class ExportBatch(NamedTuple):
    """Live entries of slots ``[start, next_start)``, in slot order."""

    keys: torch.Tensor
    slots: torch.Tensor
    scores: torch.Tensor
    next_start: int


class TableFullError(RuntimeError):
    """Some keys found no slot. The table is as it was before the call, except that it may
    have grown: ``remap`` (or None) then maps old slots to new ones, as in
    ``FindOrInsertResult.remap``. ``failed_keys`` lists the keys that found no slot."""

    def __init__(self, message: str, failed_keys: torch.Tensor, remap: Optional[torch.Tensor]):
        super().__init__(message)
        self.failed_keys = failed_keys
        self.remap = remap
