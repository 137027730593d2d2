"""``ScoredHashTable``: raw int64 keys -> slots of a flat value table, with scores and pins."""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from dynemb.backends import backend_for_device
from dynemb.types import (EMPTY_KEY, MAX_BUCKET_SIZE, TOMBSTONE_KEY, EraseResult, ExportBatch,
                          FindOrInsertResult, ScorePolicy, TableFullError)
from dynemb.validation import (check_bucket_size, check_index_tensor, check_int, check_keys,
                               check_same_length, check_slots)

_ON_FAILURE = ("raise", "report", "defer")

#: Most buckets of one table: a key's bucket is (32 hash bits x buckets) >> 32 in int64.
MAX_BUCKETS = 2**31 - 1
#: Bytes of one slot: an int64 key, an int64 score and an int32 pin count.
SLOT_BYTES = 8 + 8 + 4


def max_table_capacity(bucket_size: int = MAX_BUCKET_SIZE) -> int:
    """Most slots one table with buckets of ``bucket_size`` can have.

    Example::

        >>> max_table_capacity(128)
        274877906816
    """
    return MAX_BUCKETS * bucket_size


class ScoredHashTable:
    """A bucketed open-addressing hash table from int64 keys to slots ``[0, capacity)``.

    Slot ``s`` is row ``s`` of the caller's flat value tables; the table stores per slot only
    the key, a score (see :class:`ScorePolicy`) and a reference count. A key lives in one bucket
    of ``bucket_size`` slots chosen by its hash and is probed linearly inside it. When the
    bucket is full, inserting evicts the unpinned slot with the lowest score (ties: the first in
    probe order on CPU, any of them on CUDA); slots inserted or hit by the same call are never
    victims. A pinned slot (reference count > 0) is never evicted or erased.

    Args:
        capacity: number of slots; a positive multiple of ``bucket_size`` (with the default
            bucket size: a power of two below ``MAX_BUCKET_SIZE`` (128), else a multiple of it).
        bucket_size: slots per bucket, a power of two <= ``MAX_BUCKET_SIZE`` (default:
            ``MAX_BUCKET_SIZE``, or ``capacity`` when that is smaller).
        policy: the score policy.
        device: where the table lives; picks the CPU or CUDA kernels.
        grow_at_load_factor: grow (doubling) before an insert would pass this load factor, or
            when a key finds no slot, as long as ``max_capacity`` allows. None: never grow by
            itself.
        max_capacity: upper bound for growth (default: unbounded when growth is on).
        backend: "cpu" or "cuda" to override the choice by device (the CUDA simulator runs the
            "cuda" backend on CPU tensors).

    Example::

        >>> table = ScoredHashTable(1024, policy=ScorePolicy.LRU)
        >>> result = table.find_or_insert(torch.tensor([7, 42, 7]))
        >>> result.keys.tolist(), result.inserted.tolist()
        ([7, 42], [True, True])
        >>> bool((table.find(torch.tensor([42, 5])) == torch.stack([result.slots[1], torch.tensor(-1)])).all())
        True
        >>> table.size()
        2
    """

    def __init__(self, capacity: int, *, bucket_size: Optional[int] = None,
                 policy: ScorePolicy = ScorePolicy.LRU, device=None,
                 grow_at_load_factor: Optional[float] = None,
                 max_capacity: Optional[int] = None, backend: Optional[str] = None):
        check_int(capacity, "capacity")
        if bucket_size is None:
            _check_capacity_for_default_buckets(capacity)
            bucket_size = min(MAX_BUCKET_SIZE, capacity)
        check_bucket_size(bucket_size)
        if capacity % bucket_size:
            raise ValueError(f"capacity must be a multiple of bucket_size ({bucket_size}), got "
                             f"{capacity}; nearest valid: "
                             f"{max(bucket_size, capacity // bucket_size * bucket_size)}")
        for name, rows in (("capacity", capacity), ("max_capacity", max_capacity)):
            if rows is not None and rows > max_table_capacity(bucket_size):
                raise ValueError(_too_many_slots(name, rows, bucket_size))
        if not isinstance(policy, ScorePolicy):
            raise TypeError(f"policy must be a ScorePolicy, got {policy!r}")
        if grow_at_load_factor is not None and not 0.0 < grow_at_load_factor <= 1.0:
            raise ValueError(f"grow_at_load_factor must be in (0, 1], got {grow_at_load_factor}")
        if max_capacity is not None:
            check_int(max_capacity, "max_capacity")
            if max_capacity < capacity:
                raise ValueError(f"max_capacity ({max_capacity}) is below capacity ({capacity})")
        self.device = torch.device(device if device is not None else "cpu")
        self._backend = backend_for_device(self.device, backend)
        self.policy = policy
        self.bucket_size = bucket_size
        self.grow_at_load_factor = grow_at_load_factor
        self.max_capacity = max_capacity
        self._clock = 0
        # the slots of the call undo() may revert, by weak reference (no memory held for it)
        self._undoable: Optional[weakref.ref] = None
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self._keys, self._scores, self._refcnt = self._empty_arrays(capacity)
        self._size = torch.zeros(1, dtype=torch.int64, device=self.device)

    def _empty_arrays(self, capacity: int):
        dev = self.device
        return (torch.full((capacity,), EMPTY_KEY, dtype=torch.int64, device=dev),
                torch.zeros(capacity, dtype=torch.int64, device=dev),
                torch.zeros(capacity, dtype=torch.int32, device=dev))

    # -- sizes -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._keys.numel()

    @property
    def num_buckets(self) -> int:
        return self.capacity // self.bucket_size

    @property
    def clock(self) -> int:
        """Calls that updated scores so far (the LRU/STEP score of the latest call)."""
        return self._clock

    def size(self) -> int:
        """Number of live keys (synchronizes with the device on CUDA)."""
        return int(self._size.item())

    def load_factor(self) -> float:
        return self.size() / self.capacity

    def scores_at(self, slots: torch.Tensor) -> torch.Tensor:
        """Current scores of ``slots`` (-1 entries give 0)."""
        check_index_tensor(slots, "slots", self.device)
        return torch.where(slots >= 0, self._scores[slots.clamp(min=0)], 0)

    def keys_at(self, slots: torch.Tensor) -> torch.Tensor:
        """Keys stored at ``slots`` (``EMPTY_KEY`` for -1 entries and free slots); no host
        sync, no checks beyond the dtype: for slot indices this table returned."""
        keys = self._keys[slots.clamp(min=0)]
        return torch.where(slots >= 0, keys, EMPTY_KEY)

    def nbytes(self) -> int:
        """Bytes of the table's arrays (keys, scores, reference counts, size)."""
        return sum(t.untyped_storage().nbytes()
                   for t in (self._keys, self._scores, self._refcnt, self._size))

    def pinned_count(self) -> int:
        """Number of slots with a reference count above zero."""
        return int((self._refcnt > 0).sum().item())

    # -- lookups -----------------------------------------------------------------------------
    def find(self, keys: torch.Tensor, *, update_scores: bool = False,
             scores: Optional[torch.Tensor] = None, allow_padding: bool = False) -> torch.Tensor:
        """Slots of ``keys`` ([N] int64), -1 for keys not in the table.

        With ``update_scores`` hits get their score updated by the policy (and the clock
        advances); ``scores`` are the given scores for CUSTOMIZED. With ``allow_padding``
        (plain finds only), ``EMPTY_KEY`` entries are accepted and get -1.
        """
        if allow_padding and not update_scores:
            check_index_tensor(keys, "keys", self.device)
        else:
            check_keys(keys, self.device)
        self._check_scores(keys, scores, required=update_scores)
        out = torch.empty_like(keys)
        if not update_scores:
            self._backend.find(self._keys, self.num_buckets, self.bucket_size, keys, out)
            return out
        ukeys, inverse, counts, given = self._dedup(keys, scores, assume_unique=False)
        self._undoable = None
        self._clock += 1
        slots = torch.empty_like(ukeys)
        self._lookup_update(ukeys, counts, given, pin=False, slots=slots,
                            prev_scores=torch.empty_like(ukeys))
        return slots[inverse]

    def find_or_insert(self, keys: torch.Tensor, scores: Optional[torch.Tensor] = None, *,
                       pin: bool = False, on_failure: str = "raise",
                       assume_unique: bool = False,
                       counts: Optional[torch.Tensor] = None) -> FindOrInsertResult:
        """Find each key, inserting the missing ones (evicting by score when a bucket is full).

        Args:
            keys: [N] int64, duplicates allowed (they share one slot).
            scores: [N] int64, required by CUSTOMIZED and rejected by the other policies.
            pin: keep one pin on every returned slot (release it with :meth:`unpin`).
            on_failure: "raise" (default): if any key finds no slot, undo the call and raise
                :class:`TableFullError`; "report": keep what succeeded, flag the rest in
                ``failed``; "defer": like "report" but without growing on failure, so the call
                never waits for the device (read ``failed`` when convenient).
            assume_unique: the caller guarantees no duplicates (skips the dedup pass); with it,
                ``EMPTY_KEY`` entries are accepted as padding and get slot -1.
            counts: with ``assume_unique``, occurrences of each key (what LFU adds; default 1).

        The caller must write back the rows of ``result.evicted`` slots (their old keys are in
        ``previous_keys``) before overwriting them, and apply ``result.remap`` if the table grew.
        With ``pin``, :meth:`undo` can revert the call.
        """
        if assume_unique:
            check_index_tensor(keys, "keys", self.device)
        else:
            check_keys(keys, self.device)
        self._check_scores(keys, scores, required=self.policy is ScorePolicy.CUSTOMIZED)
        if on_failure not in _ON_FAILURE:
            raise ValueError(f"on_failure must be one of {_ON_FAILURE}, got {on_failure!r}")
        if counts is not None:
            if not assume_unique:
                raise ValueError("counts is only taken with assume_unique=True")
            check_index_tensor(counts, "counts", self.device)
            check_same_length(keys, "keys", counts, "counts")
        ukeys, inverse, dedup_counts, given = self._dedup(keys, scores, assume_unique)
        counts = dedup_counts if counts is None else counts
        self._undoable = None
        remap = self._grow_for(ukeys) if self.grow_at_load_factor is not None else None
        while True:
            attempt = self._find_or_insert_once(ukeys, counts, given)
            slots, hit, prev_keys, prev_scores, failed = attempt
            new_capacity = self._next_capacity(self.capacity + 1)
            if new_capacity is not None and self._evicted_any(slots, hit, prev_keys):
                # Below max_capacity a full bucket means "grow", never "forget a key".
                self._rollback(slots, hit, prev_keys, prev_scores)
                remap = _compose(remap, self.grow(new_capacity))
                continue
            if on_failure == "defer" or not bool(failed.any()):
                break
            if on_failure == "report" and new_capacity is None:
                break
            self._rollback(slots, hit, prev_keys, prev_scores)
            if new_capacity is None:
                raise TableFullError(
                    f"{int(failed.sum())} of {ukeys.numel()} keys found no slot: their buckets "
                    f"are full of pinned slots or the policy is NO_EVICTION "
                    f"(capacity {self.capacity}, size {self.size()}); the table is unchanged"
                    + ("" if remap is None else " except that it grew (see .remap)"),
                    ukeys[failed], remap)
            remap = _compose(remap, self.grow(new_capacity))
        if not pin:
            self._backend.add_refcounts(self._refcnt, slots, -1)
        self._undoable = weakref.ref(slots) if pin else None
        inserted = ~hit & (slots >= 0)
        return FindOrInsertResult(ukeys, inverse, slots, inserted, prev_keys, prev_scores, failed,
                                  remap)

    def undo(self, result: FindOrInsertResult) -> None:
        """Revert this table's latest ``find_or_insert(..., pin=True)`` from its ``result``.

        Keys, scores, size, clock and the call's pins are as they were before it; evicted keys
        are back in their slots (their rows are the caller's to keep intact). A growth during
        the call stays: the table keeps its new capacity. For a caller that claimed keys and
        then has to give the batch up (e.g. another table refused its share). Only the latest
        pinned call, only once, and only before any other scoring call or growth.

        Example::

            >>> result = table.find_or_insert(torch.tensor([3, 4]), pin=True)
            >>> table.undo(result)
            >>> table.find(torch.tensor([3, 4])).tolist()
            [-1, -1]
        """
        if not isinstance(result, FindOrInsertResult) or (
                self._undoable is None or result.slots is not self._undoable()):
            raise ValueError("undo takes the result of this table's latest "
                             "find_or_insert(pin=True), once, before any other scoring call or "
                             "growth")
        self._undoable = None
        hit = (result.slots >= 0) & ~result.inserted
        self._rollback(result.slots, hit, result.previous_keys, result.previous_scores)

    def restore_scores(self, slots: torch.Tensor, scores: torch.Tensor) -> None:
        """Give keys that came back to the table the scores they had when they left it.

        ``slots`` [N] (distinct, live) hold keys just re-inserted, ``scores`` [N] (int64) what
        those keys scored when they were evicted (``previous_scores``, e.g. kept by a backing
        store). By policy: LFU adds them to the new counts, STEP takes back the original
        insertion steps, LRU and CUSTOMIZED keep the new scores (the latest use, the caller's
        score), NO_EVICTION has none.

        Example::

            >>> table = ScoredHashTable(16, policy=ScorePolicy.LFU)
            >>> slots = table.find_or_insert(torch.tensor([7])).slots     # count 1
            >>> table.restore_scores(slots, torch.tensor([5]))            # it had 5 before
            >>> table.scores_at(slots).tolist()
            [6]
        """
        self._check_live_slots(slots, "slots")
        check_index_tensor(scores, "scores", self.device)
        if scores.shape != slots.shape:
            raise ValueError(f"scores has shape {tuple(scores.shape)} but slots has "
                             f"{tuple(slots.shape)}")
        if torch.unique(slots).numel() != slots.numel():
            raise ValueError("slots must be distinct (one score per key)")
        if self.policy is ScorePolicy.LFU:
            self._scores.index_add_(0, slots, scores)
        elif self.policy is ScorePolicy.STEP:
            self._scores.index_copy_(0, slots, scores)

    @staticmethod
    def _evicted_any(slots, hit, prev_keys) -> bool:
        inserted = ~hit & (slots >= 0)
        return bool((inserted & (prev_keys != EMPTY_KEY) & (prev_keys != TOMBSTONE_KEY)).any())

    def _find_or_insert_once(self, ukeys, counts, given):
        self._clock += 1
        slots = torch.empty_like(ukeys)
        prev_scores = torch.empty_like(ukeys)
        self._lookup_update(ukeys, counts, given, pin=True, slots=slots, prev_scores=prev_scores)
        hit = slots >= 0
        prev_keys = torch.empty_like(ukeys)
        failed = torch.empty(ukeys.shape, dtype=torch.bool, device=self.device)
        self._backend.insert_missing(
            self._keys, self._scores, self._refcnt, self._size, self.num_buckets,
            self.bucket_size, ukeys, counts, given, self.policy.code, self._clock,
            self.policy is not ScorePolicy.NO_EVICTION, slots, prev_keys, prev_scores, failed)
        return slots, hit, prev_keys, prev_scores, failed

    def _lookup_update(self, ukeys, counts, given, *, pin, slots, prev_scores) -> None:
        self._backend.lookup_update(self._keys, self._scores, self._refcnt, self.num_buckets,
                                    self.bucket_size, ukeys, counts, given, self.policy.code,
                                    self._clock, pin, slots, prev_scores)

    def _rollback(self, slots, hit, prev_keys, prev_scores) -> None:
        """Undo one ``_find_or_insert_once``: restore keys, scores, size, pins and clock."""
        placed = slots >= 0
        inserted = placed & ~hit
        ins_slots = slots[inserted]
        restored = prev_keys[inserted]
        self._keys[ins_slots] = restored
        self._size -= (restored == EMPTY_KEY).sum() + (restored == TOMBSTONE_KEY).sum()
        self._scores[slots[placed]] = prev_scores[placed]
        self._backend.add_refcounts(self._refcnt, slots, -1)
        self._clock -= 1

    def _dedup(self, keys, scores, assume_unique):
        if assume_unique:
            counts = torch.ones_like(keys)
            inverse = torch.arange(keys.numel(), device=self.device)
            given = scores if scores is not None else torch.zeros_like(keys)
            return keys, inverse, counts, given
        ukeys, inverse, counts = self._backend.dedup(keys)
        given = torch.zeros_like(ukeys)
        if scores is not None:
            given = given.fill_(torch.iinfo(torch.int64).min).scatter_reduce(
                0, inverse, scores, reduce="amax")
        return ukeys, inverse, counts, given

    def _check_scores(self, keys, scores, required: bool) -> None:
        custom = self.policy is ScorePolicy.CUSTOMIZED
        if scores is None:
            if custom and required:
                raise ValueError("scores are required by the CUSTOMIZED policy")
            return
        if not custom:
            raise ValueError(f"scores are only used by the CUSTOMIZED policy, this table uses "
                             f"{self.policy.name}")
        check_index_tensor(scores, "scores", self.device)
        check_same_length(keys, "keys", scores, "scores")

    # -- removal and pins --------------------------------------------------------------------
    def erase(self, keys: torch.Tensor, *, allow_padding: bool = False) -> EraseResult:
        """Remove ``keys``; pinned keys are kept and flagged in ``pinned``. With
        ``allow_padding``, ``EMPTY_KEY`` entries are skipped instead of rejected."""
        if allow_padding:
            check_index_tensor(keys, "keys", self.device)
        else:
            check_keys(keys, self.device)
        erased = torch.zeros(keys.shape, dtype=torch.bool, device=self.device)
        pinned = torch.zeros_like(erased)
        self._backend.erase(self._keys, self._scores, self._refcnt, self._size, self.num_buckets,
                            self.bucket_size, keys, erased, pinned)
        return EraseResult(erased, pinned)

    def pin(self, slots: torch.Tensor) -> None:
        """Add one reference to each slot (duplicates add one each); pinned slots stay put."""
        self._check_live_slots(slots, "slots")
        self._backend.add_refcounts(self._refcnt, slots, 1)

    def unpin(self, slots: torch.Tensor) -> None:
        """Drop one reference per entry of ``slots``; more than were added is an error."""
        self._check_live_slots(slots, "slots")
        if slots.numel():
            drops = torch.bincount(slots, minlength=self.capacity)
            over = drops > self._refcnt.to(torch.int64)
            if bool(over.any()):
                s = int(over.nonzero()[0].item())
                raise ValueError(f"slots unpins slot {s} {int(drops[s])} times but it holds "
                                 f"{int(self._refcnt[s])} pins")
        self._backend.add_refcounts(self._refcnt, slots, -1)

    def retain(self, slots: torch.Tensor) -> None:
        """:meth:`pin` for slots this table returned, without checks or host sync; -1 skipped."""
        self._backend.add_refcounts(self._refcnt, slots, 1)

    def release(self, slots: torch.Tensor) -> None:
        """Drop the pins taken by :meth:`retain` or ``find_or_insert(pin=True)``; -1 skipped.

        Unchecked, but a count never goes below zero: a release without a pin to drop is
        ignored, so a slot pinned afterwards stays protected by that pin.

        Example::

            >>> slots = table.find_or_insert(torch.tensor([7]), pin=True).slots
            >>> table.release(slots); table.release(slots)   # the second one is a no-op
            >>> table.pinned_count()
            0
        """
        self._backend.add_refcounts(self._refcnt, slots, -1)

    def _check_live_slots(self, slots, name) -> None:
        check_slots(slots, name, self.device, self.capacity)
        stored = self._keys[slots]
        empty = (stored == EMPTY_KEY) | (stored == TOMBSTONE_KEY)
        if bool(empty.any()):
            raise ValueError(f"{name} names slot {int(slots[empty][0])}, which holds no key")

    # -- iteration and growth ----------------------------------------------------------------
    def export(self, start: int = 0, batch: Optional[int] = None) -> ExportBatch:
        """Live entries of slots ``[start, start + batch)``; loop until ``next_start == capacity``.

        Example::

            >>> start, seen = 0, 0
            >>> while start < table.capacity:
            ...     chunk = table.export(start, 4096)
            ...     seen += chunk.keys.numel(); start = chunk.next_start
        """
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= self.capacity:
            raise ValueError(f"start must be an int in [0, {self.capacity}], got {start!r}")
        batch = self.capacity - start if batch is None else check_int(batch, "batch")
        end = min(self.capacity, start + batch)
        keys, slots, scores = self._backend.export(self._keys, self._scores, start, end)
        return ExportBatch(keys, slots, scores, end)

    def grow(self, new_capacity: int) -> torch.Tensor:
        """Rehash into ``new_capacity`` slots; returns ``remap`` [old capacity] (old -> new slot,
        -1 for empty slots). Scores and pins move with their keys; apply ``remap`` to any slot
        index you hold and move value rows with it. On failure the table is unchanged."""
        check_int(new_capacity, "new_capacity")
        if new_capacity <= self.capacity or new_capacity % self.bucket_size:
            raise ValueError(f"new_capacity must be a multiple of {self.bucket_size} above the "
                             f"current capacity {self.capacity}, got {new_capacity}")
        if self.max_capacity is not None and new_capacity > self.max_capacity:
            raise ValueError(f"new_capacity {new_capacity} exceeds max_capacity "
                             f"{self.max_capacity}")
        keys, scores, refcnt = self._empty_arrays(new_capacity)
        remap = torch.empty(self.capacity, dtype=torch.int64, device=self.device)
        lost = self._backend.rehash(self._keys, self._scores, self._refcnt, keys, scores, refcnt,
                                    new_capacity // self.bucket_size, self.bucket_size, remap)
        if lost:
            raise ValueError(f"new_capacity {new_capacity} cannot hold the {self.size()} keys "
                             f"({lost} found their bucket full); the table is unchanged")
        self._keys, self._scores, self._refcnt = keys, scores, refcnt
        self._undoable = None
        return remap

    def _next_capacity(self, needed: int) -> Optional[int]:
        """Smallest doubling of the capacity that reaches ``needed``, or None if growth is off
        or ``max_capacity`` forbids it."""
        if self.grow_at_load_factor is None:
            return None
        limit = self.max_capacity
        cap = self.capacity
        while cap < needed:
            cap *= 2
        if limit is not None:
            cap = min(cap, limit // self.bucket_size * self.bucket_size)
        return cap if cap > self.capacity else None

    def _grow_for(self, ukeys) -> Optional[torch.Tensor]:
        """Grow before inserting if the missing keys would pass ``grow_at_load_factor``."""
        probe = torch.empty_like(ukeys)
        self._backend.find(self._keys, self.num_buckets, self.bucket_size, ukeys, probe)
        after = self.size() + int((probe < 0).sum())
        if after <= self.grow_at_load_factor * self.capacity:
            return None
        needed = int(after / self.grow_at_load_factor) + 1
        new_capacity = self._next_capacity(needed)
        return None if new_capacity is None else self.grow(new_capacity)

    def __repr__(self) -> str:
        return (f"ScoredHashTable(capacity={self.capacity}, bucket_size={self.bucket_size}, "
                f"policy={self.policy.name}, device={self.device}, backend={self._backend.name})")


def _compose(first: Optional[torch.Tensor], then: torch.Tensor) -> torch.Tensor:
    """Remap of two successive growths (``first`` may be None)."""
    if first is None:
        return then
    out = first.clone()
    live = first >= 0
    out[live] = then[first[live]]
    return out


def _check_capacity_for_default_buckets(capacity: int) -> None:
    """The default bucket is the whole table below ``MAX_BUCKET_SIZE`` slots, so the capacity
    must then be a power of two; above it, a multiple of ``MAX_BUCKET_SIZE``."""
    if capacity < MAX_BUCKET_SIZE and capacity & (capacity - 1):
        lower = 1 << (capacity.bit_length() - 1)
        nearest = lower if capacity - lower < 2 * lower - capacity else 2 * lower
        raise ValueError(f"capacity below {MAX_BUCKET_SIZE} must be a power of two (one bucket "
                         f"then holds the whole table), or else a multiple of "
                         f"{MAX_BUCKET_SIZE}; got {capacity}, nearest valid: {nearest}")
    if capacity > MAX_BUCKET_SIZE and capacity % MAX_BUCKET_SIZE:
        nearest = (capacity + MAX_BUCKET_SIZE // 2) // MAX_BUCKET_SIZE * MAX_BUCKET_SIZE
        raise ValueError(f"capacity must be a multiple of bucket_size ({MAX_BUCKET_SIZE}) when "
                         f"it is {MAX_BUCKET_SIZE} or more (bucket_size defaults to "
                         f"{MAX_BUCKET_SIZE}; below that, to the capacity, a power of two); got "
                         f"{capacity}, nearest valid: {nearest}")


def _too_many_slots(name: str, rows: int, bucket_size: int) -> str:
    hint = (f"use larger buckets (bucket_size up to {MAX_BUCKET_SIZE})"
            if rows <= max_table_capacity(MAX_BUCKET_SIZE)
            else "split the keys over several tables (shard the table over more ranks)")
    return (f"{name} {rows} is beyond the {max_table_capacity(bucket_size)} slots one table "
            f"can have with bucket_size {bucket_size} ({MAX_BUCKETS} buckets); {hint}")
