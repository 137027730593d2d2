"""CPU kernels of the scored hash table (``@njit``).

Read-only kernels run in parallel (``prange``); kernels that claim slots keep batch order within
each bucket (threads split the buckets), which makes their victims and slot choices
deterministic and independent of the thread count. The CUDA twins in ``table_cuda.py``
implement the same rules with atomics. See docs/hash_table.md for the insert path.

Arrays: ``tbl_keys`` [C] int64, ``tbl_scores`` [C] int64, ``refcnt`` [C] int32, ``size`` [1]
int64, with ``C = num_buckets * bucket_size``.
"""
from typing import NamedTuple

import numpy as np
from numba import njit, prange
from numba.cpython.unsafe.numbers import trailing_zeros

from .constants import EMPTY_KEY, POLICY_CUSTOMIZED, TOMBSTONE_KEY
from .cpu_compile import prange_loops
from .hashing import (bucket_base_and_start, bucket_index, is_live_key, partition_multiplier,
                      partition_of_bucket, probe)
from .scoring import INT64_MAX, reads_counts, score_on_hit, score_on_insert


@njit(cache=True, inline="always")
def live_end(keys, lo, hi):
    """The end of ``keys[lo:hi]`` without its trailing ``EMPTY_KEY`` padding. A group's
    dedup pads each table's unique keys at the end of its segment; the host kernels claim up
    to there and write the padding's outputs without probing, so a step costs what its unique
    keys cost, not what its input keys do (a backward scan over the padding only)."""
    while hi > lo and keys[hi - 1] == EMPTY_KEY:
        hi -= 1
    return hi


@njit(cache=True)
def pad_claim_outputs(lo, hi, out_slots, out_inserted, out_prev_keys, out_prev_scores,
                      out_failed):
    """The outputs of a claim of ``EMPTY_KEY`` padding at ``[lo, hi)``: no slot, nothing
    inserted or failed, no previous key (what ``_claim_range`` writes for a padding key)."""
    for j in range(lo, hi):
        out_slots[j] = -1
        out_inserted[j] = False
        out_failed[j] = False
        out_prev_keys[j] = EMPTY_KEY
        out_prev_scores[j] = 0


@njit(cache=True, parallel=prange_loops())
def find_cpu(tbl_keys, num_buckets, bucket_size, keys, out_slots):
    """``out_slots[i]`` = slot of ``keys[i]`` or -1. Duplicates allowed; nothing is written."""
    for i in prange(keys.size):
        key = keys[i]
        out_slots[i] = -1 if key == EMPTY_KEY else probe(tbl_keys, key, num_buckets, bucket_size)


@njit(cache=True)
def find_serial_cpu(tbl_keys, num_buckets, bucket_size, keys, out_slots):
    """Single-threaded ``find_cpu`` (for benchmarks and small batches)."""
    for i in range(keys.size):
        key = keys[i]
        out_slots[i] = -1 if key == EMPTY_KEY else probe(tbl_keys, key, num_buckets, bucket_size)


@njit(cache=True, parallel=prange_loops())
def lookup_update_cpu(tbl_keys, tbl_scores, refcnt, num_buckets, bucket_size, ukeys, counts,
                      given, policy, clock, pin, out_slots, out_prev_scores):
    """Find unique keys; for hits, update the score by policy and optionally add one pin.

    ``ukeys`` must hold no duplicates (so parallel writes never collide). ``out_prev_scores``
    keeps the score before the update so a failed batch can be rolled back.
    """
    for i in prange(ukeys.size):
        key = ukeys[i]
        s = -1 if key == EMPTY_KEY else probe(tbl_keys, key, num_buckets, bucket_size)
        out_slots[i] = s
        out_prev_scores[i] = 0
        if s >= 0:
            old = tbl_scores[s]
            out_prev_scores[i] = old
            tbl_scores[s] = score_on_hit(policy, old, clock, counts[i], given[i])
            if pin:
                refcnt[s] += 1


