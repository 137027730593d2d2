"""tests/sequential_cudasim.py, the simulator as the suite runs it: a kernel that never
synchronizes runs its threads one by one, one that does runs them on a pool of threads
released at each barrier; both give what a kernel computes (against numpy), read their own
thread and block indices, and report a failing thread as the simulator does."""
import os

import numpy as np
import pytest
from numba import cuda

pytestmark = pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1",
                                reason="a GPU runs the kernels themselves")


@cuda.jit(device=True)
def tree_sum(values, tid, width):
    step = width // 2
    while step > 0:
        if tid < step:
            values[tid] += values[tid + step]
        cuda.syncthreads()
        step //= 2


@cuda.jit
def block_sums(x, out):  # synchronizes, through a device function
    values = cuda.shared.array(16, np.int64)
    tid = cuda.threadIdx.x
    i = cuda.grid(1)
    values[tid] = x[i] if i < x.size else 0
    cuda.syncthreads()
    tree_sum(values, tid, cuda.blockDim.x)
    if tid == 0:
        out[cuda.blockIdx.x] = values[0]


@cuda.jit
def where_am_i(out):  # never synchronizes
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i, 0] = cuda.blockIdx.x
        out[i, 1] = cuda.threadIdx.x
        if i == 37:
            out[i, 1] = out[i + 1000, 0]  # out of bounds: raises


def test_each_kernel_runs_its_threads_as_its_code_needs():
    from tests.sequential_cudasim import synchronizes
    assert synchronizes(block_sums.fn)       # via its device function
    assert not synchronizes(where_am_i.fn)
    from kernels import groups_cuda, optim_cuda, table_cuda
    assert synchronizes(optim_cuda.fused_update_kernel.fn)
    assert synchronizes(groups_cuda.add_claim_counts_kernel.fn)
    assert not synchronizes(groups_cuda.lookup_update_group_kernel.fn)
    assert not synchronizes(table_cuda.insert_missing_kernel.fn)


def test_a_synchronizing_kernel_sums_as_numpy_does():
    x = np.arange(1, 41, dtype=np.int64)
    out = np.zeros(3, dtype=np.int64)
    block_sums[3, 16](x, out)
    np.testing.assert_array_equal(out, [x[:16].sum(), x[16:32].sum(), x[32:].sum()])
    block_sums[3, 16](x * 2, out)  # the pool's threads serve the next launch
    np.testing.assert_array_equal(out, [2 * x[:16].sum(), 2 * x[16:32].sum(),
                                        2 * x[32:].sum()])


def test_threads_run_one_by_one_see_their_own_indices():
    out = np.full((30, 2), -1, dtype=np.int64)
    where_am_i[4, 8](out)
    np.testing.assert_array_equal(out[:, 0], np.arange(30) // 8)
    np.testing.assert_array_equal(out[:, 1], np.arange(30) % 8)


def test_a_failing_thread_is_named_as_the_simulator_names_it():
    with pytest.raises(IndexError, match=r"tid=\[5, 0, 0\] ctaid=\[4, 0, 0\]"):
        where_am_i[6, 8](np.zeros((48, 2), dtype=np.int64))
