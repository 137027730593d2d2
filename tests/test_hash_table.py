"""Conformance of ScoredHashTable on both backends, with hand-computed expectations.

A table with ``capacity == bucket_size`` has one bucket, so every key competes for the same
slots and the eviction order can be worked out by hand.
"""
import pytest
import torch

from dynemb import ScorePolicy, TableFullError


def snapshot(table):
    """Everything observable about a table, for "unchanged" checks."""
    ex = table.export()
    return (sorted(zip(ex.keys.tolist(), ex.slots.tolist(), ex.scores.tolist())), table.size(),
            table.clock, table.pinned_count(), table.capacity)


def insert_each(table, to_dev, keys, scores=None):
    for i, k in enumerate(keys):
        table.find_or_insert(to_dev([k]), None if scores is None else to_dev([scores[i]]))


def evicted_keys(result):
    return sorted(result.previous_keys[result.evicted].tolist())


def test_duplicates_share_one_slot(make_table, to_dev):
    table = make_table(256, bucket_size=16)
    res = table.find_or_insert(to_dev([5, 9, 5, 5, -3]))
    assert sorted(res.keys.tolist()) == [-3, 5, 9]
    assert res.keys[res.inverse].tolist() == [5, 9, 5, 5, -3]
    assert res.inserted.all() and not res.failed.any() and not res.evicted.any()
    slots = res.input_slots.tolist()
    assert slots[0] == slots[2] == slots[3] and len(set(slots)) == 3
    assert table.find(to_dev([9, 5, 77])).tolist() == [slots[1], slots[0], -1]
    assert table.size() == 3 and table.load_factor() == 3 / 256
    again = table.find_or_insert(to_dev([9, 77]))
    hit = dict(zip(again.keys.tolist(), again.inserted.tolist()))
    assert hit == {9: False, 77: True}


def test_lru_evicts_least_recently_used(make_table, to_dev):
    table = make_table(4, policy=ScorePolicy.LRU)
    insert_each(table, to_dev, [1, 2, 3, 4])          # scores 1, 2, 3, 4
    table.find(to_dev([1]), update_scores=True)       # clock 5: key 1 -> 5
    res = table.find_or_insert(to_dev([5]))           # clock 6: evicts key 2 (score 2)
    assert evicted_keys(res) == [2] and res.previous_scores[res.evicted].tolist() == [2]
    assert res.slots.tolist() == table.find(to_dev([5])).tolist()
    assert sorted(table.export().keys.tolist()) == [1, 3, 4, 5]


def test_lfu_evicts_least_frequent(make_table, to_dev):
    table = make_table(4, policy=ScorePolicy.LFU)
    table.find_or_insert(to_dev([1, 1, 1, 2, 2, 3, 4, 4]))  # counts 3, 2, 1, 2
    table.find_or_insert(to_dev([3, 3]))                     # 3 -> 3
    res = table.find_or_insert(to_dev([9]))                  # lowest: 2 and 4 (2) ...
    assert evicted_keys(res)[0] in (2, 4)
    scores = dict(zip(table.export().keys.tolist(), table.export().scores.tolist()))
    assert scores[1] == 3 and scores[3] == 3 and scores[9] == 1


def test_step_keeps_insertion_age(make_table, to_dev):
    table = make_table(4, policy=ScorePolicy.STEP)
    insert_each(table, to_dev, [1, 2, 3, 4])
    table.find_or_insert(to_dev([1]))                 # hit: STEP score stays 1
    res = table.find_or_insert(to_dev([5]))
    assert evicted_keys(res) == [1]


def test_customized_scores_and_batch_keys_are_safe(make_table, to_dev):
    table = make_table(4, policy=ScorePolicy.CUSTOMIZED)
    table.find_or_insert(to_dev([1, 2, 3]), to_dev([10, 20, 30]))
    # 4 takes the free slot; 5 must evict 1 (score 10), never 4 (score 0, same batch).
    res = table.find_or_insert(to_dev([4, 5, 5]), to_dev([0, 1, 7]))
    assert evicted_keys(res) == [1]
    scores = dict(zip(table.export().keys.tolist(), table.export().scores.tolist()))
    assert scores == {2: 20, 3: 30, 4: 0, 5: 7}   # duplicates take the largest given score
    table.find_or_insert(to_dev([3]), to_dev([-1]))  # a hit sets the given score
    assert evicted_keys(table.find_or_insert(to_dev([6]), to_dev([50]))) == [3]


