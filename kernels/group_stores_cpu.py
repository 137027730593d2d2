"""CPU kernel (``@njit``) of a CACHE table group's host stores: every table's write-backs and
loads in one call, each table's exactly as its own ``HostBackingStore`` does them.

A group's claim leaves, per table ``t``, evicted rows to write back (segment ``wb_seg[t]:
wb_seg[t + 1]`` of the write-back arrays) and inserted keys to load (``ld_seg[t]:ld_seg[t +
1]``). Table ``t``'s store is ``store_keys[t]``, ``store_scores[t]``, ``store_refcnt[t]``,
``store_size[t]``, ``store_rows[t]`` (numba typed lists: the stores differ in capacity), a
CUSTOMIZED scored hash table that grows by doubling; rows travel as raw bits (int32 for 4-byte
values, int16 for 2-byte), so one kernel serves every dtype.

Growth allocates, which a kernel leaves to the host: a table whose write-back would make its
store grow (the load factor passed, or a full bucket below ``max_capacity``), or that finds
no slot, is left exactly as it was and flagged, for the host to run alone.
"""
import numpy as np
from numba import njit, prange

from .constants import EMPTY_KEY, POLICY_CUSTOMIZED
from .cpu_compile import prange_loops
from .hashing import probe
from .table_cpu import _claim_range, _new_work

#: ``out_stats`` columns, per table.
STAT_WRITTEN, STAT_STORE_EVICTED, STAT_LOADED, STAT_LEFT = 0, 1, 2, 3
NUM_STATS = 4


