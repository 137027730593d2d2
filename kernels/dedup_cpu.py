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

from .hashing import bucket_index, mix64

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
    return 4 * n + 3 * parts + 2


@njit(cache=True, inline="always")
def _partition_buckets(p, parts, num_buckets):
    """(first bucket, number of buckets) of partition ``p``: the buckets ``b`` with
    ``b * parts // num_buckets == p``."""
    first = (p * num_buckets + parts - 1) // parts
    end = ((p + 1) * num_buckets + parts - 1) // parts
    return first, end - first


@njit(cache=True, parallel=True)
def dedup_bucket_order_cpu(keys, num_buckets, parts, chunks, scratch, out_unique, out_inverse,
                           out_counts):
    """Unique keys sorted by bucket of a table of ``num_buckets`` buckets (ties in
    first-occurrence order), with inverse indices and counts; returns U.

    The keys are copied, stably, into ``parts`` partitions of contiguous bucket ranges. Each
    partition (threads split them) is deduplicated in batch order with a small hash set and
    its unique keys counting-sorted by bucket; a prefix sum over the partitions numbers them.
    Threads take the partitions in ``chunks`` contiguous chunks. ``scratch``:
    ``bucket_dedup_scratch_size`` words.
    """
    n = keys.size
    bounds = scratch[:parts + 1]  # partition p's keys are sorted[bounds[p]:bounds[p + 1]]
    cursor = scratch[parts + 1:2 * parts + 1]
    start = scratch[2 * parts + 1:3 * parts + 2]  # numbers of partition p's unique keys
    rest = scratch[3 * parts + 2:]
    sorted_keys = rest[:n]
    origin = rest[n:2 * n]  # batch index of sorted_keys[j]
    # sorted position of the key's first occurrence; once numbered, -(unique number + 1)
    first = rest[2 * n:3 * n]
    unique_at = rest[3 * n:4 * n]  # partition p's first occurrences in bucket order
    bounds[:] = 0
    for i in range(n):
        p = bucket_index(keys[i], num_buckets) * parts // num_buckets
        first[i] = p  # the partition, until the copy
        bounds[p + 1] += 1
    largest = 1
    for p in range(parts):
        largest = max(largest, bounds[p + 1])
        bounds[p + 1] += bounds[p]
        cursor[p] = bounds[p]
    for i in range(n):
        p = first[i]
        j = cursor[p]
        cursor[p] = j + 1
        sorted_keys[j] = keys[i]
        origin[j] = i
    set_size = 16
    while set_size < 2 * largest:
        set_size *= 2
    most_buckets = (num_buckets + parts - 1) // parts + 1
    chunks = max(1, min(parts, chunks))
    start[0] = 0
    for c in prange(chunks):
        set_keys = np.empty(set_size, dtype=np.int64)
        set_first = np.empty(set_size, dtype=np.int64)
        set_part = np.full(set_size, -1, dtype=np.int64)  # entry h in use iff == p
        per_bucket = np.empty(most_buckets + 1, dtype=np.int64)
        for p in range(c * parts // chunks, (c + 1) * parts // chunks):
            lo, hi = bounds[p], bounds[p + 1]
            mask = 15  # the part of the set this partition uses: small ones stay in L1
            while mask + 1 < 2 * (hi - lo):
                mask = 2 * mask + 1
            for j in range(lo, hi):
                key = sorted_keys[j]
                h = mix64(key) & mask
                while True:
                    if set_part[h] != p:
                        set_part[h] = p
                        set_keys[h] = key
                        set_first[h] = j
                        first[j] = j
                        break
                    if set_keys[h] == key:
                        first[j] = set_first[h]
                        break
                    h = (h + 1) & mask
            # counting sort of the partition's unique keys by bucket, stable
            first_bucket, num = _partition_buckets(p, parts, num_buckets)
            per_bucket[:num + 1] = 0
            for j in range(lo, hi):
                if first[j] == j:
                    per_bucket[bucket_index(sorted_keys[j], num_buckets) - first_bucket + 1] += 1
            for b in range(num):
                per_bucket[b + 1] += per_bucket[b]
            for j in range(lo, hi):
                if first[j] == j:
                    b = bucket_index(sorted_keys[j], num_buckets) - first_bucket
                    unique_at[lo + per_bucket[b]] = j
                    per_bucket[b] += 1
            start[p + 1] = per_bucket[num]
    for p in range(parts):
        start[p + 1] += start[p]
    for c in prange(chunks):
        for p in range(c * parts // chunks, (c + 1) * parts // chunks):
            lo, hi = bounds[p], bounds[p + 1]
            for k in range(start[p + 1] - start[p]):
                j = unique_at[lo + k]
                u = start[p] + k
                out_unique[u] = sorted_keys[j]
                out_counts[u] = 0
                first[j] = -(u + 1)
            for j in range(lo, hi):
                f = first[j]
                u = -(f + 1) if f < 0 else -(first[f] + 1)
                out_inverse[origin[j]] = u
                out_counts[u] += 1
    return start[parts]
