"""HostBackingStore: rows keep their scores, the store grows, and a full store forgets the
lowest scores first."""
import pytest
import torch

from dynemb.stores.backing_store import HostBackingStore

CPU = torch.device("cpu")


def one_bucket_store():
    """Four slots in one bucket, no growth: every insert past four evicts."""
    return HostBackingStore(2, torch.float32, CPU, initial_capacity=4, max_capacity=4)


def keys(*values):
    return torch.tensor(values, dtype=torch.int64)


def test_find_returns_the_rows_and_scores_inserted():
    store = one_bucket_store()
    rows = torch.arange(8, dtype=torch.float32).view(4, 2)
    assert store.insert(keys(1, 2, 3, 4), rows, keys(5, 1, 7, 3)) == 0
    got, found, scores = store.find(keys(3, 9, 1))
    assert found.tolist() == [True, False, True]
    assert scores[found].tolist() == [7, 5]
    torch.testing.assert_close(got[found], rows[[2, 0]])


def test_a_full_store_evicts_the_lowest_score():
    store = one_bucket_store()
    store.insert(keys(1, 2, 3, 4), torch.zeros(4, 2), keys(5, 1, 7, 3))
    assert store.insert(keys(5), torch.zeros(1, 2), keys(4)) == 1      # drops 2 (score 1)
    assert store.insert(keys(6), torch.zeros(1, 2), keys(10)) == 1     # drops 4 (score 3)
    assert store.insert(keys(1), torch.ones(1, 2), keys(0)) == 0       # overwrite: 1 now 0
    assert store.insert(keys(7), torch.zeros(1, 2), keys(2)) == 1      # drops 1
    _, found, scores = store.find(keys(1, 2, 3, 4, 5, 6, 7))
    assert found.tolist() == [False, False, True, False, True, True, True]
    assert scores[found].tolist() == [7, 4, 10, 2]


@pytest.mark.parametrize("scores, error", [
    (keys(1), ValueError),                                   # one score for two rows
    (torch.tensor([1.0, 2.0]), TypeError),
])
def test_insert_rejects_bad_scores(scores, error):
    store = one_bucket_store()
    with pytest.raises(error, match="scores"):
        store.insert(keys(1, 2), torch.zeros(2, 2), scores)
    assert store.size() == 0


def test_round_trip_export_and_growth():
    store = HostBackingStore(3, torch.float32, CPU, initial_capacity=128)
    many = torch.arange(1000) * 7919
    rows = torch.randn(1000, 3, generator=torch.Generator().manual_seed(0))
    assert store.insert(many, rows, torch.zeros(1000, dtype=torch.int64)) == 0
    assert store.size() == 1000 and store.capacity >= 1024
    got, found, _ = store.find(torch.cat([many[:5], keys(-5)]))
    assert found.tolist() == [True] * 5 + [False]
    torch.testing.assert_close(got[:5], rows[:5])
    exported, start = {}, 0
    while start is not None:
        k, r, start = store.export(start, 300)
        for key, row in zip(k.tolist(), r):
            assert key not in exported  # each key once
            exported[key] = row
    assert set(exported) == set(many.tolist())
    for i in (0, 517, 999):
        torch.testing.assert_close(exported[many[i].item()], rows[i])
