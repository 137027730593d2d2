"""Score rules of the policies, shared by the CPU and CUDA kernels.

A score says how much a key is worth keeping: eviction takes the lowest unpinned score of the
bucket. ``clock`` is the table's step counter, ``count`` how often the key occurs in the batch,
``given`` the caller's score (CUSTOMIZED only).

LFU_LRU packs both into one int64: the use count in the high 23 bits, the clock of the last
use in the low 40 (``LFU_LRU_CLOCK_BITS``), so comparing scores compares counts first and the
last use breaks ties. Each part saturates: a count stops at ``LFU_LRU_MAX_COUNT``, a clock
past ``LFU_LRU_MAX_CLOCK`` is recorded as that value; the score never wraps negative.
"""
import numpy as np
from numba import njit

from .constants import (LFU_LRU_CLOCK_BITS, LFU_LRU_MAX_CLOCK, LFU_LRU_MAX_COUNT,
                        POLICY_CUSTOMIZED, POLICY_LFU, POLICY_LFU_LRU, POLICY_LRU, POLICY_STEP)

INT64_MAX = np.int64(2**63 - 1)


@njit(cache=True, inline="always")
def reads_counts(policy):
    """The policy adds the batch's occurrence counts to its scores."""
    return policy == POLICY_LFU or policy == POLICY_LFU_LRU


@njit(cache=True, inline="always")
def pack_lfu_lru(count, clock):
    """The LFU_LRU score of ``count`` uses, the last at ``clock`` (both saturated)."""
    count = min(max(np.int64(count), np.int64(0)), np.int64(LFU_LRU_MAX_COUNT))
    clock = min(max(np.int64(clock), np.int64(0)), np.int64(LFU_LRU_MAX_CLOCK))
    return (count << np.int64(LFU_LRU_CLOCK_BITS)) | clock


@njit(cache=True, inline="always")
def lfu_lru_count(score):
    """The use count of an LFU_LRU score (0 for a negative score, which the policy never
    writes)."""
    return np.int64(score) >> np.int64(LFU_LRU_CLOCK_BITS) if score > 0 else np.int64(0)


@njit(cache=True, inline="always")
def score_on_insert(policy, clock, count, given):
    if policy == POLICY_LRU or policy == POLICY_STEP:
        return clock
    if policy == POLICY_LFU:
        return count
    if policy == POLICY_CUSTOMIZED:
        return given
    if policy == POLICY_LFU_LRU:
        return pack_lfu_lru(count, clock)
    return np.int64(0)


@njit(cache=True, inline="always")
def score_on_hit(policy, old, clock, count, given):
    if policy == POLICY_LRU:
        return clock
    if policy == POLICY_LFU:
        return old + count
    if policy == POLICY_CUSTOMIZED:
        return given
    if policy == POLICY_LFU_LRU:
        # counts saturate: min before adding keeps the sum far from int64 overflow
        return pack_lfu_lru(lfu_lru_count(old) + min(np.int64(count),
                                                     np.int64(LFU_LRU_MAX_COUNT)), clock)
    return old  # STEP keeps the insertion step; NO_EVICTION keeps 0.
