"""What the layers above need from a kernel backend: the :class:`KernelBackend` protocol,
the arrays of one table (:class:`TableArrays`) and of a group's keys per table
(:class:`Segments`) as the kernels take them, and the codes and reserved keys the kernels
share.

:mod:`dynemb.backends.numba_backends` has the two implementations (``@njit`` on CPU; numba-cuda on
GPU or
in numba's simulator, :mod:`dynemb.backends.cuda_backend`). Every tensor argument lives on the
backend's device; ``out_*`` arguments are written by the call. This module, the two backends
and nothing else import ``dynemb.kernels``: the layers above read the kernels' codes here.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple, Optional, Protocol, Tuple, runtime_checkable

import numpy as np
import torch

from dynemb.backends.device_values import values_on
from dynemb.kernels import (constants, group_stores_cpu, hashing, init_common, optim_common,
                            round_common)

#: Reserved int64 keys: ``EMPTY_KEY`` marks a slot that never held a key since the last
#: rehash, ``TOMBSTONE_KEY`` an erased one. Neither is ever stored.
EMPTY_KEY = int(constants.EMPTY_KEY)
TOMBSTONE_KEY = int(constants.TOMBSTONE_KEY)
#: Largest bucket the CUDA insert kernel can track (two 64-bit masks).
MAX_BUCKET_SIZE = constants.MAX_BUCKET_SIZE

#: Score-policy codes, as the kernels take them (``ScorePolicy.code``).
POLICY_LRU = constants.POLICY_LRU
POLICY_LFU = constants.POLICY_LFU
POLICY_STEP = constants.POLICY_STEP
POLICY_CUSTOMIZED = constants.POLICY_CUSTOMIZED
POLICY_NO_EVICTION = constants.POLICY_NO_EVICTION
POLICY_LFU_LRU = constants.POLICY_LFU_LRU
#: How an LFU_LRU score packs a count above a clock of ``LFU_LRU_CLOCK_BITS`` bits.
LFU_LRU_CLOCK_BITS = constants.LFU_LRU_CLOCK_BITS
LFU_LRU_MAX_COUNT = constants.LFU_LRU_MAX_COUNT
LFU_LRU_MAX_CLOCK = constants.LFU_LRU_MAX_CLOCK

#: Initializer codes of ``init_rows`` / ``init_rows_at``.
INIT_NORMAL = init_common.INIT_NORMAL
INIT_TRUNCATED_NORMAL = init_common.INIT_TRUNCATED_NORMAL
INIT_UNIFORM = init_common.INIT_UNIFORM
INIT_CONSTANT = init_common.INIT_CONSTANT
#: Optimizer codes of ``fused_update``.
OPT_SGD = optim_common.OPT_SGD
OPT_ADAM = optim_common.OPT_ADAM
OPT_ADAGRAD = optim_common.OPT_ADAGRAD
OPT_ROWWISE_ADAGRAD = optim_common.OPT_ROWWISE_ADAGRAD
#: 16-bit formats of ``round_rows``.
FMT_FLOAT16 = round_common.FMT_FLOAT16
FMT_BFLOAT16 = round_common.FMT_BFLOAT16
#: The bucket hash's murmur3 multipliers (``mix64``), for hashes of keys in torch.
MIX_A = int(hashing.MIX_A)
MIX_B = int(hashing.MIX_B)
#: The tier hash's multiplier (``hashing.routes_to_first``), as a Python int.
TIER_MULTIPLIER = int(hashing.TIER_MULTIPLIER)
#: ``store_moves_group``'s ``out_stats`` columns per table: rows written back, store keys
#: evicted, rows loaded, 1 if the table was left for the host.
STORE_STATS = group_stores_cpu.NUM_STATS
STORE_STAT_LEFT = group_stores_cpu.STAT_LEFT


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


#: ``Segments``' device tensors of the bounds seen last, by (what, device, bounds): a group
#: sees a few padded batch sizes, so a step reuses its bucket's.
_KEPT: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_KEPT_MOST = 128


def _kept(key: tuple, make) -> torch.Tensor:
    """The kept tensor of ``key``, made by ``make()`` when there is none."""
    tensor = _KEPT.pop(key, None)
    if tensor is None:
        tensor = make()
    _KEPT[key] = tensor  # the most recent last
    while len(_KEPT) > _KEPT_MOST:
        _KEPT.pop(next(iter(_KEPT)))
    return tensor


class Segments:
    """Which table of a group each entry of a call's key array belongs to: entries
    ``bounds[t]:bounds[t + 1]`` are table ``t``'s, in the group's table order. A lone table
    is a group of one (:meth:`single`).

    The CPU kernels walk ``bounds`` ([T + 1] int64, on the host); the CUDA kernels read
    ``table_of`` ([N] int64 on ``device``: the table of each entry), made from the bounds at
    first use without stalling the host.

    Example::

        >>> segments = Segments([0, 2, 2, 5])
        >>> segments.count, segments.table_of.tolist()
        (3, [0, 0, 2, 2, 2])
        >>> Segments.single(3).bounds.tolist()
        [0, 3]
    """

    __slots__ = ("bounds", "device", "_on_device", "_table_of")

    def __init__(self, bounds, device: Optional[torch.device] = None):
        self.bounds = np.asarray(bounds, dtype=np.int64)
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self._on_device: Optional[torch.Tensor] = None
        self._table_of: Optional[torch.Tensor] = None

    @classmethod
    def single(cls, n: int, device: Optional[torch.device] = None) -> "Segments":
        """The ``n`` entries of one table."""
        return cls([0, n], device)

    @property
    def count(self) -> int:
        """How many tables (segments)."""
        return len(self.bounds) - 1

    @property
    def on_device(self) -> torch.Tensor:
        """``bounds`` as a tensor on ``device``. Read-only, shared as :attr:`table_of` is."""
        if self._on_device is None:
            self._on_device = _kept(("bounds", self.device, self.bounds.tobytes()),
                                    lambda: values_on(self.bounds.tolist(), torch.int64,
                                                      self.device))
        return self._on_device

    @property
    def table_of(self) -> torch.Tensor:
        """[N] int64 on ``device``: the table of each entry (how many tables end at or
        before it). Read-only: the same bounds on the same device (the steps of one padded
        batch size) share one tensor, so a step sends and computes nothing for it."""
        if self._table_of is None:
            self._table_of = _kept(("table_of", self.device, self.bounds.tobytes()),
                                   self._make_table_of)
        return self._table_of

    def _make_table_of(self) -> torch.Tensor:
        if self.count == 1:
            return torch.zeros(int(self.bounds[-1]), dtype=torch.int64, device=self.device)
        positions = torch.arange(int(self.bounds[-1]), device=self.device)
        return torch.searchsorted(self.on_device[1:], positions, right=True)


def probe_args(table: TableArrays, convert):
    """Leading kernel arguments of the kernels that probe and rescore: keys, scores, pins
    and the bucket geometry (``convert``: a tensor as the backend's kernels take it)."""
    return (convert(table.keys), convert(table.scores), convert(table.refcnt),
            table.num_buckets, table.bucket_size)


def claim_args(table: TableArrays, convert):
    """Leading kernel arguments of the kernels that claim or free slots (they also keep
    ``size`` up to date)."""
    return (convert(table.keys), convert(table.scores), convert(table.refcnt),
            convert(table.size), table.num_buckets, table.bucket_size)


def rehash_args(old: TableArrays, new: TableArrays, convert):
    """Leading kernel arguments of the rehash kernels: both tables' arrays, the new
    geometry."""
    return (convert(old.keys), convert(old.scores), convert(old.refcnt), convert(new.keys),
            convert(new.scores), convert(new.refcnt), new.num_buckets, new.bucket_size)


def bit_views(src, out, convert):
    """float32 ``src`` as int32 and 16-bit ``out`` as int16 arrays (bfloat16 has no numpy
    dtype; the rounding kernels work on bit patterns)."""
    return convert(src.view(torch.int32)), convert(out.view(torch.int16))


def f32(*values):
    """Kernel scalars as float32, so the kernels compute (and compile) in float32."""
    return tuple(np.float32(v) for v in values)


@runtime_checkable
class KernelBackend(Protocol):
    """The kernels of one device kind, launched on torch tensors.

    Table kernels take a :class:`TableArrays`. ``ukeys`` are unique keys (``EMPTY_KEY``
    entries are padding and get slot -1), with their ``counts`` (occurrences, what LFU adds)
    and ``given`` scores (CUSTOMIZED); ``policy`` is a ``ScorePolicy.code`` and ``clock`` the
    table's clock for this call.

    Group kernels (``*_group``, ``dedup_segments``; see :mod:`dynemb.tables.groups`) run
    every table of a group in one call: a group's tables share one :class:`TableArrays`,
    table ``t`` owning slots ``[row_offset[t], row_offset[t] + num_buckets[t] *
    bucket_size)``; :class:`Segments` say which table each key is of; slots in and out are
    group slots. Per-table values (``row_offset``, ``num_buckets``, ``clocks``, ``seeds``,
    ..., per-table outputs) are [T] arrays on the backend's side: numpy arrays (or CPU
    tensors) on the CPU backend, device tensors on CUDA (nothing read back).

    Example::

        >>> from dynemb.backends.numba_backends import get_backend
        >>> isinstance(get_backend("cpu"), KernelBackend)
        True
    """

    #: "cpu" or "cuda".
    name: str
    #: True: the table layer reads slot failures at a later call (reading them at once would
    #: stall the host); False: it raises at once (``dynemb.tables.group_failures``).
    defers_failures: bool
    #: Whether ``fused_update`` may read its gradients through a strided view.
    reads_strided_grads: bool
    #: Whether the kernels read host memory, so that a table's rows and its host store's
    #: arrays meet in one call (``store_find_group``, ``store_moves_group``).
    moves_store_rows: bool

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

    def gather_rows(self, weights, slots, index, dim: int, out, fallback=None,
                    keep: bool = False) -> None:
        """``out[i] = weights[slots[index[i]], :dim]`` (float32 rows, ``out`` [N, dim]
        float32); where that slot is -1, ``fallback[index[i], :dim]`` (float32 [U, >= dim]:
        the rows of keys without a slot, e.g. an eval lookup's initializer rows; only those
        rows are read), zeros without ``fallback``, and nothing with ``keep`` (``out[i]``
        stays: a second table's rows gathered over a first's): each occurrence's row in one
        launch."""

    def dedup_segments(self, keys, segments: Segments, num_buckets=None
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Segments]:
        """``(unique keys, inverse, counts, their segments)`` of each table's ``keys``; the
        inverse indexes the whole unique array. Each table's unique keys start where its
        keys start and are padded with ``EMPTY_KEY`` (count 0) to its number of keys, on
        every backend (fixed shapes, nothing read back: the segments are ``segments``). The
        CPU kernels order them by first occurrence or, with ``num_buckets`` (per table), by
        bucket of a table of that many buckets (ties in first-occurrence order); CUDA sorts
        them."""

    def find_group(self, table: TableArrays, segments: Segments, row_offset, num_buckets,
                   ukeys, out_slots) -> None:
        """``out_slots[i]``: the group slot of ``ukeys[i]`` in its table, or -1; nothing
        changes."""

    def find_or_insert_group(self, table: TableArrays, sizes, segments: Segments, row_offset,
                             num_buckets, ukeys, counts, given, policy: int, clocks,
                             allow_evict: bool, out_slots, out_inserted, out_prev_keys,
                             out_prev_scores, out_failed, out_stats=None) -> None:
        """``find_or_insert`` with ``pin`` of every table's ``ukeys`` in its own slots, at its
        own clock ``clocks[t]``, exactly as the table alone would claim them; ``sizes`` [T]
        counts each table's live keys. ``out_stats`` [T, 3] int64 (None: not counted): per
        table (keys added, live keys evicted, keys failed)."""

    def route_keys_group(self, segments: Segments, ukeys, first_rows, total_rows, out_first,
                         out_second) -> None:
        """Each key of table ``t`` to the first of two tiers of ``first_rows[t]`` and
        ``total_rows[t] - first_rows[t]`` rows (``out_first``) or to the second
        (``out_second``), as ``dynemb.foundations.key_mixing.routes_to_first`` places it;
        ``EMPTY_KEY`` in the other (in both for an ``EMPTY_KEY``). ``first_rows`` and
        ``total_rows``: [T] int64 on the keys' device."""

    def claim_counts_group(self, segments: Segments, slots, inserted, previous_keys,
                           out) -> None:
        """Per table of one group claim: ``out[t] = (hits, inserts, live keys evicted)``
        ([T, 3] int64)."""

    def add_claim_counts(self, segments: Segments, ukeys, slots, inserted, previous_keys,
                         lookups: Optional[torch.Tensor], out) -> None:
        """Per table of one group claim, added to ``out[t, :6]`` (int64, on the keys'
        device): lookups (``lookups[i]`` for key ``i``, None: 1 each), unique keys (not
        ``EMPTY_KEY``), hits, misses, inserts and live keys evicted. One launch on CUDA,
        nothing read back."""

    def init_rows_at_group(self, weights, slots, keys, mask, segments: Segments, dim, seeds,
                           table_ids, kinds, p0, p1, low, high) -> None:
        """``init_rows_at`` with each key starting from its own table's initializer
        (``kinds[t]``, ``p0[t]``, ...), seed and table id."""

    def store_find_group(self, store_keys, store_rows, store_buckets, bucket_sizes, movable,
                         ukeys, segments: Segments, want, out_rows, out_found) -> None:
        """Each ``want``-ed key of a ``movable`` table looked up in its table's host store
        (numba typed lists of arrays; rows as raw bits): ``out_found`` and the row's bits in
        ``out_rows``. Nothing changes."""

    def store_moves_group(self, weights, wb_keys, wb_scores, wb_rows, write_backs: Segments,
                          ld_keys, ld_rows, loads: Segments, store_keys, store_scores,
                          store_refcnt, store_size, store_rows, store_buckets, bucket_sizes,
                          max_capacities, grow_at, clocks, out_slots, out_inserted,
                          out_prev_keys, out_prev_scores, out_failed, out_found, out_scores,
                          out_stats) -> None:
        """Every table's write-backs of evicted rows to its host store and loads of inserted
        keys from it, each as its ``HostBackingStore`` would make them; ``out_stats`` [T,
        ``STORE_STATS``] (see ``kernels/group_stores_cpu.py``)."""

    def occurrence_csr(self, inverse, num_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(offsets [num_rows + 1], order [N])`` int64: ``order[offsets[u]:offsets[u +
        1]]`` are the positions ``i`` with ``inverse[i] == u``, in input order."""

    def copy_rows(self, src, src_slots, dst, dst_slots) -> None:
        """``dst[dst_slots[i]] = src[src_slots[i]]`` wherever both slots are >= 0 (contiguous
        tables of one dtype and width, ``dst_slots`` distinct)."""

    def remap_rows(self, old, remap, new_capacity: int) -> torch.Tensor:
        """A new [new_capacity, width] table: row ``s`` of contiguous ``old`` at ``remap[s]``
        (when >= 0, targets distinct), zeros elsewhere."""

    def has_reserved_keys(self, keys) -> bool:
        """Whether ``keys`` hold ``EMPTY_KEY`` or ``TOMBSTONE_KEY``."""