def test_pinned_slots_are_never_evicted(make_table, to_dev):
    table = make_table(4, policy=ScorePolicy.LRU)
    insert_each(table, to_dev, [1, 2, 3, 4])
    table.pin(table.find(to_dev([1, 2])))
    assert evicted_keys(table.find_or_insert(to_dev([5]))) == [3]
    pinned = table.find_or_insert(to_dev([6]), pin=True)
    assert evicted_keys(pinned) == [4]
    before = snapshot(table)
    with pytest.raises(TableFullError) as err:       # 1, 2, 6 pinned; 5 in the batch
        table.find_or_insert(to_dev([5, 7, 8]))
    assert sorted(err.value.failed_keys.tolist()) == [7, 8]
    assert snapshot(table) == before
    table.unpin(pinned.slots)                        # 6 is a candidate again
    report = table.find_or_insert(to_dev([5, 7, 8]), on_failure="report")
    assert int(report.failed.sum()) == 1 and evicted_keys(report) == [6]
    table.unpin(table.find(to_dev([1, 2])))
    assert table.pinned_count() == 0


def test_no_eviction_reports_full_bucket(make_table, to_dev):
    table = make_table(4, policy=ScorePolicy.NO_EVICTION)
    table.find_or_insert(to_dev([1, 2, 3]))
    before = snapshot(table)
    with pytest.raises(TableFullError, match="found no slot"):
        table.find_or_insert(to_dev([1, 4, 5]))
    assert snapshot(table) == before
    res = table.find_or_insert(to_dev([1, 4, 5]), on_failure="report")
    assert int(res.failed.sum()) == 1 and not res.evicted.any()
    assert table.size() == 4


def test_erase_leaves_tombstones_that_probing_passes(make_table, to_dev):
    table = make_table(8, policy=ScorePolicy.LRU)
    table.find_or_insert(to_dev(list(range(8))))
    table.pin(table.find(to_dev([7])))
    res = table.erase(to_dev([0, 1, 1, 7, 99]))
    assert res.erased.tolist() == [True, True, False, False, False]
    assert res.pinned.tolist() == [False, False, False, True, False]
    assert table.size() == 6
    # Keys probed past the tombstones are still found; new keys reuse the freed slots.
    assert (table.find(to_dev(list(range(2, 8)))) >= 0).all()
    res = table.find_or_insert(to_dev([100, 101]))
    assert not res.evicted.any() and table.size() == 8


def test_export_iterates_every_live_entry_once(make_table, to_dev):
    table = make_table(64, bucket_size=8)
    keys = list(range(0, 300, 7))
    table.find_or_insert(to_dev(keys), on_failure="report")
    start, seen = 0, []
    while start < table.capacity:
        chunk = table.export(start, 10)
        seen += chunk.keys.tolist()
        start = chunk.next_start
    assert sorted(seen) == sorted(table.export().keys.tolist())
    assert len(seen) == table.size()


def test_grow_moves_keys_scores_and_pins(make_table, to_dev):
    table = make_table(32, bucket_size=8, policy=ScorePolicy.LFU)
    keys = to_dev(list(range(20)))
    res = table.find_or_insert(keys, pin=True)
    before = dict(zip(table.export().keys.tolist(), table.export().scores.tolist()))
    remap = table.grow(64)
    assert table.capacity == 64 and table.size() == 20 and table.pinned_count() == 20
    new_slots = table.find(res.keys)
    assert torch.equal(remap[res.slots], new_slots)
    assert dict(zip(table.export().keys.tolist(), table.export().scores.tolist())) == before
    table.unpin(new_slots)
    with pytest.raises(ValueError, match="new_capacity"):
        table.grow(64)


def test_auto_grow_by_load_factor_and_on_full_bucket(make_table, to_dev):
    table = make_table(16, bucket_size=8, grow_at_load_factor=0.5, max_capacity=64,
                       policy=ScorePolicy.NO_EVICTION)
    first = table.find_or_insert(to_dev(list(range(6))))
    res = table.find_or_insert(to_dev(list(range(6, 20))))
    assert res.remap is not None and table.capacity == 64
    assert torch.equal(res.remap[first.slots], table.find(first.keys))
    assert (table.find(to_dev(list(range(20)))) >= 0).all()
    with pytest.raises(TableFullError) as err:       # past max_capacity
        table.find_or_insert(to_dev(list(range(20, 200))))
    assert table.capacity == 64 and table.size() == 20 and err.value.remap is None


def test_clock_advances_once_per_scoring_call(make_table, to_dev):
    table = make_table(16)
    table.find_or_insert(to_dev([1]))
    table.find(to_dev([1]))
    table.find(to_dev([1]), update_scores=True)
    assert table.clock == 2