@njit(cache=True, parallel=prange_loops())
def insert_missing_cpu(tbl_keys, tbl_scores, refcnt, size, num_buckets, bucket_size, ukeys,
                       counts, given, policy, clock, allow_evict, slots, prev_keys, prev_scores,
                       failed, threads):
    """Give every unique key with ``slots[i] < 0`` a slot, in batch order within each bucket.

    A key takes the first EMPTY or TOMBSTONE slot of its probe sequence; in a full bucket it
    takes the unpinned live slot with the lowest score (ties: earliest in probe order), and the
    displaced key is left in ``prev_keys[i]``. Claimed slots get one pin (``refcnt``), so no
    later key of the batch can displace them. No candidate: ``failed[i] = True``.

    A key only ever touches its own bucket, so thread ``t`` handles the buckets with
    ``bucket % threads == t``: race-free, and the result does not depend on the thread count.
    """
    added = np.zeros(threads, dtype=np.int64)
    for t in prange(threads):
        for i in range(ukeys.size):
            key = ukeys[i]
            if key == EMPTY_KEY:
                if t == 0:
                    prev_keys[i] = EMPTY_KEY
                    failed[i] = False
                continue
            base, start = bucket_base_and_start(key, num_buckets, bucket_size)
            if (base // bucket_size) % threads != t:
                continue
            prev_keys[i] = EMPTY_KEY
            failed[i] = False
            if slots[i] >= 0:
                continue
            claimed = _claim_slot(tbl_keys, tbl_scores, refcnt, base, start, bucket_size,
                                  allow_evict)
            if claimed < 0:
                failed[i] = True
                continue
            prev = tbl_keys[claimed]
            prev_keys[i] = prev
            prev_scores[i] = tbl_scores[claimed]
            tbl_keys[claimed] = key
            tbl_scores[claimed] = score_on_insert(policy, clock, counts[i], given[i])
            refcnt[claimed] += 1
            if not is_live_key(prev):
                added[t] += 1
            slots[i] = claimed
    size[0] += added.sum()


@njit(cache=True)
def _claim_slot(tbl_keys, tbl_scores, refcnt, base, start, bucket_size, allow_evict):
    """First free slot of the probe, else the lowest-score unpinned live slot, else -1.

    One pass: a free slot ends the scan; until then the lowest candidate is tracked. Free
    (EMPTY/TOMBSTONE) slots always have a zero reference count: pins need a live key.
    """
    mask = bucket_size - 1
    claimed = -1
    lowest = INT64_MAX
    for j in range(bucket_size):
        s = base + ((start + j) & mask)
        if not is_live_key(tbl_keys[s]):
            return s
        if allow_evict and refcnt[s] == 0 and (claimed < 0 or tbl_scores[s] < lowest):
            claimed = s
            lowest = tbl_scores[s]
    return claimed


@njit(cache=True)
def erase_cpu(tbl_keys, tbl_scores, refcnt, size, num_buckets, bucket_size, keys, out_erased,
              out_pinned):
    """Replace each found, unpinned key by a TOMBSTONE. Pinned keys stay and are reported."""
    for i in range(keys.size):
        key = keys[i]
        if key == EMPTY_KEY:
            continue
        s = probe(tbl_keys, key, num_buckets, bucket_size)
        if s < 0:
            continue
        if refcnt[s] > 0:
            out_pinned[i] = True
            continue
        tbl_keys[s] = TOMBSTONE_KEY
        tbl_scores[s] = 0
        size[0] -= 1
        out_erased[i] = True


@njit(cache=True)
def add_refcounts_cpu(refcnt, slots, delta):
    """``refcnt[slots[i]] += delta`` for every ``slots[i]`` in ``[0, refcnt.size)``
    (duplicates count each time; a slot past the table is skipped: nothing is written out of
    bounds).

    A count never goes below zero: a release without a matching pin is dropped, so it cannot
    leave a later pin at zero (a pinned slot that is evictable).
    """
    for i in range(slots.size):
        s = slots[i]
        if s >= 0 and s < refcnt.size:
            count = refcnt[s] + delta
            refcnt[s] = count if count > 0 else 0


@njit(cache=True)
def export_cpu(tbl_keys, tbl_scores, start, end, out_keys, out_slots, out_scores):
    """Copy the live entries of slots ``[start, end)`` to the outputs, in slot order."""
    n = 0
    for s in range(start, end):
        k = tbl_keys[s]
        if is_live_key(k):
            out_keys[n] = k
            out_slots[n] = s
            out_scores[n] = tbl_scores[s]
            n += 1
    return n


@njit(cache=True)
def rehash_cpu(old_keys, old_scores, old_refcnt, new_keys, new_scores, new_refcnt,
               new_num_buckets, bucket_size, remap):
    """Insert every live entry into the (empty) new arrays; ``remap[old] = new`` or -1.

    Returns the number of entries that found no slot (the caller then keeps the old table).
    """
    mask = bucket_size - 1
    lost = 0
    for old in range(old_keys.size):
        key = old_keys[old]
        remap[old] = -1
        if not is_live_key(key):
            continue
        base, start = bucket_base_and_start(key, new_num_buckets, bucket_size)
        placed = False
        for j in range(bucket_size):
            s = base + ((start + j) & mask)
            if new_keys[s] == EMPTY_KEY:
                new_keys[s] = key
                new_scores[s] = old_scores[old]
                new_refcnt[s] = old_refcnt[old]
                remap[old] = s
                placed = True
                break
        if not placed:
            lost += 1
    return lost


@njit(cache=True)
def count_reserved_cpu(keys):
    """Number of EMPTY/TOMBSTONE keys (one pass; the public API rejects them)."""
    n = 0
    for i in range(keys.size):
        if not is_live_key(keys[i]):
            n += 1
    return n


@njit(cache=True)
def claim_summary_cpu(slots, inserted, prev_keys):
    """(keys placed, keys inserted, live keys evicted) of one find_or_insert, in one pass."""
    placed = 0
    new = 0
    evicted = 0
    for i in range(slots.size):
        if slots[i] >= 0:
            placed += 1
            if inserted[i]:
                new += 1
                if is_live_key(prev_keys[i]):
                    evicted += 1
    return placed, new, evicted


# -- find_or_insert in bucket order ------------------------------------------------------------
# A batch is split into partitions, each a contiguous range of buckets, and every partition is
# processed on its own: first its keys in batch order (hits rescored, misses placed in the first
# free slot of their probe, misses of full buckets deferred), then its deferred keys, which evict.
# A partition's slots stay in cache while it is processed, so a large batch walks through the
# table instead of missing the cache once per array per key (hence no digest array: it would
# add a cache line to every insert and save nothing once a bucket is in cache). Keys never leave their bucket and
# a bucket keeps batch order, so the slots chosen are those of two passes over the whole batch
# (every lookup, then every claim) and do not depend on the number of partitions or threads.

#: Threads take the partitions in this many contiguous chunks.
CLAIM_CHUNKS = 64
ALL_BITS = np.uint64(0xFFFFFFFFFFFFFFFF)
#: 2**64 / golden ratio as int64: a multiplicative hash for the key filter
FILTER_MULTIPLIER = np.int64(-7046029254386353131)


@njit(cache=True)
def _locate(tbl_keys, key, base, start, bucket_size):
    """(slot holding ``key`` or -1, first free slot of its probe or -1). One compare per slot
    on the common path: the two reserved keys are the two smallest int64."""
    mask = bucket_size - 1
    free = -1
    for j in range(bucket_size):
        s = base + ((start + j) & mask)
        k = tbl_keys[s]
        if k == key:
            return s, -1
        if k <= TOMBSTONE_KEY:
            if k == EMPTY_KEY:
                return -1, (s if free < 0 else free)
            if free < 0:
                free = s
    return -1, free


@njit(cache=True)
def _find_in_full_bucket(tbl_keys, key, base, start, bucket_size):
    """Slot holding ``key`` in a bucket without free slots, or -1."""
    hits = 0
    for s in range(base, base + bucket_size):
        hits += np.int64(tbl_keys[s] == key)
    if hits == 0:
        return -1
    mask = bucket_size - 1
    for j in range(bucket_size):
        s = base + ((start + j) & mask)
        if tbl_keys[s] == key:
            return s
    return -1


@njit(cache=True)
def _lowest_candidates(cand_scores, cand_ok, bucket_size):
    """Lowest candidate score and the positions holding it, a 128-bit mask (two words)."""
    lowest = INT64_MAX
    for pos in range(bucket_size):
        lowest = min(lowest, cand_scores[pos] if cand_ok[pos] else INT64_MAX)
    low_bits = np.uint64(0)
    high_bits = np.uint64(0)
    for pos in range(min(bucket_size, 64)):
        hit = cand_ok[pos] and cand_scores[pos] == lowest
        low_bits |= np.uint64(hit) << np.uint64(pos)
    for pos in range(64, bucket_size):
        hit = cand_ok[pos] and cand_scores[pos] == lowest
        high_bits |= np.uint64(hit) << np.uint64(pos - 64)
    return lowest, low_bits, high_bits


@njit(cache=True)
def _first_bit_from(low_bits, high_bits, start):
    """First set position of the 128-bit mask in probe order from ``start`` (circular over the
    bucket; bits past the bucket are clear), or -1."""
    zero = np.uint64(0)
    if start < 64:
        ahead = low_bits & (ALL_BITS << np.uint64(start))
        if ahead != zero:
            return np.int64(trailing_zeros(ahead))
        if high_bits != zero:
            return 64 + np.int64(trailing_zeros(high_bits))
    else:
        ahead = high_bits & (ALL_BITS << np.uint64(start - 64))
        if ahead != zero:
            return 64 + np.int64(trailing_zeros(ahead))
    if low_bits != zero:
        return np.int64(trailing_zeros(low_bits))
    if high_bits != zero:
        return 64 + np.int64(trailing_zeros(high_bits))
    return np.int64(-1)


@njit(cache=True)
def _filter_bit(key):
    """Position of ``key`` in a bucket's 1024-bit membership filter."""
    return ((key * FILTER_MULTIPLIER) >> 54) & 1023


@njit(cache=True)
def _take_slot(tbl_keys, tbl_scores, s, j, key, score, out_slots, out_inserted, out_prev_keys,
               out_prev_scores):
    out_prev_keys[j] = tbl_keys[s]
    out_prev_scores[j] = tbl_scores[s]
    tbl_keys[s] = key
    tbl_scores[s] = score
    out_slots[j] = s
    out_inserted[j] = True


class _Work(NamedTuple):
    """Per-thread buffers of ``_claim_range``."""

    key_filter: np.ndarray  # [16] uint64: 1024-bit filter of a full bucket's keys
    cand_scores: np.ndarray  # [bucket_size] int64: scores of a bucket's eviction candidates
    cand_ok: np.ndarray  # [bucket_size] bool: which slots are candidates


@njit(cache=True)
def _new_work(bucket_size):
    return _Work(np.zeros(16, dtype=np.uint64), np.empty(bucket_size, dtype=np.int64),
                 np.empty(bucket_size, dtype=np.bool_))


@njit(cache=True)
def _claim_range(tbl_keys, tbl_scores, refcnt, num_buckets, bucket_size, keys, counts, given,
                 policy, clock, allow_evict, pin, lo, hi, out_slots, out_inserted, out_prev_keys,
                 out_prev_scores, out_failed, work):
    """Keys ``keys[lo:hi]``, whose buckets no other range touches; returns (keys added, live
    keys evicted, keys failed). ``counts`` / ``given`` are read only by LFU / CUSTOMIZED.

    Keys of one bucket that follow each other share its scans: a bucket found full stays full
    (nothing is freed during a call), and the eviction candidates of a bucket are gathered once
    per run of its keys."""
    added = 0
    deferred = 0
    full_base = -1
    # Keys of a full bucket: a 1024-bit filter of its keys (built at the second lookup in a
    # row) rules most misses out without a scan; the bucket's keys do not change meanwhile.
    key_filter = work.key_filter
    filter_base = -1
    full_lookups = 0
    for j in range(lo, hi):
        key = keys[j]
        out_slots[j] = -1
        out_inserted[j] = False
        out_failed[j] = False
        out_prev_keys[j] = EMPTY_KEY
        out_prev_scores[j] = 0
        if key == EMPTY_KEY:
            continue
        base, start = bucket_base_and_start(key, num_buckets, bucket_size)
        if base == full_base:
            free = -1
            full_lookups += 1
            if full_lookups == 2 and filter_base != base:
                filter_base = base
                key_filter[:] = 0
                for q in range(base, base + bucket_size):
                    bit = _filter_bit(tbl_keys[q])
                    key_filter[bit >> 6] |= np.uint64(1) << np.uint64(bit & 63)
            s = -1
            bit = _filter_bit(key)
            if filter_base != base or (
                    key_filter[bit >> 6] & (np.uint64(1) << np.uint64(bit & 63))) != 0:
                s = _find_in_full_bucket(tbl_keys, key, base, start, bucket_size)
        else:
            full_lookups = 0
            s, free = _locate(tbl_keys, key, base, start, bucket_size)
            if s < 0 and free < 0:
                full_base = base
        count = counts[j] if reads_counts(policy) else 0
        mine = given[j] if policy == POLICY_CUSTOMIZED else 0
        if s >= 0:
            old = tbl_scores[s]
            out_prev_scores[j] = old
            tbl_scores[s] = score_on_hit(policy, old, clock, count, mine)
            out_slots[j] = s
        elif free >= 0:
            s = free
            _take_slot(tbl_keys, tbl_scores, s, j, key,
                       score_on_insert(policy, clock, count, mine), out_slots, out_inserted,
                       out_prev_keys, out_prev_scores)
            added += 1
        else:
            deferred += 1
            continue
        if pin:
            refcnt[s] += 1
    if deferred == 0:
        return added, 0, 0
    # Evictions: this call's slots are pinned (for the caller or just until the end) so that
    # no key of the batch displaces another.
    if not pin:
        for j in range(lo, hi):
            s = out_slots[j]
            if s >= 0:
                refcnt[s] += 1
    evicted = 0
    failed = 0
    cand_scores = work.cand_scores
    cand_ok = work.cand_ok
    cand_base = -1
    low_bits = np.uint64(0)
    high_bits = np.uint64(0)
    for j in range(lo, hi):
        key = keys[j]
        if key == EMPTY_KEY or out_slots[j] >= 0:
            continue
        pos = -1
        base, start = bucket_base_and_start(key, num_buckets, bucket_size)
        if allow_evict:
            if base != cand_base:
                # Candidates: unpinned live slots. Claims only remove candidates, so the lowest
                # score and its positions stay valid until every one of them is claimed.
                cand_base = base
                for q in range(bucket_size):
                    s = base + q
                    cand_ok[q] = refcnt[s] == 0 and tbl_keys[s] > TOMBSTONE_KEY
                    cand_scores[q] = tbl_scores[s]
                _, low_bits, high_bits = _lowest_candidates(cand_scores, cand_ok, bucket_size)
            pos = _first_bit_from(low_bits, high_bits, start)
            if pos < 0:
                _, low_bits, high_bits = _lowest_candidates(cand_scores, cand_ok, bucket_size)
                pos = _first_bit_from(low_bits, high_bits, start)
            if pos >= 0:
                cand_ok[pos] = False
                if pos < 64:
                    low_bits &= ~(np.uint64(1) << np.uint64(pos))
                else:
                    high_bits &= ~(np.uint64(1) << np.uint64(pos - 64))
        if pos < 0:
            out_failed[j] = True
            failed += 1
            continue
        s = base + pos
        count = counts[j] if reads_counts(policy) else 0
        mine = given[j] if policy == POLICY_CUSTOMIZED else 0
        _take_slot(tbl_keys, tbl_scores, s, j, key, score_on_insert(policy, clock, count, mine),
                   out_slots, out_inserted, out_prev_keys, out_prev_scores)
        refcnt[s] += 1
        evicted += 1
    if not pin:
        for j in range(lo, hi):
            s = out_slots[j]
            if s >= 0:
                refcnt[s] -= 1
    return added, evicted, failed


def scratch_size(n, parts, policy):
    """int64 words of scratch ``find_or_insert_cpu`` needs for ``n`` keys in ``parts``."""
    if parts == 1:
        return 0
    extra = n if reads_counts(policy) or policy == POLICY_CUSTOMIZED else 0
    return 6 * n + extra + 5 * parts + 1  # bounds, rank, stats; cursor, keys, side, records


@njit(cache=True)
def _count_by_partition(ukeys, n, num_buckets, parts, bounds, part_of):
    """``part_of[i]``: the partition of key ``i < n`` (``parts`` contiguous ranges of buckets,
    see ``partition_multiplier``); ``bounds[p]``: where partition ``p`` starts in
    partition order. Returns True when the keys are in partition order already.

    An ``EMPTY_KEY`` (padding, or a key routed elsewhere) claims nothing: it goes with the
    key before it, so that it never breaks an order the live keys are in."""
    bounds[:] = 0
    in_order = True
    last = 0
    multiplier = partition_multiplier(parts, num_buckets)
    for i in range(n):
        key = ukeys[i]
        p = last if key == EMPTY_KEY else partition_of_bucket(bucket_index(key, num_buckets),
                                                              multiplier)
        part_of[i] = p
        bounds[p + 1] += 1
        in_order = in_order and p >= last
        last = p
    for p in range(parts):
        bounds[p + 1] += bounds[p]
    return in_order


@njit(cache=True)
def _sort_by_partition(ukeys, n, counts, given, policy, parts, bounds, rank, scratch):
    """Copies of the keys (and of what the policy reads of counts / given) ordered by
    partition, stably: partition ``p``'s keys are ``[bounds[p], bounds[p + 1])``. ``rank[i]``
    holds key ``i``'s partition on entry (``_count_by_partition``), where it went on return.
    Everything is carved out of ``scratch``; returns the rest of it (keys ``i < n`` only)."""
    cursor = scratch[:parts]
    keys = scratch[parts:parts + n]
    rest = scratch[parts + n:]
    sorted_side = rest[:n] if reads_counts(policy) or policy == POLICY_CUSTOMIZED else rest[:0]
    rest = rest[sorted_side.size:]
    for p in range(parts):
        cursor[p] = bounds[p]
    side = counts if reads_counts(policy) else given
    for i in range(n):
        key = ukeys[i]
        p = rank[i]
        j = cursor[p]
        cursor[p] = j + 1
        keys[j] = key
        rank[i] = j
        if sorted_side.size:
            sorted_side[j] = side[i]
    return keys, sorted_side, rest


@njit(cache=True, parallel=prange_loops())
def find_or_insert_cpu(tbl_keys, tbl_scores, refcnt, size, num_buckets, bucket_size, ukeys,
                       counts, given, policy, clock, allow_evict, pin, parts, scratch,
                       out_slots, out_inserted, out_prev_keys, out_prev_scores, out_failed,
                       out_stats):
    """Find every unique key, placing the missing ones.

    Hits are rescored by ``policy``; a missing key takes the first EMPTY or TOMBSTONE slot of
    its probe, or in a full bucket (when ``allow_evict``) the unpinned live slot with the lowest
    score (ties: earliest in probe order), after every hit and free-slot claim of its bucket, in
    batch order. No slot hit or claimed by the call is a victim. With ``pin`` each returned
    slot gets one pin. ``out_prev_keys`` / ``out_prev_scores``: what a claimed slot held (a hit
    keeps its old score there). ``out_stats``: (keys failed, live keys evicted).

    ``parts`` > 1: the keys are first copied in bucket order (``parts`` partitions of the
    buckets, ``scratch`` of ``scratch_size`` words), unless they come in that order already
    (``dedup_bucket_order_cpu``), and threads split the partitions; 1: the whole batch in
    order, on one thread. Trailing ``EMPTY_KEY`` padding (a group's dedup) is not walked:
    its outputs are written as such (``live_end``).
    """
    n = live_end(ukeys, 0, ukeys.size)
    pad_claim_outputs(n, ukeys.size, out_slots, out_inserted, out_prev_keys, out_prev_scores,
                      out_failed)
    if parts == 1:
        added, evicted, failed = _claim_range(
            tbl_keys, tbl_scores, refcnt, num_buckets, bucket_size, ukeys, counts, given, policy,
            clock, allow_evict, pin, 0, n, out_slots, out_inserted, out_prev_keys,
            out_prev_scores, out_failed, _new_work(bucket_size))
        size[0] += added
        out_stats[0] = failed
        out_stats[1] = evicted
        return
    bounds = scratch[:parts + 1]
    rank = scratch[parts + 1:parts + 1 + n]
    stats = scratch[parts + 1 + n:4 * parts + 1 + n].reshape((parts, 3))
    stats[:] = 0
    chunks = min(parts, CLAIM_CHUNKS)
    if _count_by_partition(ukeys, n, num_buckets, parts, bounds, rank):
        # already in bucket order (dedup_bucket_order_cpu): claim in place
        for c in prange(chunks):
            work = _new_work(bucket_size)
            for p in range(c * parts // chunks, (c + 1) * parts // chunks):
                stats[p, 0], stats[p, 1], stats[p, 2] = _claim_range(
                    tbl_keys, tbl_scores, refcnt, num_buckets, bucket_size, ukeys, counts,
                    given, policy, clock, allow_evict, pin, bounds[p], bounds[p + 1],
                    out_slots, out_inserted, out_prev_keys, out_prev_scores, out_failed, work)
        size[0] += stats[:, 0].sum()
        out_stats[0] = stats[:, 2].sum()
        out_stats[1] = stats[:, 1].sum()
        return
    keys, side, rest = _sort_by_partition(ukeys, n, counts, given, policy, parts, bounds, rank,
                                          scratch[4 * parts + 1 + n:])
    # One record per key (slot, previous key, previous score, flag), 32 bytes: a single cache
    # line to read when the results go back to batch order. The flag column takes both
    # "inserted" and "failed" (a failed key has no slot).
    rec = rest[:4 * n].reshape((n, 4))
    for c in prange(chunks):
        work = _new_work(bucket_size)
        for p in range(c * parts // chunks, (c + 1) * parts // chunks):
            stats[p, 0], stats[p, 1], stats[p, 2] = _claim_range(
                tbl_keys, tbl_scores, refcnt, num_buckets, bucket_size, keys, side, side,
                policy, clock, allow_evict, pin, bounds[p], bounds[p + 1], rec[:, 0],
                rec[:, 3], rec[:, 1], rec[:, 2], rec[:, 3], work)
    for i in prange(n):
        j = rank[i]
        s = rec[j, 0]
        out_slots[i] = s
        out_prev_keys[i] = rec[j, 1]
        out_prev_scores[i] = rec[j, 2]
        out_inserted[i] = s >= 0 and rec[j, 3] != 0
        out_failed[i] = s < 0 and ukeys[i] != EMPTY_KEY
    size[0] += stats[:, 0].sum()
    out_stats[0] = stats[:, 2].sum()
    out_stats[1] = stats[:, 1].sum()
