"""Pure-Python model of ScoredHashTable: the oracle of the property-based tests.

It re-implements the hash (murmur3 finalizer, multiply-shift bucket) with Python integers, and
keeps, per live key, its bucket, score and pin count. Slot positions inside a bucket and the
choice among equal-score victims are the table's business: the model checks that each choice
is allowed and then adopts it.

:meth:`ModelTable.claim` states a whole ``find_or_insert`` by the rules alone (no slots), for
the model of a table group (:mod:`group_model`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
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


@lru_cache(maxsize=1 << 16)
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
    #: growth (of :meth:`claim`): the load factor a claim may not pass, and the largest size
    grow_at: Optional[float] = None
    max_capacity: Optional[int] = None

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

    def restored_score(self, new: int, stored: int) -> int:
        """The score of a key that came back (a CACHE load) scoring ``new`` on insertion,
        ``stored`` when it left: LFU adds the counts (LFU_LRU its count parts, keeping the
        new last use), STEP takes back the insertion step, the others keep ``new``."""
        if self.policy == "lfu":
            return new + stored
        if self.policy == "lfu_lru":
            return lfu_lru(new // 2**40 + stored // 2**40, new % 2**40)
        return stored if self.policy == "step" else new

    def grow(self, num_buckets: int, remap: List[int]) -> None:
        self.num_buckets = num_buckets
        for e in self.entries.values():
            e.slot = remap[e.slot]

    def live_triples(self) -> set:
        return {(k, e.slot, e.score) for k, e in self.entries.items()}

    # -- a whole claim by the rules, without slots ----------------------------------------------
    def by_bucket(self) -> Dict[int, List[int]]:
        """The live keys of each bucket that holds some."""
        out: Dict[int, List[int]] = {}
        for k in self.entries:
            out.setdefault(bucket_of(k, self.num_buckets), []).append(k)
        return out

    def candidates(self, members: List[int], batch) -> List[int]:
        """Of a bucket's live keys ``members``, those a new key may evict: unpinned and not
        of the call's ``batch`` (no key the call found or claimed); none under NO_EVICTION."""
        if self.policy == "no_eviction":
            return []
        return [k for k in members if self.entries[k].pins == 0 and k not in batch]

    def missing_by_bucket(self, keys) -> Dict[int, List[int]]:
        """The keys of ``keys`` the table lacks, unique, by bucket."""
        out: Dict[int, List[int]] = {}
        for k in dict.fromkeys(keys):
            if k not in self.entries:
                out.setdefault(bucket_of(k, self.num_buckets), []).append(k)
        return out

    def overflowing(self, keys) -> set:
        """The buckets where a claim of ``keys`` would leave a new key without a slot."""
        batch, members = set(keys), self.by_bucket()
        out = set()
        for b, new in self.missing_by_bucket(keys).items():
            live = members.get(b, [])
            if len(new) > self.bucket_size - len(live) + len(self.candidates(live, batch)):
                out.add(b)
        return out

    @property
    def capacity(self) -> int:
        return self.num_buckets * self.bucket_size

    def grow_for(self, keys) -> None:
        """A table that grows (``grow_at``) grows before a claim of ``keys``: to the
        smallest doubling that keeps its keys and the missing ones at most ``grow_at`` of its
        slots; then, while the claim would evict a key or leave one without a slot, by one
        doubling; never past ``max_capacity`` (in whole buckets)."""
        if self.grow_at is None:
            return
        missing = self.missing_by_bucket(keys)
        after = len(self.entries) + sum(map(len, missing.values()))
        if after > self.grow_at * self.capacity:
            self._double_to(int(after / self.grow_at) + 1)
        while self._displaces(keys) and self._double_to(self.capacity + 1):
            pass

    def _displaces(self, keys) -> bool:
        members = self.by_bucket()
        return any(len(new) > self.bucket_size - len(members.get(b, []))
                   for b, new in self.missing_by_bucket(keys).items())

    def _double_to(self, needed: int) -> bool:
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        capacity = min(capacity, self.max_capacity // self.bucket_size * self.bucket_size)
        if capacity <= self.capacity:
            return False
        self.num_buckets = capacity // self.bucket_size
        return True

    def claim(self, keys, given: int = 0, pin: bool = True) -> "Claim":
        """One ``find_or_insert`` of the batch ``keys`` (duplicates allowed; ``given``: the
        CUSTOMIZED score of each) at the table's next clock: hits rescored, new keys scored
        at insertion, each full bucket evicting its lowest-score candidates
        (:meth:`candidates`), every key of the batch pinned when ``pin``; a table that grows
        grows first (:meth:`grow_for`). A batch some bucket cannot take raises
        :class:`ModelFull` and changes nothing (but growth)."""
        self.grow_for(keys)
        full = self.overflowing(keys)
        if full:
            raise ModelFull(full)
        counts, _ = batch_stats(keys, None)
        batch = set(counts)
        missing = self.missing_by_bucket(keys)
        self.clock += 1
        hits = [k for k in counts if k in self.entries]
        for k in hits:
            e = self.entries[k]
            e.score = self.hit_score(e.score, counts[k], given)
        evicted: Dict[int, int] = {}
        ties: List[tuple] = []
        members = self.by_bucket()
        for b, new in missing.items():
            live = members.get(b, [])
            need = len(new) - (self.bucket_size - len(live))
            if need <= 0:
                continue
            ranked = sorted(self.candidates(live, batch), key=lambda k: self.entries[k].score)
            boundary = self.entries[ranked[need - 1]].score
            sure = [k for k in ranked if self.entries[k].score < boundary]
            tied = [k for k in ranked if self.entries[k].score == boundary]
            if len(sure) + len(tied) == need:
                sure += tied
            else:
                ties.append((tied, need - len(sure)))
            evicted.update((k, self.entries[k].score) for k in sure)
        for k in evicted:
            del self.entries[k]
        inserted = [k for new in missing.values() for k in new]
        for k in inserted:
            self.entries[k] = Entry(-1, self.insert_score(counts[k], given))
        if pin:
            for k in batch:
                self.entries[k].pins += 1
        return Claim(hits, inserted, evicted, ties)

    def settle(self, claim: "Claim", held) -> Dict[int, int]:
        """Adopt the table's choice among the equal-score victims of ``claim`` once it is
        checked: of each tie, exactly as many keys as the rules evict are missing from
        ``held`` (the keys the table holds after the call). Returns those keys, with their
        scores; ``claim.evicted`` then holds every victim."""
        chosen: Dict[int, int] = {}
        for tied, n in claim.ties:
            gone = [k for k in tied if k not in held]
            assert len(gone) == n, (f"a full bucket had to evict {n} of the keys of equal "
                                    f"lowest score {tied}; the table evicted {gone}")
            chosen.update((k, self.entries[k].score) for k in gone)
        for k in chosen:
            del self.entries[k]
        claim.evicted.update(chosen)
        claim.ties = []
        return chosen

    def unpin(self, keys) -> None:
        """End one pin of each key of ``keys`` (unique)."""
        for k in set(keys):
            self.entries[k].pins -= 1

    def scores(self) -> Dict[int, int]:
        return {k: e.score for k, e in self.entries.items()}


@dataclass
class Claim:
    """What :meth:`ModelTable.claim` did: the batch's unique keys found (``hits``) and given
    a slot (``inserted``), the keys evicted (``evicted``: key -> its score then) and, where a
    full bucket's lowest candidates share a score, ``ties``: (those keys, how many go), for
    :meth:`ModelTable.settle`."""

    hits: List[int]
    inserted: List[int]
    evicted: Dict[int, int]
    ties: List[tuple]


class ModelFull(Exception):
    """A claim in which some bucket has more new keys than free slots and candidates."""

    def __init__(self, buckets):
        super().__init__(f"buckets {sorted(buckets)} cannot take their new keys")
        self.buckets = buckets


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
