"""The CPU dedup in bucket order (``dedup_bucket_order_cpu``) against a Python model: unique
keys sorted by their bucket in a table of ``num_buckets`` buckets, ties in first-occurrence
order, with inverse indices and counts; and ``find_or_insert`` claiming keys that come in
that order in place picks the same slots as from any other order."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynemb.backends.numba_backends import backend_for_device
from dynemb.rows.dedup import unique_keys
from dynemb.rows.hash_table import ScoredHashTable
from dynemb.kernels.hashing import bucket_index

CPU = backend_for_device(torch.device("cpu"))


def model(keys, num_buckets):
    """(unique keys, inverse, counts) of the bucket-ordered dedup, in plain Python."""
    first = {}
    for k in keys:
        first.setdefault(k, len(first))
    ordered = sorted(first, key=lambda k: (bucket_index(k, num_buckets), first[k]))
    position = {k: i for i, k in enumerate(ordered)}
    counts = {}
    for k in keys:
        counts[k] = counts.get(k, 0) + 1
    return ordered, [position[k] for k in keys], [counts[k] for k in ordered]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(-2**62, 2**62), max_size=300), st.integers(1, 5000),
       st.booleans())
def test_matches_the_model(values, num_buckets, few_distinct):
    values = [v % 11 if few_distinct else v for v in values]
    keys = torch.tensor(values, dtype=torch.int64)
    ukeys, inverse, counts = CPU.dedup(keys, num_buckets)
    assert (ukeys.tolist(), inverse.tolist(), counts.tolist()) == model(values, num_buckets)


@pytest.mark.parametrize("n, distinct, num_buckets", [
    (5000, 3000, 64), (70_000, 20_000, 1000), (70_000, 7, 3), (3000, 3000, 100_000),
    (100_000, 90_000, 7)])
def test_large_batches_across_many_partitions_match_the_model(n, distinct, num_buckets):
    gen = torch.Generator().manual_seed(n + distinct + num_buckets)
    pool = torch.randint(-2**62, 2**62, (distinct,), generator=gen)
    keys = pool[torch.randint(distinct, (n,), generator=gen)]
    u = unique_keys(keys, "cpu", num_buckets=num_buckets)
    expected = model(keys.tolist(), num_buckets)
    assert (u.keys.tolist(), u.inverse.tolist(), u.counts.tolist()) == expected
    assert u.num_unique.tolist() == [len(expected[0])]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_claims_in_bucket_order_pick_the_slots_of_first_occurrence_order(policy):
    """12000 keys into a nearly full table (evictions and failures included): the in-place claim of
    bucket-ordered keys and the sorting claim of first-occurrence keys agree slot for slot."""
    from dynemb.types import ScorePolicy
    gen = torch.Generator().manual_seed(3)
    warm = torch.randint(1, 2**40, (4000,), generator=gen)
    batch = torch.cat([warm[:3000], torch.randint(1, 2**40, (9000,), generator=gen)])
    results = []
    for order in ("first", "bucket"):
        table = ScoredHashTable(4096, bucket_size=128, policy=ScorePolicy(policy))
        table.find_or_insert(warm, on_failure="report")
        buckets = table.num_buckets if order == "bucket" else None
        ukeys, _, counts = CPU.dedup(batch, buckets)
        result = table.find_or_insert(ukeys, assume_unique=True, counts=counts,
                                      on_failure="report")
        results.append({k: (s, p) for k, s, p in zip(
            ukeys.tolist(), result.slots.tolist(), result.previous_keys.tolist())})
        results[-1]["export"] = sorted(zip(*(t.tolist() for t in table.export()[:2])))
    assert results[0] == results[1]
