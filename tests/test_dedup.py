"""Dedup: padded_unique against a Python dict, the exact CPU dedup in first-occurrence order."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynemb.rows.dedup import padded_unique, unique_keys
from dynemb.types import EMPTY_KEY


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-2**62, 2**62), max_size=60), st.booleans())
def test_padded_unique_matches_a_count_of_each_key(values, few_distinct):
    values = [v % 7 if few_distinct else v for v in values]
    keys = torch.tensor(values, dtype=torch.int64)
    u = padded_unique(keys)
    count = {}
    for v in values:
        count[v] = count.get(v, 0) + 1
    n = int(u.num_unique)
    assert u.keys.numel() == keys.numel() and n == len(count)
    assert u.keys[:n].tolist() == sorted(count)  # sorted: the sort-based dedup
    assert u.counts[:n].tolist() == [count[k] for k in sorted(count)]
    assert bool((u.keys[n:] == EMPTY_KEY).all()) and bool((u.counts[n:] == 0).all())
    assert u.keys[u.inverse].tolist() == values


def test_padded_unique_of_nothing():
    u = padded_unique(torch.empty(0, dtype=torch.int64))
    assert u.keys.numel() == u.inverse.numel() == u.counts.numel() == 0
    assert u.num_unique.tolist() == [0]


@pytest.mark.parametrize("backend_name", ["cpu", "cuda"])
def test_unique_keys_by_backend(backend_name):
    from conftest import BACKENDS
    device = dict(BACKENDS)[backend_name]
    u = unique_keys(torch.tensor([9, 4, 9, 1], device=device), backend_name)
    if backend_name == "cpu":  # exact, in first-occurrence order
        assert u.keys.tolist() == [9, 4, 1] and u.counts.tolist() == [2, 1, 1]
        assert u.inverse.tolist() == [0, 1, 0, 2]
    else:  # padded to the input length, sorted, no host sync
        assert u.keys.tolist() == [1, 4, 9, EMPTY_KEY] and u.counts.tolist() == [1, 1, 2, 0]
        assert u.inverse.tolist() == [2, 1, 2, 0]
    assert int(u.num_unique.sum()) == 3


@pytest.mark.parametrize("n, distinct", [(5000, 3000), (70_000, 20_000), (70_000, 7)])
def test_cpu_dedup_of_large_batches_keeps_first_occurrence_order(n, distinct):
    gen = torch.Generator().manual_seed(n + distinct)
    pool = torch.randint(-2**62, 2**62, (distinct,), generator=gen)
    keys = pool[torch.randint(distinct, (n,), generator=gen)]
    u = unique_keys(keys, "cpu")
    first = {}
    for k in keys.tolist():
        first.setdefault(k, len(first))
    assert u.keys.tolist() == list(first)
    assert u.inverse.tolist() == [first[k] for k in keys.tolist()]
    assert u.counts.tolist() == torch.bincount(u.inverse, minlength=len(first)).tolist()
