"""CPU kernels that move whole rows between flat tables (``prange``; rows are copied as raw
bits, so one kernel serves every dtype: callers view 2-byte rows as int16, 4-byte as int32).

- ``copy_rows_cpu``: row ``src_slots[i]`` of ``src`` to row ``dst_slots[i]`` of ``dst`` (a
  CACHE table's write-back to its store and load from it, without a gathered intermediate);
- ``remap_rows_cpu``: every row of a table that grew to its new slot, in one pass over the
  new table (each new row written once: the row that moved there, or zeros).
"""
import numpy as np
from numba import njit, prange

from .cpu_compile import prange_loops
from .prefetch_cpu import PREFETCH_DISTANCE, prefetch_row


@njit(cache=True, parallel=prange_loops())
def copy_rows_cpu(src, src_slots, dst, dst_slots):
    """``dst[dst_slots[i]] = src[src_slots[i]]`` for every ``i`` with both slots >= 0 (the
    destination slots distinct)."""
    n = src_slots.size
    width = src.shape[1]
    for i in prange(n):
        ahead = i + PREFETCH_DISTANCE
        if ahead < n and src_slots[ahead] >= 0:  # scattered rows: overlap their misses
            prefetch_row(src, src_slots[ahead], width)
        s, d = src_slots[i], dst_slots[i]
        if s < 0 or d < 0:
            continue
        row, out = src[s], dst[d]
        for j in range(width):
            out[j] = row[j]


@njit(cache=True, parallel=prange_loops())
def remap_rows_cpu(old, remap, new):
    """``new[remap[s]] = old[s]`` for every old row with ``remap[s] >= 0`` (distinct targets);
    every other row of ``new`` becomes zeros. ``new`` may start uninitialised."""
    source = np.full(new.shape[0], -1, dtype=np.int64)
    for s in range(remap.size):
        if remap[s] >= 0:
            source[remap[s]] = s
    width = new.shape[1]
    for t in prange(new.shape[0]):
        s = source[t]
        out = new[t]
        if s < 0:
            for j in range(width):
                out[j] = 0
        else:
            row = old[s]
            for j in range(width):
                out[j] = row[j]
