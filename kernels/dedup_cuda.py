"""CUDA kernels of the sort-based dedup (``CudaBackend.dedup_segments``): after the keys are
sorted by (segment, key), one kernel marks where each run of equal keys starts and, after a
cumulative sum numbers the runs, one kernel places every key: its run's key and count at
the run's place in its segment's part of the output, and its own place in ``inverse``."""
from numba import cuda


@cuda.jit
def run_starts_kernel(sorted_keys, sorted_seg, out_starts):
    """``out_starts[i]`` = 1 where key ``i`` (sorted) starts a run: the first key, or one
    that differs from the key before it or is of another segment (``sorted_seg`` empty:
    one segment)."""
    i = cuda.grid(1)
    if i >= sorted_keys.size:
        return
    starts = i == 0 or sorted_keys[i] != sorted_keys[i - 1]
    if not starts and sorted_seg.size:
        starts = sorted_seg[i] != sorted_seg[i - 1]
    out_starts[i] = 1 if starts else 0


@cuda.jit
def place_runs_kernel(sorted_keys, sorted_seg, order, run_end, bounds, out_unique, out_inverse,
                      out_counts):
    """Key ``i`` (sorted; ``run_end[i]`` its run's number plus one, from the cumulative sum)
    goes to place ``bounds[t] + r - r0``: ``r`` its run, ``r0`` the first run of its segment
    ``t`` (``sorted_seg`` empty: one segment, place ``r``). ``out_counts`` must start at 0."""
    i = cuda.grid(1)
    if i >= sorted_keys.size:
        return
    run = run_end[i] - 1
    place = run
    if sorted_seg.size:
        t = sorted_seg[i]
        place = bounds[t] + run - (run_end[bounds[t]] - 1)
    out_unique[place] = sorted_keys[i]
    out_inverse[order[i]] = place
    cuda.atomic.add(out_counts, place, 1)
