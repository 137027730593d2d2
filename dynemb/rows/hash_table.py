"""``ScoredHashTable``: raw int64 keys -> slots of a flat value table, with scores and pins."""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from dynemb.backends.numba_backends import resolve_kernels
from dynemb.backends.protocol import KernelBackend, TableArrays
from dynemb.rows.hash_table_images import (arrays_image, compose_remaps, empty_arrays,
                                           load_arrays_image, move_arrays, restore_scores_at)
from dynemb.rows.hash_table_checks import (MAX_BUCKETS, SLOT_BYTES, check_claim_arguments,
                                          check_distinct_with_scores, check_scores,
                                          check_table_arguments, max_table_capacity)
from dynemb.types import (EMPTY_KEY, TOMBSTONE_KEY, EraseResult, ExportBatch, FindOrInsertResult,
                          ScorePolicy, TableFullError)
from dynemb.foundations.validation import (canonical_device, check_index_tensor, check_int,
                                           check_keys, check_slots)

__all__ = ["MAX_BUCKETS", "SLOT_BYTES", "ScoredHashTable", "max_table_capacity"]


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
        kernels: the kernels its owner resolved for ``device`` (a table passes its own);
            instead of ``backend``.

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
                 max_capacity: Optional[int] = None, backend: Optional[str] = None,
                 kernels: Optional[KernelBackend] = None):
        bucket_size = check_table_arguments(capacity, bucket_size, policy, grow_at_load_factor,
                                            max_capacity)
        self.device = canonical_device(device if device is not None else "cpu")
        self._backend = resolve_kernels(self.device, backend, kernels)
        self.policy = policy
        self.bucket_size = bucket_size
        self.grow_at_load_factor = grow_at_load_factor
        self.max_capacity = max_capacity
        self._clock = 0
        # the slots of the call undo() may revert, by weak reference (no memory held for it)
        self._undoable: Optional[weakref.ref] = None
        # what the kernels take; replaced as a whole by grow()
        self._arrays = TableArrays.empty(capacity, bucket_size, self.device)

    def __getstate__(self):
        """For pickling (``torch.save`` of a module): everything but the weak reference that
        :meth:`undo` checks, which cannot be pickled; an unpickled table has no call to undo."""
        return {**self.__dict__, "_undoable": None}

    # -- sizes -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._arrays.capacity

    @property
    def num_buckets(self) -> int:
        return self._arrays.num_buckets

    @property
    def clock(self) -> int:
        """Calls that updated scores so far (the LRU/STEP score of the latest call)."""
        return self._clock

    @property
    def kernels(self) -> KernelBackend:
        """The kernels the table runs (resolved once, when it was built)."""
        return self._backend

    def size(self) -> int:
        """Number of live keys (synchronizes with the device on CUDA)."""
        return int(self._arrays.size.item())

    def load_factor(self) -> float:
        return self.size() / self.capacity

    def scores_at(self, slots: torch.Tensor) -> torch.Tensor:
        """Current scores of ``slots`` (-1 entries give 0)."""
        check_index_tensor(slots, "slots", self.device)
        return torch.where(slots >= 0, self._arrays.scores[slots.clamp(min=0)], 0)

    def keys_at(self, slots: torch.Tensor) -> torch.Tensor:
        """Keys stored at ``slots`` (``EMPTY_KEY`` for -1 entries and free slots); no host
        sync, no checks beyond the dtype: for slot indices this table returned."""
        keys = self._arrays.keys[slots.clamp(min=0)]
        return torch.where(slots >= 0, keys, EMPTY_KEY)

    def nbytes(self) -> int:
        """Bytes of the table's arrays (keys, scores, reference counts, size)."""
        return self._arrays.nbytes()

    def pinned_count(self) -> int:
        """Number of slots with a reference count above zero."""
        return int((self._arrays.refcnt > 0).sum().item())

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
            check_keys(keys, self.device, kernels=self._backend)
        check_scores(self.policy, self.device, keys, scores, required=update_scores)
        out = torch.empty_like(keys)
        if not update_scores:
            self._backend.find(self._arrays, keys, out)
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
        check_claim_arguments(self.policy, self.device, keys, scores, on_failure=on_failure,
                              assume_unique=assume_unique, counts=counts, kernels=self._backend)
        ukeys, inverse, dedup_counts, given = self._dedup(keys, scores, assume_unique)
        counts = dedup_counts if counts is None else counts
        self._undoable = None
        remap = self._grow_for(ukeys) if self.grow_at_load_factor is not None else None
        # One backend call per round (lookup, claims and stats in one find_or_insert). A round
        # ends on the host: whether to roll back and grow, and to what capacity, depends on
        # its stats, and the grown arrays are allocated here; so rounds cannot merge into one
        # call. The usual call (nothing failed, no growth) is a single round, and with growth
        # off and "defer" it reads nothing back.
        while True:
            attempt = self._find_or_insert_once(ukeys, counts, given, pin)
            slots, inserted, prev_keys, prev_scores, failed, stats = attempt
            new_capacity = self._next_capacity(self.capacity + 1)
            if new_capacity is not None and bool(stats[1]):
                # Below max_capacity a full bucket means "grow", never "forget a key".
                self._rollback(slots, inserted, prev_keys, prev_scores, pinned=pin)
                remap = compose_remaps(remap, self.grow(new_capacity))
                continue
            if on_failure == "defer" or not bool(stats[0]):
                break
            if on_failure == "report" and new_capacity is None:
                break
            self._rollback(slots, inserted, prev_keys, prev_scores, pinned=pin)
            if new_capacity is None:
                raise TableFullError(
                    f"{int(stats[0])} of {ukeys.numel()} keys found no slot: their buckets "
                    f"are full of pinned slots or the policy is NO_EVICTION "
                    f"(capacity {self.capacity}, size {self.size()}); the table is unchanged"
                    + ("" if remap is None else " except that it grew (see .remap)"),
                    ukeys[failed], remap)
            remap = compose_remaps(remap, self.grow(new_capacity))
        self._undoable = weakref.ref(slots) if pin else None
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

            >>> table = ScoredHashTable(1024)
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
        self._rollback(result.slots, result.inserted, result.previous_keys,
                       result.previous_scores, pinned=True)

    def restore_scores(self, slots: torch.Tensor, scores: torch.Tensor) -> None:
        """Give keys that came back to the table the scores they had when they left it.

        ``slots`` [N] (distinct, live) hold keys just re-inserted, ``scores`` [N] (int64) what
        those keys scored when they were evicted (``previous_scores``, e.g. kept by a backing
        store). By policy: LFU adds them to the new counts (LFU_LRU its count part, keeping
        the new last use), STEP takes back the original
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
        check_distinct_with_scores(slots, scores, self.device, name="slots",
                                   each="one score per key")
        restore_scores_at(self._arrays.scores, self.policy, slots, scores)

    def _find_or_insert_once(self, ukeys, counts, given, pin, policy=None, allow_evict=None):
        """One attempt: (slots, inserted, previous keys, previous scores, failed, stats), stats
        = (keys failed, live keys evicted) as a device tensor. ``policy`` / ``allow_evict``
        override the table's (loading entries uses CUSTOMIZED scores and never evicts)."""
        policy = self.policy if policy is None else policy
        if allow_evict is None:
            allow_evict = policy is not ScorePolicy.NO_EVICTION
        self._clock += 1
        slots, prev_keys, prev_scores = (torch.empty_like(ukeys) for _ in range(3))
        inserted = torch.empty(ukeys.shape, dtype=torch.bool, device=self.device)
        failed = torch.empty_like(inserted)
        stats = torch.empty(2, dtype=torch.int64, device=self.device)
        self._backend.find_or_insert(self._arrays, ukeys, counts, given, policy.code,
                                     self._clock, allow_evict, pin, slots, inserted, prev_keys,
                                     prev_scores, failed, stats)
        return slots, inserted, prev_keys, prev_scores, failed, stats

    def _lookup_update(self, ukeys, counts, given, *, pin, slots, prev_scores) -> None:
        self._backend.lookup_update(self._arrays, ukeys, counts, given, self.policy.code,
                                    self._clock, pin, slots, prev_scores)

    def _rollback(self, slots, inserted, prev_keys, prev_scores, *, pinned) -> None:
        """Undo one ``_find_or_insert_once``: restore keys, scores, size, clock and, if the
        call ``pinned`` its slots, pins."""
        placed = slots >= 0
        ins_slots = slots[inserted]
        restored = prev_keys[inserted]
        arrays = self._arrays
        arrays.keys[ins_slots] = restored
        arrays.size.sub_((restored == EMPTY_KEY).sum() + (restored == TOMBSTONE_KEY).sum())
        arrays.scores[slots[placed]] = prev_scores[placed]
        if pinned:
            self._backend.add_refcounts(arrays, slots, -1)
        self._clock -= 1

    def _dedup(self, keys, scores, assume_unique):
        if assume_unique:
            # ones / zeros a policy does not read stay a single broadcast element
            counts = keys.new_ones(1).expand(keys.shape)
            inverse = torch.arange(keys.numel(), device=self.device)
            given = scores if scores is not None else keys.new_zeros(1).expand(keys.shape)
            return keys, inverse, counts, given
        ukeys, inverse, counts = self._backend.dedup(keys, self.num_buckets)
        if scores is None:
            return ukeys, inverse, counts, ukeys.new_zeros(1).expand(ukeys.shape)
        given = torch.full_like(ukeys, torch.iinfo(torch.int64).min).scatter_reduce(
            0, inverse, scores, reduce="amax")
        return ukeys, inverse, counts, given

    # -- removal and pins --------------------------------------------------------------------
    def erase(self, keys: torch.Tensor, *, allow_padding: bool = False) -> EraseResult:
        """Remove ``keys``; pinned keys are kept and flagged in ``pinned``. With
        ``allow_padding``, ``EMPTY_KEY`` entries are skipped instead of rejected."""
        if allow_padding:
            check_index_tensor(keys, "keys", self.device)
        else:
            check_keys(keys, self.device, kernels=self._backend)
        erased = torch.zeros(keys.shape, dtype=torch.bool, device=self.device)
        pinned = torch.zeros_like(erased)
        self._backend.erase(self._arrays, keys, erased, pinned)
        return EraseResult(erased, pinned)

    def pin(self, slots: torch.Tensor) -> None:
        """Add one reference to each slot (duplicates add one each); pinned slots stay put."""
        self._check_live_slots(slots, "slots")
        self._backend.add_refcounts(self._arrays, slots, 1)

    def unpin(self, slots: torch.Tensor) -> None:
        """Drop one reference per entry of ``slots``; more than were added is an error."""
        self._check_live_slots(slots, "slots")
        if slots.numel():
            drops = torch.bincount(slots, minlength=self.capacity)
            over = drops > self._arrays.refcnt.to(torch.int64)
            if bool(over.any()):
                s = int(over.nonzero()[0].item())
                raise ValueError(f"slots unpins slot {s} {int(drops[s])} times but it holds "
                                 f"{int(self._arrays.refcnt[s])} pins")
        self._backend.add_refcounts(self._arrays, slots, -1)

    def retain(self, slots: torch.Tensor) -> None:
        """:meth:`pin` for slots this table returned, without checks or host sync; -1 skipped."""
        self._backend.add_refcounts(self._arrays, slots, 1)

    def release(self, slots: torch.Tensor) -> None:
        """Drop the pins taken by :meth:`retain` or ``find_or_insert(pin=True)``; -1 skipped.

        Unchecked, but a count never goes below zero: a release without a pin to drop is
        ignored, so a slot pinned afterwards stays protected by that pin.

        Example::

            >>> table = ScoredHashTable(1024)
            >>> slots = table.find_or_insert(torch.tensor([7]), pin=True).slots
            >>> table.release(slots); table.release(slots)   # the second one is a no-op
            >>> table.pinned_count()
            0
        """
        self._backend.add_refcounts(self._arrays, slots, -1)

    def _check_live_slots(self, slots, name) -> None:
        check_slots(slots, name, self.device, self.capacity)
        stored = self._arrays.keys[slots]
        empty = (stored == EMPTY_KEY) | (stored == TOMBSTONE_KEY)
        if bool(empty.any()):
            raise ValueError(f"{name} names slot {int(slots[empty][0])}, which holds no key")

    # -- storage, images and loads ----------------------------------------------------------
    @property
    def arrays(self) -> TableArrays:
        """The arrays the kernels take (replaced as a whole by :meth:`grow` and
        :meth:`use_storage`)."""
        return self._arrays

    def use_storage(self, arrays: TableArrays) -> None:
        """Copy the table into ``arrays`` (of the same capacity and bucket size, e.g. views
        of a table group's arrays, :mod:`dynemb.tables.groups`) and keep it there."""
        self._arrays = move_arrays(self._arrays, arrays)

    def tick(self) -> int:
        """Advance the clock for one scoring call made on :attr:`arrays` by its owner (a
        table group's claim) and return it; that call cannot be undone."""
        self._undoable = None
        self._clock += 1
        return self._clock

    def untick(self) -> None:
        """Take back the latest :meth:`tick` (its call was rolled back)."""
        self._clock -= 1

    def set_clock(self, clock: int) -> None:
        """Advance the clock to at least ``clock`` (after loading scores of a later clock)."""
        self._clock = max(self._clock, int(clock))

    def image(self):
        """``(keys, scores)``: the table's own slot arrays (views, not copies): slot ``s``
        holds ``keys[s]`` (``EMPTY_KEY`` / ``TOMBSTONE_KEY`` when free) with ``scores[s]``.
        What a checkpoint saves; :meth:`load_image` puts it back."""
        return arrays_image(self._arrays)

    def load_image(self, keys: torch.Tensor, scores: torch.Tensor, clock: int) -> None:
        """Make the table exactly the one whose :meth:`image` is ``(keys, scores)`` and whose
        :attr:`clock` was ``clock``: same capacity, every key in its saved slot, no pins.

        Example::

            >>> table = ScoredHashTable(256)
            >>> _ = table.find_or_insert(torch.tensor([3, 4]))
            >>> keys, scores = (t.clone() for t in table.image())
            >>> copy = ScoredHashTable(256)
            >>> copy.load_image(keys, scores, table.clock)
            >>> bool((copy.find(torch.tensor([3, 4])) == table.find(torch.tensor([3, 4]))).all())
            True
        """
        load_arrays_image(self._arrays, keys, scores)
        self._clock = int(clock)
        self._undoable = None

    def load_entries(self, keys: torch.Tensor, scores: torch.Tensor) -> FindOrInsertResult:
        """Insert distinct ``keys`` with exactly ``scores`` whatever the policy (a key stored
        already takes the given score), **never evicting**: for loading a checkpoint, where a
        lost key would be a lost row. Grows as allowed; if some key still finds no slot the
        table is unchanged (apart from growth) and :class:`TableFullError` is raised. Nothing
        is pinned. Returns the result (``slots``, ``inserted``, ``remap``).

        Example::

            >>> table = ScoredHashTable(256, policy=ScorePolicy.LFU)
            >>> slots = table.load_entries(torch.tensor([9, 5]), torch.tensor([40, 2])).slots
            >>> table.scores_at(slots).tolist()
            [40, 2]
        """
        check_keys(keys, self.device, kernels=self._backend)
        check_distinct_with_scores(keys, scores, self.device, name="keys", each="one entry per key")
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

            >>> table = ScoredHashTable(1024)
            >>> slots = table.find_or_insert(torch.tensor([7, 9]), pin=True).slots
            >>> table.reset()
            >>> table.size(), table.clock, table.pinned_count()
            (0, 0, 0)
            >>> table.find(torch.tensor([7])).tolist()
            [-1]
        """
        empty_arrays(self._arrays)
        self._clock = 0
        self._undoable = None

    # -- iteration and growth ----------------------------------------------------------------
    def export(self, start: int = 0, batch: Optional[int] = None) -> ExportBatch:
        """Live entries of slots ``[start, start + batch)``; loop until ``next_start == capacity``.

        Example::

            >>> table = ScoredHashTable(1024)
            >>> _ = table.find_or_insert(torch.arange(100))
            >>> start, seen = 0, 0
            >>> while start < table.capacity:
            ...     chunk = table.export(start, 256)
            ...     seen += chunk.keys.numel(); start = chunk.next_start
            >>> seen
            100
        """
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= self.capacity:
            raise ValueError(f"start must be an int in [0, {self.capacity}], got {start!r}")
        batch = self.capacity - start if batch is None else check_int(batch, "batch")
        end = min(self.capacity, start + batch)
        keys, slots, scores = self._backend.export(self._arrays, start, end)
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
        grown = TableArrays.empty(new_capacity, self.bucket_size, self.device,
                                  size=self._arrays.size)
        remap = torch.empty(self.capacity, dtype=torch.int64, device=self.device)
        lost = self._backend.rehash(self._arrays, grown, remap)
        if lost:
            raise ValueError(f"new_capacity {new_capacity} cannot hold the {self.size()} keys "
                             f"({lost} found their bucket full); the table is unchanged")
        self._arrays = grown
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

    def capacity_to_grow_to(self, keys_after: int, displaces: bool) -> Optional[int]:
        """The capacity :meth:`find_or_insert` grows to for a claim that would leave
        ``keys_after`` keys (every key it misses counted) and, with ``displaces``, evict a
        live key or find no slot for one: past ``grow_at_load_factor``, the smallest doubling
        that holds them below it; else, if it displaces, one doubling. None: no growth
        (growth off, at ``max_capacity``, or not needed). For an owner that claims on
        :attr:`arrays` itself (a table group) and grows as this table would.

        Example::

            >>> table = ScoredHashTable(1024, grow_at_load_factor=0.5)
            >>> table.capacity_to_grow_to(400, False), table.capacity_to_grow_to(1100, False)
            (None, 4096)
            >>> table.capacity_to_grow_to(400, True)
            2048
        """
        if self.grow_at_load_factor is None:
            return None
        if keys_after > self.grow_at_load_factor * self.capacity:
            capacity = self._next_capacity(int(keys_after / self.grow_at_load_factor) + 1)
            if capacity is not None:
                return capacity
        return self._next_capacity(self.capacity + 1) if displaces else None

    def capacity_to_claim(self, ukeys: torch.Tensor) -> Optional[int]:
        """The capacity :meth:`find_or_insert` grows to before it claims ``ukeys`` (distinct
        keys): where the keys it misses would pass ``grow_at_load_factor`` (see
        :meth:`capacity_to_grow_to`); None: no growth. Nothing changes. ``EMPTY_KEY``
        entries (padding on CUDA, keys refused by admission) claim nothing: not counted.

        Example::

            >>> table = ScoredHashTable(256, bucket_size=32, grow_at_load_factor=0.5)
            >>> table.capacity_to_claim(torch.arange(100))  # 100 keys fit below 0.5 x 256
            >>> table.capacity_to_claim(torch.arange(200))
            512
            >>> table.capacity_to_claim(torch.full((200,), EMPTY_KEY))  # padding only
        """
        probe = torch.empty_like(ukeys)
        self._backend.find(self._arrays, ukeys, probe)
        missing = int(((probe < 0) & (ukeys != EMPTY_KEY)).sum())
        return self.capacity_to_grow_to(self.size() + missing, False)

    def _grow_for(self, ukeys) -> Optional[torch.Tensor]:
        """Grow before inserting if the missing keys would pass ``grow_at_load_factor``."""
        new_capacity = self.capacity_to_claim(ukeys)
        return None if new_capacity is None else self.grow(new_capacity)

    def __repr__(self) -> str:
        return (f"ScoredHashTable(capacity={self.capacity}, bucket_size={self.bucket_size}, "
                f"policy={self.policy.name}, device={self.device}, backend={self._backend.name})")