@njit(cache=True)
def next_capacity(capacity, needed, max_capacity, bucket_size):
    """The smallest doubling of ``capacity`` that reaches ``needed``, capped at
    ``max_capacity`` (-1: none) in whole buckets; 0 when that is no growth
    (``ScoredHashTable._next_capacity``)."""
    cap = capacity
    while cap < needed:
        cap *= 2
    if max_capacity >= 0:
        cap = min(cap, max_capacity // bucket_size * bucket_size)
    return cap if cap > capacity else 0


@njit(cache=True, parallel=prange_loops())
def store_moves_group_cpu(weights, wb_keys, wb_scores, wb_rows, wb_seg, ld_keys, ld_rows,
                          ld_seg, store_keys, store_scores, store_refcnt, store_size,
                          store_rows, store_buckets, bucket_sizes, max_capacities, grow_at,
                          clocks, out_slots, out_inserted, out_prev_keys, out_prev_scores,
                          out_failed, out_found, out_scores, out_stats, threads):
    """Per table ``t``, as ``CacheTable._write_back`` then ``_load``:

    1. write-back: insert keys ``wb_keys`` with scores ``wb_scores`` into the store at clock
       ``clocks[t]`` (assume-unique, CUSTOMIZED, evicting the lowest score when a bucket is
       full and the store cannot grow), then copy rows ``weights[wb_rows]`` to their slots;
    2. load: find keys ``ld_keys`` in the store; a stored key's row is copied to
       ``weights[ld_rows]``, ``out_found`` set and ``out_scores`` given its stored score.

    Threads (``threads``: numba's count) split the tables where there are at least as many
    as threads (each table's inserts, copies and loads on one). With fewer tables (a group
    of one), the stores' inserts come first (one store's inserts run in order), then each
    table's rows, written back then loaded (its loads see its store after its write-backs,
    as alone), threads splitting its rows, as a table's own store splits them.

    ``out_stats[t]``: (rows written, store keys evicted, rows loaded, 1 if the table was left
    for the host: its ``out_found`` entries are False). ``out_slots`` ... ``out_failed`` are
    the write-back claim's scratch.
    """
    tables = wb_seg.size - 1
    if tables >= threads:  # threads split the tables
        for table in prange(tables):
            t = np.int64(table)  # typed lists take a signed index
            _write_back_keys(t, wb_keys, wb_scores, wb_seg, store_keys[t], store_scores[t],
                             store_refcnt[t], store_size[t], store_buckets[t],
                             bucket_sizes[t], max_capacities[t], grow_at[t], clocks[t],
                             out_slots, out_inserted, out_prev_keys, out_prev_scores,
                             out_failed, out_stats)
            _move_rows(t, wb_seg[t], wb_seg[t + 1], ld_seg[t], ld_seg[t + 1], weights,
                       wb_rows, ld_keys, ld_rows, store_keys[t], store_scores[t],
                       store_rows[t], store_buckets[t], bucket_sizes[t], out_slots,
                       out_found, out_scores, out_stats)
        return
    for table in prange(tables):
        t = np.int64(table)
        _write_back_keys(t, wb_keys, wb_scores, wb_seg, store_keys[t], store_scores[t],
                         store_refcnt[t], store_size[t], store_buckets[t], bucket_sizes[t],
                         max_capacities[t], grow_at[t], clocks[t], out_slots, out_inserted,
                         out_prev_keys, out_prev_scores, out_failed, out_stats)
    for table in range(tables):  # few tables: threads split each table's rows
        t = np.int64(table)
        lo, hi = ld_seg[t], ld_seg[t + 1]
        if out_stats[t, STAT_LEFT] != 0:
            out_found[lo:hi] = False
            continue
        keys, scores, rows = store_keys[t], store_scores[t], store_rows[t]
        buckets, bucket_size = store_buckets[t], bucket_sizes[t]
        for j in prange(wb_seg[t], wb_seg[t + 1]):
            _copy_row(weights[wb_rows[j]], rows[out_slots[j]])
        for j in prange(lo, hi):
            _load_row(j, ld_keys, ld_rows, keys, scores, rows, buckets, bucket_size,
                      weights, out_found, out_scores)
        out_stats[t, STAT_LOADED] = np.sum(out_found[lo:hi])


@njit(cache=True)
def _write_back_keys(t, wb_keys, wb_scores, wb_seg, keys, scores, refcnt, size, buckets,
                     bucket_size, max_capacity, grow_at, clock, out_slots, out_inserted,
                     out_prev_keys, out_prev_scores, out_failed, out_stats):
    """Table ``t``'s write-back keys into its store (keys, scores, pins, size, buckets...),
    one thread; a store that would grow or finds no slot is left as it was, flagged
    ``STAT_LEFT``."""
    for c in range(NUM_STATS):
        out_stats[t, c] = 0
    capacity = buckets * bucket_size
    lo, hi = wb_seg[t], wb_seg[t + 1]
    if hi == lo:
        return
    missing = 0
    for j in range(lo, hi):
        if probe(keys, wb_keys[j], buckets, bucket_size) < 0:
            missing += 1
    after = size[0] + missing
    if after > grow_at * capacity and next_capacity(
            capacity, np.int64(after / grow_at) + 1, max_capacity, bucket_size) > 0:
        out_stats[t, STAT_LEFT] = 1
        return
    added, evicted, failed = _claim_range(
        keys, scores, refcnt, buckets, bucket_size, wb_keys, wb_scores, wb_scores,
        POLICY_CUSTOMIZED, clock, True, False, lo, hi, out_slots, out_inserted, out_prev_keys,
        out_prev_scores, out_failed, _new_work(bucket_size))
    if failed > 0 or (evicted > 0 and next_capacity(
            capacity, capacity + 1, max_capacity, bucket_size) > 0):
        for j in range(lo, hi):  # undone: the host grows the store and runs it
            s = out_slots[j]
            if s < 0:
                continue
            if out_inserted[j]:
                keys[s] = out_prev_keys[j]
            scores[s] = out_prev_scores[j]
        out_stats[t, STAT_LEFT] = 1
        return
    size[0] += added
    out_stats[t, STAT_WRITTEN] = hi - lo
    out_stats[t, STAT_STORE_EVICTED] = evicted


@njit(cache=True, inline="always")
def _copy_row(src, dst):
    for c in range(src.size):
        dst[c] = src[c]


@njit(cache=True, inline="always")
def _load_row(j, ld_keys, ld_rows, keys, scores, rows, buckets, bucket_size, weights,
              out_found, out_scores):
    """Load ``ld_keys[j]``: its stored row into ``weights[ld_rows[j]]``, where stored."""
    key = ld_keys[j]
    s = -1 if key == EMPTY_KEY else probe(keys, key, buckets, bucket_size)
    out_found[j] = s >= 0
    out_scores[j] = scores[s] if s >= 0 else 0
    if s >= 0:
        _copy_row(rows[s], weights[ld_rows[j]])


@njit(cache=True)
def _move_rows(t, wb_lo, wb_hi, ld_lo, ld_hi, weights, wb_rows, ld_keys, ld_rows, keys,
               scores, rows, buckets, bucket_size, out_slots, out_found, out_scores,
               out_stats):
    """Table ``t``'s written-back rows to its store, then its loads, one thread."""
    if out_stats[t, STAT_LEFT] != 0:
        out_found[ld_lo:ld_hi] = False
        return
    for j in range(wb_lo, wb_hi):
        _copy_row(weights[wb_rows[j]], rows[out_slots[j]])
    loaded = 0
    for j in range(ld_lo, ld_hi):
        _load_row(j, ld_keys, ld_rows, keys, scores, rows, buckets, bucket_size, weights,
                  out_found, out_scores)
        if out_found[j]:
            loaded += 1
    out_stats[t, STAT_LOADED] = loaded


@njit(cache=True, parallel=prange_loops())
def store_find_group_cpu(store_keys, store_rows, store_buckets, bucket_sizes, movable, ukeys,
                         useg, want, out_rows, out_found):
    """Each wanted key ``ukeys[i]`` of table ``t`` (``i`` in ``useg[t]:useg[t + 1]``, for the
    tables ``movable``) looked up in its store: ``out_found[i]`` and, where found, its row's
    bits in ``out_rows[i]``. Nothing is written to the stores (``HostBackingStore.find``)."""
    for table in prange(useg.size - 1):
        t = np.int64(table)  # typed lists take a signed index
        if not movable[t]:
            continue
        keys, rows = store_keys[t], store_rows[t]
        for i in range(useg[t], useg[t + 1]):
            out_found[i] = False
            if not want[i]:
                continue
            s = probe(keys, ukeys[i], store_buckets[t], bucket_sizes[t])
            if s >= 0:
                out_found[i] = True
                for j in range(out_rows.shape[1]):
                    out_rows[i, j] = rows[s, j]
