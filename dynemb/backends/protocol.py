"""What the hash table and the row code need from a kernel backend, and the arrays of one
table as the table kernels take them.

:mod:`dynemb.backends.numba_backends` has the two implementations (``@njit`` on CPU, numba-cuda on GPU or
in numba's simulator). Every tensor argument lives on the backend's device; ``out_*``
arguments are written by the call.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Protocol, Tuple, runtime_checkable

import torch

from dynemb.types import EMPTY_KEY


class TableArrays(NamedTuple):
    """The storage of one hash table: ``capacity = num_buckets * bucket_size`` slots.

    - ``keys`` [C] int64: the key of each slot (``EMPTY_KEY`` / ``TOMBSTONE_KEY`` if free).
    - ``scores`` [C] int64: each slot's score (see :class:`~dynemb.types.ScorePolicy`).
    - ``refcnt`` [C] int32: each slot's pins.
    - ``size`` [1] int64: live keys, kept up to date by the kernels.

    Example::

        >>> arrays = TableArrays.empty(256, 128, torch.device("cpu"))
        >>> arrays.capacity, arrays.num_buckets, int(arrays.size)
        (256, 2, 0)
    """

    keys: torch.Tensor
    scores: torch.Tensor
    refcnt: torch.Tensor
    size: torch.Tensor
    num_buckets: int
    bucket_size: int

    @classmethod
    def empty(cls, capacity: int, bucket_size: int, device: torch.device,
              size: Optional[torch.Tensor] = None) -> "TableArrays":
        """``capacity`` free slots; ``size`` is the live-key counter to keep (a rehash moves
        the keys, not their count), a new zero one if None."""
        if size is None:
            size = torch.zeros(1, dtype=torch.int64, device=device)
        return cls(torch.full((capacity,), EMPTY_KEY, dtype=torch.int64, device=device),
                   torch.zeros(capacity, dtype=torch.int64, device=device),
                   torch.zeros(capacity, dtype=torch.int32, device=device),
                   size, capacity // bucket_size, bucket_size)

    @property
    def capacity(self) -> int:
        return self.keys.numel()

    def nbytes(self) -> int:
        """Bytes of the four arrays (of their elements: a table group's tables are views of
        the group's arrays and count their own part)."""
        return sum(t.numel() * t.element_size()
                   for t in (self.keys, self.scores, self.refcnt, self.size))


@runtime_checkable
class KernelBackend(Protocol):
    """The kernels of one device kind, launched on torch tensors.

    Table kernels take a :class:`TableArrays`. ``ukeys`` are unique keys (``EMPTY_KEY``
    entries are padding and get slot -1), with their ``counts`` (occurrences, what LFU adds)
    and ``given`` scores (CUSTOMIZED); ``policy`` is a ``ScorePolicy.code`` and ``clock`` the
    table's clock for this call.

    Example::

        >>> from dynemb.backends.numba_backends import get_backend
        >>> isinstance(get_backend("cpu"), KernelBackend)
        True
    """

    #: "cpu" or "cuda".
    name: str
    #: True: the table layer reads slot failures at a later call (reading them at once would
    #: stall the host) and pads its unique keys with ``EMPTY_KEY`` (fixed shapes); False: it
    #: raises at once and its unique keys are exact.
    defers_failures: bool
    #: True: it has the table-group kernels (``dedup_segments``, ``find_or_insert_group``,
    #: ``claim_counts_group``, ``init_rows_at_group``; see :mod:`dynemb.tables.groups`);
    #: False: every table runs alone.
    runs_groups: bool

    def check_device(self, device: torch.device) -> None:
        """Raise unless this backend runs on tensors of ``device``."""

    def find(self, table: TableArrays, keys: torch.Tensor, out_slots: torch.Tensor,
             parallel: Optional[bool] = None) -> None:
        """``out_slots[i]``: the slot of ``keys[i]`` or -1; nothing changes. Duplicates
        allowed. ``parallel``: use threads (CPU; default: when it pays off)."""

    def lookup_update(self, table: TableArrays, ukeys, counts, given, policy: int, clock: int,
                      pin: bool, out_slots, out_prev_scores) -> None:
        """Find ``ukeys``; update the score of each hit by ``policy`` (its old score goes to
        ``out_prev_scores``) and, with ``pin``, add one pin to it. Misses get slot -1."""

    def insert_missing(self, table: TableArrays, ukeys, counts, given, policy: int, clock: int,
                       allow_evict: bool, slots, out_prev_keys, out_prev_scores,
                       out_failed) -> None:
        """Give each key with ``slots[i] < 0`` a pinned slot of its bucket, evicting the
        lowest unpinned score when ``allow_evict`` and the bucket is full; what the slot held
        goes to ``out_prev_keys`` / ``out_prev_scores``. Keys finding no slot keep -1 and are
        flagged in ``out_failed``."""

    def find_or_insert(self, table: TableArrays, ukeys, counts, given, policy: int,
                       clock: int, allow_evict: bool, pin: bool, out_slots, out_inserted,
                       out_prev_keys, out_prev_scores, out_failed, out_stats) -> None:
        """Find ``ukeys``, rescoring hits by ``policy``, and give each missing key a slot of
        its bucket: the first free one of its probe, else (with ``allow_evict``) the unpinned
        slot with the lowest score that no key of the call found or claimed. ``out_inserted``
        flags the claimed slots; ``out_prev_keys`` / ``out_prev_scores`` say what they held
        (for hits: ``EMPTY_KEY`` and the score before the update). Keys finding no slot get -1
        and ``out_failed``. With ``pin`` every returned slot gets one pin, else pins are as
        before. ``out_stats`` [2] int64: (keys failed, live keys evicted)."""

    def erase(self, table: TableArrays, keys, out_erased, out_pinned) -> None:
        """Remove ``keys`` (``out_erased``), except pinned ones (``out_pinned``)."""

    def add_refcounts(self, table: TableArrays, slots, delta: int) -> None:
        """Add ``delta`` pins to each slot of ``slots`` (-1 skipped); counts stay >= 0."""

    def export(self, table: TableArrays, start: int,
               end: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, slots, scores)`` of the live slots in ``[start, end)``, in slot order."""

    def rehash(self, old: TableArrays, new: TableArrays, remap: torch.Tensor) -> int:
        """Move every live key of ``old`` (score and pins with it) into the empty ``new``;
        ``remap[s]``: the new slot of old slot ``s`` (-1: empty). Returns how many keys found
        their new bucket full (then ``new`` is to be dropped)."""

    def dedup(self, keys: torch.Tensor, num_buckets: Optional[int] = None
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(unique keys, inverse, counts)``: ``unique[inverse] == keys``. ``num_buckets``: the
        keys go to a table of that many buckets next (a backend may order them for it)."""

    def claim_summary(self, slots, inserted, previous_keys) -> Tuple:
        """``(hits, inserts, evictions)`` of one ``find_or_insert`` result: ints on CPU,
        0-d device tensors on CUDA (no host sync)."""

    def init_rows(self, out, keys, seed, table_id, kind, p0, p1, low, high) -> None:
        """Fill float32 ``out`` [N, D] with the initial rows of ``keys`` (see
        :mod:`dynemb.rows.initializers`)."""

    def init_rows_at(self, weights, slots, keys, mask, dim, seed, table_id, kind, p0, p1, low,
                     high) -> None:
        """Write the initial rows of ``keys`` into rows ``slots`` of ``weights`` where
        ``mask``."""

    def fused_update(self, weights, slots, src, offsets, order, scale, clip, kind, dim, lr,
                     eps, beta1, beta2, weight_decay, bias1, bias2, acc0) -> None:
        """One optimizer step on rows ``slots`` [U] of float32 ``weights`` [C, W] (embedding
        and state); row ``i``'s gradient is the sum of ``src[order[k]]`` over ``k`` in
        ``offsets[i]:offsets[i + 1]``, clamped to ``clip`` (if >= 0) and times ``scale[k]``
        (if not empty) (see :func:`dynemb.rows.optimizers.fused_update`)."""

    def round_rows(self, src, out, keys, seed, table_id, step, fmt, stochastic) -> None:
        """float32 ``src`` [N, D] rounded into float16 / bfloat16 ``out`` [N, D]."""

    def pool_bags(self, weights, occ_slots, offsets, scale, mean, batch, cols, dim,
                  out) -> None:
        """A table's bags straight from its float32 rows ``weights`` into ``out`` [B, C]:
        bag ``q = i * batch + b`` (feature ``i``, sample ``b``) sums rows ``occ_slots[k]``
        for ``k`` in ``offsets[q]:offsets[q + 1]`` (times ``scale[k]`` if not empty; divided
        by the length if ``mean``) into ``out[b, cols[i]:cols[i] + dim]``."""
