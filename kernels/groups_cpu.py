"""CPU kernels (``@njit``) of a table group: several hash tables of one shape in one set of
arrays, each table owning a contiguous range of slots (and so of buckets), run by one call per
phase.

A group's keys come as segments, one per table, in the group's table order: table ``t``'s
keys are ``keys[seg[t]:seg[t + 1]]``. Table ``t``'s slots are ``[row_offset[t], row_offset[t]
+ num_buckets[t] * bucket_size)`` of the group's arrays; a key is hashed into its own table's
buckets only, so a table's keys never meet (or evict) another table's. Threads split the
tables. Each table's claim is exactly the single-table kernel's (``table_cpu._claim_range``)
on its range: the slots chosen are those a table of its own would choose.
"""
import numpy as np
from numba import njit, prange

from .constants import EMPTY_KEY
from .cpu_compile import prange_loops
from .hashing import bucket_index, is_live_key, mix64, probe, routes_to_first
from .init_common import fill_row
from .rng import row_stream
from .table_cpu import _claim_range, _new_work, live_end, pad_claim_outputs


@njit(cache=True, parallel=prange_loops())
def dedup_segments_cpu(keys, seg, num_buckets, pad, out_unique, out_inverse, out_counts,
                       out_useg):
    """Each segment's unique keys, segment after segment, with counts and the inverse (an
    index into the whole unique array); returns the number of entries written. ``out_useg``
    [T + 1]: where each segment's unique keys start. With ``pad`` each segment's unique keys
    start where its keys start and are padded with ``EMPTY_KEY`` (count 0) to its number of
    keys (``out_useg`` is ``seg``: the form of the CUDA dedup); else they follow one another.

    Segment ``t``'s unique keys are sorted by bucket of a table of ``num_buckets[t]``
    buckets (ties in first-occurrence order: every bucket sees its keys in batch order, so a
    claim picks the same slots as after the single-table dedup), which is the order of
    their slots: the claim and the update then walk the table front to back. A count of 0
    keeps first-occurrence order.
    """
    tables = seg.size - 1
    n = keys.size
    local_unique = np.empty(n, dtype=np.int64)
    local_counts = np.empty(n, dtype=np.int64)
    found = np.empty(tables, dtype=np.int64)
    for t in prange(tables):
        lo, hi = seg[t], seg[t + 1]
        size = 16
        while size < 2 * (hi - lo):
            size *= 2
        mask = size - 1
        set_keys = np.empty(size, dtype=np.int64)
        set_index = np.full(size, -1, dtype=np.int64)
        u = 0
        for i in range(lo, hi):
            key = keys[i]
            e = mix64(key) & mask
            while True:
                j = set_index[e]
                if j < 0:
                    set_index[e] = u
                    set_keys[e] = key
                    local_unique[lo + u] = key
                    local_counts[lo + u] = 1
                    out_inverse[i] = u
                    u += 1
                    break
                if set_keys[e] == key:
                    local_counts[lo + j] += 1
                    out_inverse[i] = j
                    break
                e = (e + 1) & mask
        found[t] = u
        buckets = num_buckets[t]
        if buckets > 0 and u > 1:  # a stable counting sort of the unique keys by bucket
            start = np.zeros(buckets + 1, dtype=np.int64)
            for j in range(u):
                start[bucket_index(local_unique[lo + j], buckets) + 1] += 1
            for b in range(buckets):
                start[b + 1] += start[b]
            moved = np.empty(u, dtype=np.int64)  # first-occurrence number -> sorted place
            for j in range(u):
                b = bucket_index(local_unique[lo + j], buckets)
                moved[j] = start[b]
                start[b] += 1
            sorted_keys = np.empty(u, dtype=np.int64)
            sorted_counts = np.empty(u, dtype=np.int64)
            for j in range(u):
                sorted_keys[moved[j]] = local_unique[lo + j]
                sorted_counts[moved[j]] = local_counts[lo + j]
            local_unique[lo:lo + u] = sorted_keys
            local_counts[lo:lo + u] = sorted_counts
            for i in range(lo, hi):
                out_inverse[i] = moved[out_inverse[i]]
    out_useg[0] = 0
    for t in range(tables):
        out_useg[t + 1] = seg[t + 1] if pad else out_useg[t] + found[t]
    for t in prange(tables):
        lo, start = seg[t], out_useg[t]
        for j in range(found[t]):
            out_unique[start + j] = local_unique[lo + j]
            out_counts[start + j] = local_counts[lo + j]
        if pad:
            for j in range(lo + found[t], seg[t + 1]):
                out_unique[j] = EMPTY_KEY
                out_counts[j] = 0
        for i in range(lo, seg[t + 1]):
            out_inverse[i] += start
    return out_useg[tables]


