"""Score rules of the policies, shared by the CPU and CUDA kernels.

A score says how much a key is worth keeping: eviction takes the lowest unpinned score of the
bucket. ``clock`` is the table's step counter, ``count`` how often the key occurs in the batch,
``given`` the caller's score (CUSTOMIZED only).
"""
import numpy as np
from numba import njit

from .constants import POLICY_CUSTOMIZED, POLICY_LFU, POLICY_LRU, POLICY_STEP

INT64_MAX = np.int64(2**63 - 1)


@njit(cache=True, inline="always")
def score_on_insert(policy, clock, count, given):
    if policy == POLICY_LRU or policy == POLICY_STEP:
        return clock
    if policy == POLICY_LFU:
        return count
    if policy == POLICY_CUSTOMIZED:
        return given
    return np.int64(0)


@njit(cache=True, inline="always")
def score_on_hit(policy, old, clock, count, given):
    if policy == POLICY_LRU:
        return clock
    if policy == POLICY_LFU:
        return old + count
    if policy == POLICY_CUSTOMIZED:
        return given
    return old  # STEP keeps the insertion step; NO_EVICTION keeps 0.
