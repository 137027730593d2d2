"""The CPU find_or_insert kernel, in batch order and in bucket order, against the two-pass
kernels it replaces (look up and pin every key, then claim slots in batch order): the same
slots, previous keys and scores, failures, pins and table arrays, key for key."""
import numpy as np
import pytest

from dynemb.kernels import table_cpu
from dynemb.kernels.hashing import bucket_index
from dynemb.kernels.constants import (EMPTY_KEY, POLICY_CUSTOMIZED, POLICY_LFU, POLICY_LFU_LRU,
                                      POLICY_LRU, POLICY_NO_EVICTION, POLICY_STEP,
                                      TOMBSTONE_KEY)

CAPACITY = 1024


def make_arrays(rng, bucket_size, fill_keys):
    """A table with ``fill_keys`` keys inserted one batch at a time, some erased (tombstones)
    and some pinned; scores drawn from a few values so that ties are common."""
    arrays = dict(keys=np.full(CAPACITY, EMPTY_KEY, dtype=np.int64),
                  scores=np.zeros(CAPACITY, dtype=np.int64),
                  refcnt=np.zeros(CAPACITY, dtype=np.int32), size=np.zeros(1, dtype=np.int64))
    keys = rng.choice(np.arange(-5000, 5000), fill_keys, replace=False).astype(np.int64)
    run(arrays, bucket_size, keys, POLICY_LRU, 1, True, False, parts=1)
    arrays["scores"][:] = rng.integers(0, 6, CAPACITY)
    live = np.flatnonzero(arrays["keys"] > TOMBSTONE_KEY)
    erased = rng.choice(live, live.size // 8, replace=False)
    arrays["keys"][erased] = TOMBSTONE_KEY
    arrays["size"][0] -= erased.size
    live = np.flatnonzero(arrays["keys"] > TOMBSTONE_KEY)
    arrays["refcnt"][rng.choice(live, live.size // 10, replace=False)] = 1
    return arrays


def run(arrays, bucket_size, keys, policy, clock, allow_evict, pin, parts, scratch=None):
    """One claim of ``keys`` by the kernel (``scratch``: its scratch array, else a new one)."""
    n = keys.size
    counts = np.arange(1, n + 1, dtype=np.int64) % 4 + 1
    given = (np.arange(n, dtype=np.int64) * 7) % 11
    out = dict(slots=np.empty(n, np.int64), inserted=np.empty(n, np.bool_),
               prev_keys=np.empty(n, np.int64), prev_scores=np.empty(n, np.int64),
               failed=np.empty(n, np.bool_), stats=np.empty(2, np.int64))
    if scratch is None:
        scratch = np.empty(table_cpu.scratch_size(n, parts, policy), dtype=np.int64)
    table_cpu.find_or_insert_cpu(
        arrays["keys"], arrays["scores"], arrays["refcnt"], arrays["size"],
        CAPACITY // bucket_size, bucket_size, keys, counts, given, policy, clock, allow_evict,
        pin, parts, scratch, out["slots"], out["inserted"], out["prev_keys"], out["prev_scores"],
        out["failed"], out["stats"])
    return out


def run_two_pass(arrays, bucket_size, keys, policy, clock, allow_evict, pin):
    n = keys.size
    counts = np.arange(1, n + 1, dtype=np.int64) % 4 + 1
    given = (np.arange(n, dtype=np.int64) * 7) % 11
    nb = CAPACITY // bucket_size
    slots, prev_keys, prev_scores = (np.empty(n, np.int64) for _ in range(3))
    failed = np.empty(n, np.bool_)
    table_cpu.lookup_update_cpu(arrays["keys"], arrays["scores"], arrays["refcnt"], nb,
                                bucket_size, keys, counts, given, policy, clock, True, slots,
                                prev_scores)
    hit = slots >= 0
    table_cpu.insert_missing_cpu(arrays["keys"], arrays["scores"], arrays["refcnt"],
                                 arrays["size"], nb, bucket_size, keys, counts, given, policy,
                                 clock, allow_evict, slots, prev_keys, prev_scores, failed, 1)
    if not pin:
        table_cpu.add_refcounts_cpu(arrays["refcnt"], slots, -1)
    inserted = ~hit & (slots >= 0)
    evicted = inserted & (prev_keys > TOMBSTONE_KEY)
    return dict(slots=slots, inserted=inserted, prev_keys=prev_keys, prev_scores=prev_scores,
                failed=failed, stats=np.array([failed.sum(), evicted.sum()]))


@pytest.mark.parametrize("policy", [POLICY_LRU, POLICY_LFU, POLICY_STEP, POLICY_CUSTOMIZED,
                                    POLICY_NO_EVICTION, POLICY_LFU_LRU])
@pytest.mark.parametrize("bucket_size", [4, 32, 128])
@pytest.mark.parametrize("fill_keys", [300, 1000])
@pytest.mark.parametrize("pin", [False, True])
def test_bucket_order_matches_the_two_pass_kernels(policy, bucket_size, fill_keys, pin):
    rng = np.random.default_rng(bucket_size * 7 + fill_keys + policy)
    base = make_arrays(rng, bucket_size, fill_keys)
    stored = base["keys"][base["keys"] > TOMBSTONE_KEY]
    fresh = np.setdiff1d(np.arange(-9000, 9000), stored)
    # hits, misses and padding, in random order
    batch = np.concatenate([rng.choice(stored, 200, replace=False),
                            rng.choice(fresh, 1800, replace=False),
                            np.full(5, EMPTY_KEY)]).astype(np.int64)
    rng.shuffle(batch)
    allow_evict = policy != POLICY_NO_EVICTION
    want_arrays = {k: v.copy() for k, v in base.items()}
    want = run_two_pass(want_arrays, bucket_size, batch, policy, 9, allow_evict, pin)
    assert want["stats"][1] > 0 or not allow_evict  # buckets overflow: evictions happen
    for parts in (1, 3, CAPACITY // bucket_size):
        got_arrays = {k: v.copy() for k, v in base.items()}
        got = run(got_arrays, bucket_size, batch, policy, 9, allow_evict, pin, parts)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name}, {parts}")
        for name in want_arrays:
            np.testing.assert_array_equal(got_arrays[name], want_arrays[name],
                                          err_msg=f"table {name}, {parts} partitions")


@pytest.mark.parametrize("policy", [POLICY_LRU, POLICY_LFU, POLICY_CUSTOMIZED])
def test_bucket_ordered_keys_with_empty_entries_are_claimed_in_place(policy):
    """Keys in bucket order with ``EMPTY_KEY`` among them (a DEFAULT group's keys routed to
    the other tier) and after them (a group's dedup pads each table's unique keys to its
    input count) are claimed where they stand: the claim writes no scratch past its
    bounds, ranks and stats (sorting them by bucket would, and would cost a copy of the
    batch and a pass to put the results back), and gives what the two-pass kernels give;
    an ``EMPTY_KEY`` gets no slot, nothing inserted or failed, no previous key."""
    bucket_size = 32
    rng = np.random.default_rng(policy)
    base = make_arrays(rng, bucket_size, 600)
    stored = base["keys"][base["keys"] > TOMBSTONE_KEY]
    fresh = np.setdiff1d(np.arange(-9000, 9000), stored)
    live = np.concatenate([rng.choice(stored, 150, replace=False),
                           rng.choice(fresh, 900, replace=False)]).astype(np.int64)
    num_buckets = CAPACITY // bucket_size
    buckets = np.array([bucket_index(k, num_buckets) for k in live])
    live = live[np.argsort(buckets, kind="stable")]  # the order dedup_bucket_order_cpu gives
    batch = live.copy()
    batch[rng.random(live.size) < 0.3] = EMPTY_KEY  # routed to the other tier
    batch = np.concatenate([batch, np.full(700, EMPTY_KEY, dtype=np.int64)])  # padding
    want_arrays = {k: v.copy() for k, v in base.items()}
    want = run_two_pass(want_arrays, bucket_size, batch, policy, 9, True, True)
    assert want["stats"][1] > 0  # buckets overflow: evictions happen
    parts = num_buckets
    in_place = batch.size + 4 * parts + 1  # bounds, ranks, stats
    sentinel = np.int64(-777)
    scratch = np.full(table_cpu.scratch_size(batch.size, parts, policy), sentinel)
    got_arrays = {k: v.copy() for k, v in base.items()}
    got = run(got_arrays, bucket_size, batch, policy, 9, True, True, parts, scratch)
    assert (scratch[in_place:] == sentinel).all(), "the claim sorted the keys"
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    for name in want_arrays:
        np.testing.assert_array_equal(got_arrays[name], want_arrays[name], err_msg=name)
    empty = batch == EMPTY_KEY
    assert (got["slots"][empty] == -1).all() and not got["inserted"][empty].any()
    assert not got["failed"][empty].any() and (got["prev_keys"][empty] == EMPTY_KEY).all()
    assert (got["prev_scores"][empty] == 0).all()