@njit(cache=True, parallel=prange_loops())
def find_or_insert_group_cpu(tbl_keys, tbl_scores, refcnt, sizes, row_offset, num_buckets,
                             bucket_size, ukeys, useg, counts, given, policy, clocks,
                             allow_evict, pin, out_slots, out_inserted, out_prev_keys,
                             out_prev_scores, out_failed, out_stats):
    """``find_or_insert`` of every table of a group: table ``t`` claims its unique keys
    ``ukeys[useg[t]:useg[t + 1]]`` in its own slot range with its own clock ``clocks[t]``,
    exactly as ``table_cpu.find_or_insert_cpu`` would on a table of its own. ``out_slots``
    are group slots (the table's slot plus its ``row_offset``), -1 for keys without one;
    ``sizes[t]`` counts table ``t``'s live keys. ``out_stats`` [T, 3]: per table (keys
    added, live keys evicted, keys failed). A table's trailing ``EMPTY_KEY`` padding is not
    walked (see ``table_cpu.live_end``)."""
    tables = useg.size - 1
    for t in prange(tables):
        lo = useg[t]
        hi = live_end(ukeys, lo, useg[t + 1])
        pad_claim_outputs(hi, useg[t + 1], out_slots, out_inserted, out_prev_keys,
                          out_prev_scores, out_failed)
        if hi == lo:
            out_stats[t, 0] = 0
            out_stats[t, 1] = 0
            out_stats[t, 2] = 0
            continue
        first = row_offset[t]
        end = first + num_buckets[t] * bucket_size
        added, evicted, failed = _claim_range(
            tbl_keys[first:end], tbl_scores[first:end], refcnt[first:end], num_buckets[t],
            bucket_size, ukeys, counts, given, policy, clocks[t], allow_evict, pin, lo, hi,
            out_slots, out_inserted, out_prev_keys, out_prev_scores, out_failed,
            _new_work(bucket_size))
        for j in range(lo, hi):
            if out_slots[j] >= 0:
                out_slots[j] += first
        sizes[t] += added
        out_stats[t, 0] = added
        out_stats[t, 1] = evicted
        out_stats[t, 2] = failed


@njit(cache=True, parallel=prange_loops())
def find_group_cpu(tbl_keys, row_offset, num_buckets, bucket_size, ukeys, useg, out_slots):
    """``table_cpu.find_cpu`` of every table of a group: ``out_slots[i]`` is the group slot
    of ``ukeys[i]`` in its table ``t`` (``i`` in ``useg[t]:useg[t + 1]``), or -1. Nothing is
    written to the table."""
    for t in prange(useg.size - 1):
        first = row_offset[t]
        part = tbl_keys[first:first + num_buckets[t] * bucket_size]
        for i in range(useg[t], useg[t + 1]):
            key = ukeys[i]
            s = -1 if key == EMPTY_KEY else probe(part, key, num_buckets[t], bucket_size)
            out_slots[i] = s + first if s >= 0 else -1


@njit(cache=True, parallel=prange_loops())
def route_keys_group_cpu(useg, ukeys, first_rows, total_rows, out_first, out_second):
    """Each key of table ``t`` (``useg[t]:useg[t + 1]``) to the first of its two tiers
    (``out_first``) or the second (``out_second``), by ``hashing.routes_to_first`` over
    ``first_rows[t]`` and ``total_rows[t]``; ``EMPTY_KEY`` in the other, and in both for
    ``EMPTY_KEY``."""
    for t in prange(useg.size - 1):
        first = first_rows[t]
        total = total_rows[t]
        for i in range(useg[t], useg[t + 1]):
            key = ukeys[i]
            if key == EMPTY_KEY:
                out_first[i] = EMPTY_KEY
                out_second[i] = EMPTY_KEY
            elif routes_to_first(key, first, total):
                out_first[i] = key
                out_second[i] = EMPTY_KEY
            else:
                out_first[i] = EMPTY_KEY
                out_second[i] = key


@njit(cache=True, parallel=prange_loops())
def claim_counts_group_cpu(useg, slots, inserted, prev_keys, out):
    """Per table ``t`` of a group's claim: ``out[t] = (hits, inserts, live keys evicted)``."""
    for t in prange(useg.size - 1):
        hits = 0
        new = 0
        evicted = 0
        for i in range(useg[t], useg[t + 1]):
            if slots[i] >= 0:
                if inserted[i]:
                    new += 1
                    if is_live_key(prev_keys[i]):
                        evicted += 1
                else:
                    hits += 1
        out[t, 0] = hits
        out[t, 1] = new
        out[t, 2] = evicted


@njit(cache=True, parallel=prange_loops())
def add_claim_counts_cpu(useg, ukeys, slots, inserted, prev_keys, lookups, out):
    """Per table ``t`` of a group's claim, added to ``out[t, :6]``: (lookups, unique keys,
    hits, misses, inserts, live keys evicted). Key ``i`` stands for ``lookups[i]`` lookups
    (1 each when ``lookups`` is empty); an ``EMPTY_KEY`` pads (no unique key, no miss)."""
    for t in prange(useg.size - 1):
        looked = 0
        unique = 0
        hits = 0
        misses = 0
        new = 0
        evicted = 0
        for i in range(useg[t], useg[t + 1]):
            looked += lookups[i] if lookups.size else 1
            hit = slots[i] >= 0 and not inserted[i]
            if ukeys[i] != EMPTY_KEY:
                unique += 1
                if not hit:
                    misses += 1
            if hit:
                hits += 1
            if inserted[i]:
                new += 1
                if is_live_key(prev_keys[i]):
                    evicted += 1
        out[t, 0] += looked
        out[t, 1] += unique
        out[t, 2] += hits
        out[t, 3] += misses
        out[t, 4] += new
        out[t, 5] += evicted


@njit(cache=True, parallel=prange_loops())
def init_rows_at_group_cpu(weights, slots, keys, mask, useg, dim, seeds, table_ids, kinds, p0,
                           p1, low, high):
    """``init_cpu.init_rows_at_cpu`` for a group: the key at ``i`` in table ``t``'s segment
    starts from table ``t``'s initializer (``kinds[t]``, ``p0[t]``, ...) with its seed and
    table id, so its row is the one its table alone would give it."""
    for t in prange(useg.size - 1):
        for i in range(useg[t], useg[t + 1]):
            s = slots[i]
            if s < 0 or not mask[i]:
                continue
            row = weights[s]
            fill_row(row, kinds[t], p0[t], p1[t], low[t], high[t],
                     row_stream(seeds[t], table_ids[t], keys[i]), dim)
            for j in range(dim, weights.shape[1]):
                row[j] = 0.0
