"""CPU kernels of the scored hash table (``@njit``).

Read-only kernels run in parallel (``prange``); kernels that claim slots run sequentially in
batch order, which makes their victims and slot choices deterministic. The CUDA twins in
``table_cuda.py`` implement the same rules with atomics.

Arrays: ``tbl_keys`` [C] int64, ``tbl_scores`` [C] int64, ``refcnt`` [C] int32, ``size`` [1]
int64, with ``C = num_buckets * bucket_size``.
"""
import numpy as np
from numba import njit, prange

from .constants import EMPTY_KEY, TOMBSTONE_KEY
from .hashing import bucket_base_and_start, is_live_key, mix64, probe
from .scoring import INT64_MAX, score_on_hit, score_on_insert


@njit(cache=True, parallel=True)
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


@njit(cache=True, parallel=True)
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


@njit(cache=True, parallel=True)
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


@njit(cache=True, inline="always")
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
    """``refcnt[slots[i]] += delta`` for every ``slots[i] >= 0`` (duplicates count each time).

    A count never goes below zero: a release without a matching pin is dropped, so it cannot
    leave a later pin at zero (a pinned slot that is evictable).
    """
    for i in range(slots.size):
        s = slots[i]
        if s >= 0:
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
def dedup_cpu(keys, scratch, out_unique, out_inverse, out_counts):
    """Unique keys in first-occurrence order with inverse indices and counts; returns U.

    ``scratch`` [2 * S] is a throwaway open-addressing set of (key, unique index) pairs, S a
    power of two >= 2 * ``keys.size``, keys filled with EMPTY_KEY; ``keys`` holds no EMPTY_KEY.
    """
    mask = scratch.size // 2 - 1
    n = 0
    for i in range(keys.size):
        key = keys[i]
        h = mix64(key) & mask
        while True:
            k = scratch[2 * h]
            if k == EMPTY_KEY:
                scratch[2 * h] = key
                scratch[2 * h + 1] = n
                out_unique[n] = key
                out_counts[n] = 1
                out_inverse[i] = n
                n += 1
                break
            if k == key:
                j = scratch[2 * h + 1]
                out_counts[j] += 1
                out_inverse[i] = j
                break
            h = (h + 1) & mask
    return n


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
