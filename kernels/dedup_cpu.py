"""CPU dedup kernels (``@njit``): unique keys with inverse indices and counts.

Both partition the keys so each partition's hash set stays in cache:

- ``dedup_cpu``: by hash, unique keys in first-occurrence order;
- ``dedup_bucket_order_cpu``: by a hash table's bucket ranges, unique keys in bucket order
  (ties in first-occurrence order), threads splitting the partitions. That is the order
  ``find_or_insert_cpu`` claims keys in, so it can skip its own sort by bucket and write its
  results in place; the slots it picks are the same whatever the order of the unique keys
  (each bucket still sees its keys in batch order).
"""
import numpy as np
from numba import njit, prange

from .cpu_compile import prange_loops
from .hashing import (bucket_index, bucket_of_hash, mix64, partition_first_bucket,
                      partition_multiplier, partition_of_bucket)

#: Keys per partition of the dedup: its hash set (24 B an entry, 2-4 entries a key) stays in
#: the L1 / L2 cache.
DEDUP_PARTITION_KEYS = 1024


def dedup_scratch_size(n):
    """int64 words of scratch ``dedup_cpu`` needs for ``n`` keys."""
    return 3 * n + 2 * dedup_parts(n) + 1


def dedup_parts(n):
    """Partitions (a power of two) ``dedup_cpu`` splits ``n`` keys into."""
    parts = 1
    while parts * DEDUP_PARTITION_KEYS < n:
        parts *= 2
    return parts


@njit(cache=True)
def dedup_cpu(keys, parts, scratch, out_unique, out_inverse, out_counts):
    """Unique keys in first-occurrence order with inverse indices and counts; returns U.

    The keys are copied into ``parts`` (a power of two) partitions by hash, each deduplicated
    in batch order with a small open-addressing set that stays in cache; a last pass in batch
    order numbers the unique keys. ``scratch``: ``dedup_scratch_size`` words.
    """
    n = keys.size
    shift = 0
    while (np.int64(1) << shift) < parts:
        shift += 1
    bounds = scratch[:parts + 1]
    cursor = scratch[parts + 1:2 * parts + 1]
    sorted_keys = scratch[2 * parts + 1:2 * parts + 1 + n]
    first = scratch[2 * parts + 1 + n:2 * parts + 1 + 2 * n]  # batch index of a key's first
    rank = scratch[2 * parts + 1 + 2 * n:2 * parts + 1 + 3 * n]
    bounds[:] = 0
    for i in range(n):
        bounds[((mix64(keys[i]) >> (64 - shift)) & (parts - 1)) + 1 if shift else 1] += 1
    for p in range(parts):
        bounds[p + 1] += bounds[p]
        cursor[p] = bounds[p]
    largest = 1
    for i in range(n):
        key = keys[i]
        p = (mix64(key) >> (64 - shift)) & (parts - 1) if shift else 0
        j = cursor[p]
        cursor[p] = j + 1
        sorted_keys[j] = key
        first[j] = i
        rank[i] = j
    for p in range(parts):
        largest = max(largest, bounds[p + 1] - bounds[p])
    set_size = 16
    while set_size < 2 * largest:
        set_size *= 2
    mask = set_size - 1
    set_keys = np.empty(set_size, dtype=np.int64)
    set_first = np.empty(set_size, dtype=np.int64)
    set_part = np.full(set_size, -1, dtype=np.int64)  # entry h is in use iff set_part[h] == p
    for p in range(parts):
        for j in range(bounds[p], bounds[p + 1]):
            key = sorted_keys[j]
            h = mix64(key) & mask
            while True:
                if set_part[h] != p:
                    set_part[h] = p
                    set_keys[h] = key
                    set_first[h] = first[j]
                    break
                if set_keys[h] == key:
                    first[j] = set_first[h]
                    break
                h = (h + 1) & mask
    u = 0
    for i in range(n):
        f = first[rank[i]]
        if f == i:
            out_unique[u] = keys[i]
            out_counts[u] = 1
            out_inverse[i] = u
            u += 1
        else:
            j = out_inverse[f]  # numbered already: f < i
            out_counts[j] += 1
            out_inverse[i] = j
    return u


#: Chunks of partitions per thread in ``dedup_bucket_order_cpu`` (each chunk allocates and
#: clears a hash set as large as the largest partition needs: few chunks, few clears).
DEDUP_CHUNKS_PER_THREAD = 4


def bucket_dedup_scratch_size(n, parts):
    """int64 words of scratch ``dedup_bucket_order_cpu`` needs for ``n`` keys."""
    return 7 * n + 3 * parts + 2


