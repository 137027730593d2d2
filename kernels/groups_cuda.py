"""CUDA kernels (``@cuda.jit``) of a table group, one thread per key: the single-table kernels
of ``table_cuda.py`` / ``init_cuda.py`` with each key in its own table's part of the group's
arrays (see ``groups_cpu.py`` for the layout).

``seg[i]`` is the table of key ``i``; table ``t`` owns the slots ``[row_offset[t],
row_offset[t] + num_buckets[t] * bucket_size)`` and scores with its own clock
``clocks[t]``. Slots in and out are group slots. Keys of one call are unique per table;
``EMPTY_KEY`` pads (slot -1, nothing written).
"""
from numba import cuda, int64

from .constants import EMPTY_KEY, cuda_simulator_enabled
from .hashing import bucket_base_and_start, is_live_key
from .hashing import probe as _probe_cpu
from .init_common import initial_value
from .rng import row_stream
from .scoring import score_on_hit, score_on_insert
from .table_cuda import claim_slot

probe = _probe_cpu.py_func if cuda_simulator_enabled() else _probe_cpu


@cuda.jit
def find_group_kernel(tbl_keys, seg, row_offset, num_buckets, bucket_size, ukeys, out_slots):
    """``table_cuda.find_kernel`` with key ``i`` in table ``seg[i]``'s slots (group slots
    out, -1 where absent); nothing is written to the table."""
    i = cuda.grid(1)
    if i >= ukeys.size:
        return
    key = ukeys[i]
    out_slots[i] = -1
    if key == EMPTY_KEY:
        return
    t = seg[i]
    first = row_offset[t]
    s = probe(tbl_keys[first:first + num_buckets[t] * bucket_size], key, num_buckets[t],
              bucket_size)
    if s >= 0:
        out_slots[i] = s + first


@cuda.jit
def lookup_update_group_kernel(tbl_keys, tbl_scores, refcnt, seg, row_offset, num_buckets,
                               bucket_size, ukeys, counts, given, policy, clocks, pin,
                               out_slots, out_prev_scores):
    """``table_cuda.lookup_update_kernel`` with key ``i`` in table ``seg[i]``'s slots."""
    i = cuda.grid(1)
    if i >= ukeys.size:
        return
    key = ukeys[i]
    out_slots[i] = -1
    out_prev_scores[i] = 0
    if key == EMPTY_KEY:
        return
    t = seg[i]
    first = row_offset[t]
    end = first + num_buckets[t] * bucket_size
    s = probe(tbl_keys[first:end], key, num_buckets[t], bucket_size)
    if s < 0:
        return
    s += first
    out_slots[i] = s
    old = tbl_scores[s]
    out_prev_scores[i] = old
    tbl_scores[s] = score_on_hit(policy, old, clocks[t], counts[i], given[i])
    if pin:
        cuda.atomic.add(refcnt, s, 1)


@cuda.jit
def insert_missing_group_kernel(tbl_keys, tbl_scores, refcnt, sizes, seg, row_offset,
                                num_buckets, bucket_size, ukeys, counts, given, policy, clocks,
                                allow_evict, slots, prev_keys, prev_scores, failed, inserted):
    """``table_cuda.insert_missing_kernel`` with key ``i`` in table ``seg[i]``'s slots and
    its live key count ``sizes[seg[i]]`` (the same claim: ``table_cuda.claim_slot``);
    ``inserted[i]``: whether key ``i`` took a slot here."""
    i = cuda.grid(1)
    if i >= ukeys.size:
        return
    key = ukeys[i]
    prev_keys[i] = EMPTY_KEY
    failed[i] = False
    inserted[i] = False
    if slots[i] >= 0 or key == EMPTY_KEY:
        return
    t = seg[i]
    base, start = bucket_base_and_start(key, num_buckets[t], bucket_size)
    base += row_offset[t]
    claimed = claim_slot(tbl_keys, tbl_scores, refcnt, base, start, bucket_size, allow_evict)
    if claimed < 0:
        failed[i] = True
        return
    prev = tbl_keys[claimed]
    prev_keys[i] = prev
    prev_scores[i] = tbl_scores[claimed]
    tbl_keys[claimed] = key
    tbl_scores[claimed] = score_on_insert(policy, clocks[t], counts[i], given[i])
    if not is_live_key(prev):
        cuda.atomic.add(sizes, t, 1)
    slots[i] = claimed
    inserted[i] = True


@cuda.jit
def init_rows_at_group_kernel(weights, slots, keys, mask, seg, dim, seeds, table_ids, kinds, p0,
                              p1, low, high):
    """``init_cuda.init_rows_at_kernel`` with key ``i`` starting from table ``seg[i]``'s
    initializer, seed and table id: one thread per element of the rows."""
    n = cuda.grid(1)
    width = weights.shape[1]
    if n < slots.size * width:
        i = n // width
        j = n - i * width
        s = slots[i]
        if s < 0 or not mask[i]:
            return
        if j < dim:
            t = seg[i]
            weights[s, j] = initial_value(kinds[t], p0[t], p1[t], low[t], high[t],
                                          row_stream(seeds[t], table_ids[t], keys[i]), j)
        else:
            weights[s, j] = 0.0


#: the most threads per block :func:`add_claim_counts_kernel` is launched with (a power of 2)
COUNT_BLOCK = 256
_CLAIM_COLUMNS = 6


@cuda.jit
def add_claim_counts_kernel(seg, ukeys, slots, inserted, prev_keys, lookups, out):
    """``groups_cpu.add_claim_counts_cpu``, one thread per key: a block whose keys are all of
    one table sums them in shared memory and adds each column once; a block across tables
    adds key by key."""
    sums = cuda.shared.array((_CLAIM_COLUMNS, COUNT_BLOCK), int64)
    i = cuda.grid(1)
    n = ukeys.size
    tid = cuda.threadIdx.x
    width = cuda.blockDim.x
    first = cuda.blockIdx.x * width
    last = min(first + width, n) - 1
    for c in range(_CLAIM_COLUMNS):
        sums[c, tid] = 0
    if i < n:
        hit = slots[i] >= 0 and not inserted[i]
        sums[0, tid] = lookups[i] if lookups.size else 1
        if ukeys[i] != EMPTY_KEY:
            sums[1, tid] = 1
            if not hit:
                sums[3, tid] = 1
        if hit:
            sums[2, tid] = 1
        if inserted[i]:
            sums[4, tid] = 1
            if is_live_key(prev_keys[i]):
                sums[5, tid] = 1
    if seg[first] != seg[last]:  # the same for every thread of the block
        if i < n:
            for c in range(_CLAIM_COLUMNS):
                if sums[c, tid]:
                    cuda.atomic.add(out, (seg[i], c), sums[c, tid])
        return
    cuda.syncthreads()
    step = width // 2
    while step > 0:
        if tid < step:
            for c in range(_CLAIM_COLUMNS):
                sums[c, tid] += sums[c, tid + step]
        cuda.syncthreads()
        step //= 2
    if tid == 0:
        for c in range(_CLAIM_COLUMNS):
            if sums[c, 0]:
                cuda.atomic.add(out, (seg[first], c), sums[c, 0])