def test_large_random_batches_agree_with_a_dict():
    """CPU at scale: 200k inserts in batches with duplicates, then lookups, versus a dict."""
    from dynemb.rows.hash_table import ScoredHashTable
    gen = torch.Generator().manual_seed(0)
    table = ScoredHashTable(1 << 18)
    truth = {}
    for _ in range(4):
        keys = torch.randint(-(2**62), 2**62, (50_000,), generator=gen)
        keys[::10] = keys[1::10]  # duplicates inside the batch
        res = table.find_or_insert(keys)
        assert not res.evicted.any() and not res.failed.any()
        for k, s in zip(res.keys.tolist(), res.slots.tolist()):
            assert truth.setdefault(k, s) == s
    probe = torch.tensor(list(truth)[:20_000] + [12345678901, -5], dtype=torch.int64)
    assert table.find(probe).tolist() == [truth.get(k, -1) for k in probe.tolist()]
    assert table.size() == len(truth) and len(set(truth.values())) == len(truth)


def test_growth_below_max_capacity_never_evicts(make_table, to_dev):
    # Buckets of 8 fill unevenly long before the load factor is reached: a full bucket must
    # grow the table, not evict, while max_capacity allows.
    table = make_table(16, bucket_size=8, grow_at_load_factor=0.9, max_capacity=1 << 12)
    keys = to_dev(list(range(1, 601)))
    for chunk in keys.split(50):
        result = table.find_or_insert(chunk)
        assert not bool(result.evicted.any())
    assert table.size() == 600
    assert bool((table.find(keys) >= 0).all())


def test_release_never_drops_a_reference_count_below_zero(make_table, to_dev):
    table = make_table(4, policy=ScorePolicy.LRU)
    insert_each(table, to_dev, [1, 2, 3, 4])         # LRU scores 1..4: key 1 goes first
    slot = table.find(to_dev([1]))
    table.retain(slot)
    table.release(to_dev([slot.item()] * 3))         # one more release than pins, twice over
    table.release(slot)
    assert table.pinned_count() == 0
    table.retain(slot)                               # one pin must protect it again
    assert table.pinned_count() == 1
    assert evicted_keys(table.find_or_insert(to_dev([5]))) == [2]
    table.release(slot)
    assert evicted_keys(table.find_or_insert(to_dev([6]))) == [1]


def test_undo_reverts_the_latest_pinned_find_or_insert(make_table, to_dev):
    table = make_table(4, policy=ScorePolicy.LFU)
    table.find_or_insert(to_dev([1, 1, 2, 3, 3, 3]))          # counts 2, 1, 3; one slot free
    before = snapshot(table)
    result = table.find_or_insert(to_dev([1, 7, 8]), pin=True)  # hit, insert, evict 2
    assert evicted_keys(result) == [2]
    table.undo(result)
    assert snapshot(table) == before
    with pytest.raises(ValueError, match="latest"):
        table.undo(result)                                     # only once
    stale = table.find_or_insert(to_dev([9]), pin=True)
    table.find_or_insert(to_dev([1]))
    with pytest.raises(ValueError, match="latest"):
        table.undo(stale)                                      # another call came after it


@pytest.mark.parametrize("policy, expected", [
    (ScorePolicy.LFU, {7: 2 + 5, 8: 1 + 0}),   # counts add up
    (ScorePolicy.STEP, {7: 5, 8: 0}),          # the original insertion step comes back
    (ScorePolicy.LRU, {7: 1, 8: 1}),           # the latest use stays
    (ScorePolicy.NO_EVICTION, {7: 0, 8: 0}),
])
def test_restore_scores_merges_by_policy(make_table, to_dev, policy, expected):
    table = make_table(8, policy=policy)
    result = table.find_or_insert(to_dev([7, 7, 8]))
    table.restore_scores(result.slots, to_dev([5 if k == 7 else 0 for k in result.keys.tolist()]))
    scores = dict(zip(table.export().keys.tolist(), table.export().scores.tolist()))
    assert scores == expected


def test_restore_scores_validates(make_table, to_dev):
    table = make_table(8, policy=ScorePolicy.LFU)
    slots = table.find_or_insert(to_dev([7, 8])).slots
    before = snapshot(table)
    free = next(s for s in range(8) if s not in slots.tolist())
    for bad_slots, bad_scores, match in [
        (slots[:1].repeat(2), to_dev([1, 1]), "distinct"),
        (to_dev([free]), to_dev([1]), "holds no key"),
        (slots, to_dev([1]), "shape"),
    ]:
        with pytest.raises(ValueError, match=match):
            table.restore_scores(bad_slots, bad_scores)
    assert snapshot(table) == before
