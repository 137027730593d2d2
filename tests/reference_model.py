"""Pure-Python model of ScoredHashTable: the oracle of the property-based tests.

It re-implements the hash (murmur3 finalizer, multiply-shift bucket) with Python integers, and
keeps, per live key, its bucket, score and pin count. Slot positions inside a bucket and the
choice among equal-score victims are the table's business: the model checks that each choice
is allowed and then adopts it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

M64 = (1 << 64) - 1


def mix64(x: int) -> int:
    x &= M64
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & M64
    x ^= x >> 33
    return x


def bucket_of(key: int, num_buckets: int) -> int:
    return ((mix64(key) >> 32) * num_buckets) >> 32


@dataclass
class Entry:
    slot: int
    score: int
    pins: int = 0


@dataclass
class ModelTable:
    """Live set of the table as the model expects it."""

    num_buckets: int
    bucket_size: int
    policy: str  # ScorePolicy value: "lru", "lfu", "step", "customized", "no_eviction",
    #              "lfu_lru"
    entries: Dict[int, Entry] = field(default_factory=dict)
    clock: int = 0

    def slot_range(self, key: int) -> range:
        b = bucket_of(key, self.num_buckets)
        return range(b * self.bucket_size, (b + 1) * self.bucket_size)

    # score rules, stated independently of the kernels
    def insert_score(self, count: int, given: int) -> int:
        return {"lru": self.clock, "step": self.clock, "lfu": count, "customized": given,
                "no_eviction": 0, "lfu_lru": lfu_lru(count, self.clock)}[self.policy]

    def hit_score(self, old: int, count: int, given: int) -> int:
        return {"lru": self.clock, "step": old, "lfu": old + count, "customized": given,
                "no_eviction": old,
                "lfu_lru": lfu_lru(old // 2**40 + count, self.clock)}[self.policy]

    def grow(self, num_buckets: int, remap: List[int]) -> None:
        self.num_buckets = num_buckets
        for e in self.entries.values():
            e.slot = remap[e.slot]

    def live_triples(self) -> set:
        return {(k, e.slot, e.score) for k, e in self.entries.items()}


def lfu_lru(count: int, clock: int) -> int:
    """The LFU_LRU score: the count times 2**40 plus the clock, each capped (23 and 40 bits)."""
    return min(count, 2**23 - 1) * 2**40 + min(clock, 2**40 - 1)


def batch_stats(keys: Iterable[int], scores: Optional[Iterable[int]]):
    """Per unique key: (occurrence count, largest given score)."""
    counts: Dict[int, int] = {}
    given: Dict[int, int] = {}
    scores = list(scores) if scores is not None else None
    for i, k in enumerate(keys):
        counts[k] = counts.get(k, 0) + 1
        if scores is not None:
            given[k] = max(given.get(k, scores[i]), scores[i])
    return counts, given