@njit(cache=True, parallel=prange_loops())
def dedup_bucket_order_cpu(keys, num_buckets, parts, chunks, scratch, out_unique, out_inverse,
                           out_counts):
    """Unique keys sorted by bucket of a table of ``num_buckets`` buckets (ties in
    first-occurrence order), with inverse indices and counts; returns U.

    The keys are copied, stably, into ``parts`` partitions of contiguous bucket ranges. Each
    partition (threads split them) is deduplicated in batch order with a small hash set, and
    its unique keys are counting-sorted by bucket and numbered while they are in cache; a
    prefix sum over the partitions places them, and a last pass in batch order writes the
    inverse. Threads take the partitions in ``chunks`` contiguous chunks. ``scratch``:
    ``bucket_dedup_scratch_size`` words.
    """
    n = keys.size
    bounds = scratch[:parts + 1]  # partition p's keys are sorted_keys[bounds[p]:bounds[p + 1]]
    cursor = scratch[parts + 1:2 * parts + 1]
    start = scratch[2 * parts + 1:3 * parts + 2]  # number of partition p's first unique key
    rest = scratch[3 * parts + 2:]
    part_of = rest[:n]  # partition of key i
    rank = rest[n:2 * n]  # where key i went
    sorted_keys = rest[2 * n:3 * n]
    # sorted position of the key's first occurrence; at a first occurrence, once numbered,
    # -(its number within the partition + 1)
    first = rest[3 * n:4 * n]
    count = rest[4 * n:5 * n]  # occurrences, at the first occurrence
    # partition p's unique keys and counts by number, from bounds[p] on
    local_keys = rest[5 * n:6 * n]
    local_counts = rest[6 * n:7 * n]
    bounds[:] = 0
    multiplier = partition_multiplier(parts, num_buckets)
    for i in range(n):
        p = partition_of_bucket(bucket_index(keys[i], num_buckets), multiplier)
        part_of[i] = p
        bounds[p + 1] += 1
    largest = 1
    for p in range(parts):
        largest = max(largest, bounds[p + 1])
        bounds[p + 1] += bounds[p]
        cursor[p] = bounds[p]
    for i in range(n):
        p = part_of[i]
        j = cursor[p]
        cursor[p] = j + 1
        sorted_keys[j] = keys[i]
        rank[i] = j
    set_size = 16
    while set_size < 2 * largest:
        set_size *= 2
    most_buckets = 1
    for p in range(parts):
        most_buckets = max(most_buckets, partition_first_bucket(p + 1, multiplier)
                           - partition_first_bucket(p, multiplier))
    chunks = max(1, min(parts, chunks))
    start[0] = 0
    for c in prange(chunks):
        set_keys = np.empty(set_size, dtype=np.int64)
        set_first = np.empty(set_size, dtype=np.int64)
        set_part = np.full(set_size, -1, dtype=np.int64)  # entry e in use iff == p
        per_bucket = np.empty(most_buckets + 1, dtype=np.int64)
        for p in range(c * parts // chunks, (c + 1) * parts // chunks):
            lo, hi = bounds[p], bounds[p + 1]
            mask = 15  # the part of the set this partition uses: small ones stay in L1
            while mask + 1 < 2 * (hi - lo):
                mask = 2 * mask + 1
            first_bucket = partition_first_bucket(p, multiplier)
            num = partition_first_bucket(p + 1, multiplier) - first_bucket
            per_bucket[:num + 1] = 0
            for j in range(lo, hi):
                key = sorted_keys[j]
                h = mix64(key)
                e = h & mask
                while True:
                    if set_part[e] != p:
                        set_part[e] = p
                        set_keys[e] = key
                        set_first[e] = j
                        first[j] = j
                        count[j] = 1
                        per_bucket[bucket_of_hash(h, num_buckets) - first_bucket + 1] += 1
                        break
                    if set_keys[e] == key:
                        f = set_first[e]
                        first[j] = f
                        count[f] += 1
                        break
                    e = (e + 1) & mask
            for b in range(num):
                per_bucket[b + 1] += per_bucket[b]
            start[p + 1] = per_bucket[num]
            for j in range(lo, hi):  # number the unique keys by bucket, stably
                if first[j] == j:
                    b = bucket_index(sorted_keys[j], num_buckets) - first_bucket
                    k = per_bucket[b]
                    per_bucket[b] = k + 1
                    local_keys[lo + k] = sorted_keys[j]
                    local_counts[lo + k] = count[j]
                    first[j] = -(k + 1)
    for p in range(parts):
        start[p + 1] += start[p]
    for p in prange(parts):
        lo = bounds[p]
        for k in range(start[p + 1] - start[p]):
            out_unique[start[p] + k] = local_keys[lo + k]
            out_counts[start[p] + k] = local_counts[lo + k]
    for i in prange(n):
        f = first[rank[i]]
        if f >= 0:
            f = first[f]
        out_inverse[i] = start[part_of[i]] - f - 1
    return start[parts]
