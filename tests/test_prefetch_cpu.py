"""The software prefetch helpers compile for the arrays the kernels pass them and change
nothing (a prefetch is only a hint to the cache)."""
import numpy as np
import pytest
from numba import njit

from dynemb.kernels.prefetch_cpu import prefetch_at, prefetch_row


@njit
def _touch_rows(rows, at, flat):
    for i in range(at.size):
        prefetch_row(rows, at[i], rows.shape[1])
        prefetch_at(flat, at[i])
    return rows.sum() + flat.sum()


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.int32])
def test_prefetching_rows_and_elements_leaves_the_arrays_unchanged(dtype):
    rows = np.arange(40 * 35, dtype=dtype).reshape(40, 35)  # rows not a whole cache line
    flat = np.arange(40, dtype=dtype)
    before = rows.copy(), flat.copy()
    total = _touch_rows(rows, np.array([0, 39, 7, 7]), flat)
    assert total == before[0].sum() + before[1].sum()
    assert np.array_equal(rows, before[0]) and np.array_equal(flat, before[1])
