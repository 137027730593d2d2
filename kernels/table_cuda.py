"""CUDA kernels of the scored hash table (``@cuda.jit``), one thread per key or slot.

Same rules as ``table_cpu.py``. Concurrency: a thread owns a slot only after it moves the slot's
reference count from 0 to 1 with ``atomic.cas``; during an insert no slot is ever released, so a
failed CAS marks that position as taken for good (two 64-bit masks, hence buckets of at most 128
slots) and every retry makes progress. Keys passed to the insert kernel must be unique.
"""
from numba import cuda, int64

from .constants import EMPTY_KEY, TOMBSTONE_KEY, cuda_simulator_enabled
from .hashing import bucket_base_and_start, is_live_key
from .hashing import probe as _probe_cpu
from .scoring import INT64_MAX, score_on_hit, score_on_insert

# The compiler calls the @njit probe as a device function. The simulator cannot pass its fake
# device arrays to an @njit function, so there the probe runs from the same Python source.
probe = _probe_cpu.py_func if cuda_simulator_enabled() else _probe_cpu


@cuda.jit
def find_kernel(tbl_keys, num_buckets, bucket_size, keys, out_slots):
    i = cuda.grid(1)
    if i < keys.size:
        key = keys[i]
        out_slots[i] = -1 if key == EMPTY_KEY else probe(tbl_keys, key, num_buckets, bucket_size)


@cuda.jit
def lookup_update_kernel(tbl_keys, tbl_scores, refcnt, num_buckets, bucket_size, ukeys, counts,
                         given, policy, clock, pin, out_slots, out_prev_scores):
    i = cuda.grid(1)
    if i >= ukeys.size:
        return
    key = ukeys[i]
    s = -1 if key == EMPTY_KEY else probe(tbl_keys, key, num_buckets, bucket_size)
    out_slots[i] = s
    out_prev_scores[i] = 0
    if s >= 0:
        old = tbl_scores[s]
        out_prev_scores[i] = old
        tbl_scores[s] = score_on_hit(policy, old, clock, counts[i], given[i])
        if pin:
            cuda.atomic.add(refcnt, s, 1)


@cuda.jit(device=True, inline=True)
def claim_slot(tbl_keys, tbl_scores, refcnt, base, start, bucket_size, allow_evict):
    """The slot one key claims in the bucket of slots ``base .. base + bucket_size``, probing
    from position ``start``: the first free slot (no live key) whose pin it takes (CAS 0 ->
    1); else, with ``allow_evict``, the unpinned live slot with the lowest score whose pin it
    takes; -1 if none. A slot another thread pinned first is marked taken for good (no slot
    is released during an insert), so every retry makes progress."""
    mask = bucket_size - 1
    taken = cuda.local.array(2, int64)
    taken[0] = 0
    taken[1] = 0
    claimed = -1
    for j in range(bucket_size):
        pos = (start + j) & mask
        s = base + pos
        if not is_live_key(tbl_keys[s]):
            if cuda.atomic.cas(refcnt, s, 0, 1) == 0:
                claimed = s
                break
            taken[pos >> 6] |= int64(1) << (pos & 63)
    while claimed < 0 and allow_evict:
        best = -1
        lowest = INT64_MAX
        for j in range(bucket_size):
            pos = (start + j) & mask
            if taken[pos >> 6] & (int64(1) << (pos & 63)):
                continue
            s = base + pos
            if refcnt[s] == 0 and is_live_key(tbl_keys[s]) and (best < 0 or tbl_scores[s] < lowest):
                best = s
                lowest = tbl_scores[s]
        if best < 0:
            break
        if cuda.atomic.cas(refcnt, best, 0, 1) == 0:
            claimed = best
        else:
            pos = best - base
            taken[pos >> 6] |= int64(1) << (pos & 63)
    return claimed


@cuda.jit
def insert_missing_kernel(tbl_keys, tbl_scores, refcnt, size, num_buckets, bucket_size, ukeys,
                          counts, given, policy, clock, allow_evict, slots, prev_keys,
                          prev_scores, failed):
    i = cuda.grid(1)
    if i >= ukeys.size:
        return
    key = ukeys[i]
    prev_keys[i] = EMPTY_KEY
    failed[i] = False
    if slots[i] >= 0 or key == EMPTY_KEY:
        return
    base, start = bucket_base_and_start(key, num_buckets, bucket_size)
    claimed = claim_slot(tbl_keys, tbl_scores, refcnt, base, start, bucket_size, allow_evict)
    if claimed < 0:
        failed[i] = True
        return
    prev = tbl_keys[claimed]
    prev_keys[i] = prev
    prev_scores[i] = tbl_scores[claimed]
    tbl_keys[claimed] = key
    tbl_scores[claimed] = score_on_insert(policy, clock, counts[i], given[i])
    if not is_live_key(prev):
        cuda.atomic.add(size, 0, 1)
    slots[i] = claimed


@cuda.jit
def erase_kernel(tbl_keys, tbl_scores, refcnt, size, num_buckets, bucket_size, keys, out_erased,
                 out_pinned):
    i = cuda.grid(1)
    if i >= keys.size:
        return
    key = keys[i]
    if key == EMPTY_KEY:
        return
    s = probe(tbl_keys, key, num_buckets, bucket_size)
    if s < 0:
        return
    if refcnt[s] > 0:
        out_pinned[i] = True
        return
    if cuda.atomic.cas(tbl_keys, s, key, TOMBSTONE_KEY) == key:
        tbl_scores[s] = 0
        cuda.atomic.sub(size, 0, 1)
        out_erased[i] = True


@cuda.jit
def add_refcounts_kernel(refcnt, slots, delta):
    """``refcnt[slots[i]] += delta``, never below zero, slots past the table skipped (see
    ``add_refcounts_cpu``)."""
    i = cuda.grid(1)
    if i >= slots.size or slots[i] < 0 or slots[i] >= refcnt.size:
        return
    s = slots[i]
    if delta >= 0:
        cuda.atomic.add(refcnt, s, delta)
        return
    # atomic.sub could pass zero under a concurrent release; the CAS stops at zero.
    old = refcnt[s]
    while old > 0:
        new = old + delta if old + delta > 0 else 0
        seen = cuda.atomic.cas(refcnt, s, old, new)
        if seen == old:
            return
        old = seen


@cuda.jit
def export_kernel(tbl_keys, tbl_scores, start, end, counter, out_keys, out_slots, out_scores):
    """Live entries of ``[start, end)`` in arbitrary order; the caller sorts by slot."""
    s = start + cuda.grid(1)
    if s < end:
        k = tbl_keys[s]
        if is_live_key(k):
            n = cuda.atomic.add(counter, 0, 1)
            out_keys[n] = k
            out_slots[n] = s
            out_scores[n] = tbl_scores[s]


@cuda.jit
def rehash_kernel(old_keys, old_scores, old_refcnt, new_keys, new_scores, new_refcnt,
                  new_num_buckets, bucket_size, remap, lost):
    old = cuda.grid(1)
    if old >= old_keys.size:
        return
    key = old_keys[old]
    remap[old] = -1
    if not is_live_key(key):
        return
    base, start = bucket_base_and_start(key, new_num_buckets, bucket_size)
    mask = bucket_size - 1
    for j in range(bucket_size):
        s = base + ((start + j) & mask)
        if new_keys[s] == EMPTY_KEY and cuda.atomic.cas(new_keys, s, EMPTY_KEY, key) == EMPTY_KEY:
            new_scores[s] = old_scores[old]
            new_refcnt[s] = old_refcnt[old]
            remap[old] = s
            return
    cuda.atomic.add(lost, 0, 1)
