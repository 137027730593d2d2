"""Backing stores: where a CACHE-mode table keeps every row the device cache does not hold.

A store maps int64 keys to rows of ``width`` values (embedding then optimizer state) and
keeps each row's score, so that a row coming back to the device cache resumes its score (an
LFU count, a STEP insertion step) instead of starting over. Any object with the four methods
of :class:`BackingStore` works (a parameter server client, an SSD table...);
:class:`HostBackingStore` keeps the rows in host memory.
"""
from __future__ import annotations

from typing import Optional, Protocol, Tuple, runtime_checkable

import torch

from dynemb.backends.numba_backends import backend_for_device
from dynemb.rows.flat_table import FlatTable
from dynemb.rows.hash_table import ScoredHashTable
from dynemb.types import MAX_BUCKET_SIZE, ScorePolicy
from dynemb.foundations.validation import canonical_device, check_index_tensor


@runtime_checkable
class BackingStore(Protocol):
    """What a CACHE-mode table needs from its store. Keys are 1-D int64 and unique per call.

    - ``find(keys) -> (rows [N, width], found [N] bool, scores [N] int64)``: rows and scores
      of stored keys (those of missing keys are unspecified).
    - ``insert(keys, rows, scores) -> int``: insert or overwrite rows with their scores
      (int64, the device table's score of each row when it was evicted: larger is more worth
      keeping, see :class:`~dynemb.ScorePolicy`); returns how many other keys the store
      evicted to make room (0 for a store that never forgets). A store that must forget
      should forget the lowest scores first.
    - ``export(start, batch) -> (keys, rows, next_start)``: iterate over everything stored;
      start at 0 and stop when ``next_start`` is ``None``. A store may return
      ``(keys, rows, scores, next_start)`` instead: checkpoints then keep the scores (with
      three values they save 0 for each).
    - ``size() -> int``: keys stored.

    Optional: ``flush()``, called at the end of a table's ``flush`` (after every cached row
    was inserted): a store with levels of its own writes them through, or makes its copy
    durable (the disk stores do both); ``erase(keys) -> int``, forget ``keys`` (those not
    stored are skipped), returning how many were stored: a table's rows expire from a store
    that has it (:mod:`dynemb.tables.expiry`).

    Keys and rows come on the table's device; ``find`` may answer on another (a store that
    keeps its rows on the host answers there) and the table moves the answer to its device.
    """

    width: int

    def find(self, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def insert(self, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor) -> int: ...

    def export(self, start: int, batch: int) -> Tuple[torch.Tensor, torch.Tensor, Optional[int]]:
        ...

    def size(self) -> int: ...


class HostBackingStore:
    """A :class:`BackingStore` in host memory: a CPU ``ScoredHashTable`` plus a ``FlatTable``.

    It grows by doubling from ``initial_capacity`` up to ``max_capacity`` slots (before its
    load passes 0.75, or when a bucket is full); past that it evicts the lowest of the scores
    its rows were inserted with (and ``insert`` reports how many). Give it room: keys spread
    unevenly over buckets of ``MAX_BUCKET_SIZE`` slots, so at ``max_capacity`` a bucket may
    overflow well before every slot is used (see :func:`default_store_slots`). Rows come back
    on the caller's device; on CUDA they travel through pinned buffers.

    Example::

        >>> store = HostBackingStore(width=4, dtype=torch.float32, device=torch.device("cpu"))
        >>> store.insert(torch.tensor([7, 9]), torch.ones(2, 4), scores=torch.tensor([3, 5]))
        0
        >>> rows, found, scores = store.find(torch.tensor([9, 8]))
        >>> found.tolist(), scores[0].item()
        ([True, False], 5)
    """

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device, *,
                 initial_capacity: int = 1 << 12, max_capacity: Optional[int] = None):
        bucket = min(MAX_BUCKET_SIZE, initial_capacity)
        self.width = width
        self.device = canonical_device(device)
        host = torch.device("cpu")
        kernels = backend_for_device(host)
        # CUSTOMIZED: the store ranks rows by the scores the device table gave them.
        self._table = ScoredHashTable(initial_capacity, bucket_size=bucket,
                                      policy=ScorePolicy.CUSTOMIZED, grow_at_load_factor=0.75,
                                      max_capacity=max_capacity, device=host, kernels=kernels)
        self._rows = FlatTable(initial_capacity, width, dtype=dtype, device=host, kernels=kernels)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu")

    def find(self, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        slots = self._table.find(self._to_host(keys))
        found = slots >= 0
        rows = self._rows.weights.index_select(0, slots.clamp(min=0))
        scores = self._table.scores_at(slots)
        return rows.to(self.device), found.to(self.device), scores.to(self.device)

    def insert(self, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor) -> int:
        check_store_rows(keys, rows, scores, self.width)
        result = self._table.find_or_insert(self._to_host(keys), self._to_host(scores),
                                            assume_unique=True)
        if result.remap is not None:
            self._rows.remap(result.remap, self._table.capacity)
        self._rows.weights.index_copy_(0, result.slots, self._to_host(rows).to(
            self._rows.weights.dtype))
        return int(result.evicted.sum())

    def insert_spilling(self, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor,
                        spill) -> None:
        """``insert`` over a lower level of storage: ``spill(keys, rows, scores, new_keys,
        evicted)`` gets the rows this store evicts to make room (the first ``evicted``
        entries, taken before they are overwritten) and then those of ``keys`` it found no
        slot for, and ``new_keys``, the keys new to this store (whose copies in the lower
        level, if any, are now older than this store's). If ``spill`` raises, the store holds
        what it held before the call (it may keep a larger capacity)."""
        check_store_rows(keys, rows, scores, self.width)
        keys, rows, scores = (self._to_host(t) for t in (keys, rows, scores))
        result = self._table.find_or_insert(keys, scores, assume_unique=True, pin=True,
                                            on_failure="report")
        if result.remap is not None:
            self._rows.remap(result.remap, self._table.capacity)
        evicted, failed = result.evicted, result.failed
        weights = self._rows.weights
        try:
            spill(torch.cat([result.previous_keys[evicted], keys[failed]]),
                  torch.cat([weights.index_select(0, result.slots[evicted]),
                             rows[failed].to(weights.dtype)]),
                  torch.cat([result.previous_scores[evicted], scores[failed]]),
                  keys[result.inserted], int(evicted.sum()))
        except BaseException:
            self._table.undo(result)
            raise
        self._table.release(result.slots)
        placed = result.slots >= 0
        weights.index_copy_(0, result.slots[placed], rows[placed].to(weights.dtype))

    def export(self, start: int, batch: int) -> Tuple[torch.Tensor, torch.Tensor, Optional[int]]:
        chunk = self._table.export(start, batch)
        rows = self._rows.weights.index_select(0, chunk.slots)
        nxt = None if chunk.next_start >= self._table.capacity else chunk.next_start
        return chunk.keys.to(self.device), rows.to(self.device), nxt

    def size(self) -> int:
        return self._table.size()

    def erase(self, keys: torch.Tensor) -> int:
        """Forget ``keys``; returns how many were stored."""
        return int(self._table.erase(self._to_host(keys)).erased.sum())

    def nbytes(self) -> Tuple[int, int]:
        """``(row bytes, hash-table bytes)`` held now (optional for other stores: the table's
        memory breakdown counts a store without it as 0 bytes)."""
        return self._rows.weights.untyped_storage().nbytes(), self._table.nbytes()

    @property
    def capacity(self) -> int:
        return self._table.capacity

    @property
    def hash_table(self) -> ScoredHashTable:
        """The key -> slot table (what a checkpoint saves with :attr:`row_table`)."""
        return self._table

    @property
    def row_table(self) -> FlatTable:
        """The rows, one per slot of :attr:`hash_table`."""
        return self._rows

    @property
    def max_capacity(self) -> Optional[int]:
        """Most slots it grows to (None: unbounded)."""
        return self._table.max_capacity

    def room(self) -> Optional[int]:
        """Rows it takes on top of those it holds without forgetting any (None: no bound):
        up to the load at which it would grow, at ``max_capacity`` (past it, a bucket may
        overflow). What ``write_rows`` asks before it sends rows here.

        Example::

            >>> store = HostBackingStore(4, torch.float32, torch.device("cpu"),
            ...                          initial_capacity=128, max_capacity=256)
            >>> store.room()
            192
        """
        if self.max_capacity is None:
            return None
        limit = int(self._table.grow_at_load_factor * self.max_capacity)
        return max(0, limit - self.size())

    def __repr__(self) -> str:
        return (f"HostBackingStore(width={self.width}, size={self.size()}, "
                f"capacity={self.capacity})")


def check_store_rows(keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor,
                     width: int) -> None:
    """Raise ``ValueError`` unless ``rows`` [N, width] and int64 ``scores`` [N] go with
    ``keys`` [N] (what a store's ``insert`` takes)."""
    check_index_tensor(keys, "keys", keys.device)
    if rows.shape != (keys.numel(), width):
        raise ValueError(f"rows must have shape [{keys.numel()}, {width}], got "
                         f"{tuple(rows.shape)}")
    check_index_tensor(scores, "scores", scores.device)
    if scores.shape != keys.shape:
        raise ValueError(f"scores must have shape {tuple(keys.shape)}, got "
                         f"{tuple(scores.shape)}")


#: Slots the default store starts with, in buckets of this size.
DEFAULT_STORE_INITIAL_SLOTS = 1 << 12
DEFAULT_STORE_BUCKET_SIZE = MAX_BUCKET_SIZE
#: Slots per table row the default store may grow to. A store with one slot per row forgets
#: rows before it holds them all: with 128-slot buckets the fullest bucket overflows at about
#: 96% load. With two it grows before passing 75% load and never needs to evict below
#: ``max_capacity`` rows.
DEFAULT_STORE_HEADROOM = 2


def default_store_slots(max_rows: int) -> int:
    """Most slots the default store of a CACHE table of ``max_rows`` rows grows to: twice the
    rows in whole buckets, at least the initial slots. Each slot costs a row of the store
    (embedding and optimizer state) plus 20 bytes of hash metadata.

    Example::

        >>> default_store_slots(20_096)
        40192
    """
    slots = DEFAULT_STORE_HEADROOM * max_rows
    return max(DEFAULT_STORE_INITIAL_SLOTS,
               slots // DEFAULT_STORE_BUCKET_SIZE * DEFAULT_STORE_BUCKET_SIZE)


def default_store(max_rows: int):
    """The store factory of a CACHE table of ``max_rows`` rows whose options name none: a
    :class:`HostBackingStore` growing from 4096 slots to :func:`default_store_slots`.

    Example::

        >>> store = default_store(20_096)(4, torch.float32, torch.device("cpu"))
        >>> store.capacity, store.max_capacity
        (4096, 40192)
    """
    def build(width: int, dtype: torch.dtype, device: torch.device) -> HostBackingStore:
        return HostBackingStore(width, dtype, device,
                                initial_capacity=DEFAULT_STORE_INITIAL_SLOTS,
                                max_capacity=default_store_slots(max_rows))
    return build
