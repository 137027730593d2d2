"""The LFU_LRU score policy: frequency first, the latest use breaking ties, packed into one
int64 (count << 40 | clock). Scores and evictions against hand-computed values, on the CPU
and CUDA kernels; saturation of both parts; the CACHE store's restore; the packing helpers
against plain integer arithmetic. (The random-sequence model is in
test_hash_table_model.py, the checkpoint round trips in test_checkpoint_*.py.)"""
import pytest
import torch

from dynemb import ScorePolicy
from dynemb.types import (LFU_LRU_MAX_CLOCK, LFU_LRU_MAX_COUNT, pack_lfu_lru,
                          unpack_lfu_lru)

SHIFT = 2**40


def score(count, clock):
    """The policy's score, as plain integer arithmetic."""
    return count * SHIFT + clock


def scores_of(table, to_dev, keys):
    return table.scores_at(table.find(to_dev(keys))).tolist()


def test_the_layout_is_23_bits_of_count_over_40_bits_of_clock():
    assert (LFU_LRU_MAX_COUNT, LFU_LRU_MAX_CLOCK) == (2**23 - 1, 2**40 - 1)
    assert score(LFU_LRU_MAX_COUNT, LFU_LRU_MAX_CLOCK) == 2**63 - 1  # the largest int64


def test_hits_add_counts_and_take_the_clock(make_table, to_dev):
    table = make_table(16, bucket_size=16, policy=ScorePolicy.LFU_LRU)
    table.find_or_insert(to_dev([1, 1, 1, 2]))                 # clock 1
    assert scores_of(table, to_dev, [1, 2]) == [score(3, 1), score(1, 1)]
    table.find_or_insert(to_dev([2, 3]))                       # clock 2
    assert scores_of(table, to_dev, [1, 2, 3]) == [score(3, 1), score(2, 2), score(1, 2)]
    table.find(to_dev([3, 3, 9]), update_scores=True)          # clock 3: a scored find
    assert scores_of(table, to_dev, [1, 2, 3]) == [score(3, 1), score(2, 2), score(3, 3)]
    # assume_unique with the caller's counts (what the module's tables pass)
    table.find_or_insert(to_dev([1, 4]), assume_unique=True, counts=to_dev([5, 2]))  # clock 4
    assert scores_of(table, to_dev, [1, 4]) == [score(8, 4), score(2, 4)]


def test_eviction_takes_the_least_used_and_among_those_the_least_recent(make_table, to_dev):
    table = make_table(4, bucket_size=4, policy=ScorePolicy.LFU_LRU)
    table.find_or_insert(to_dev([1, 1, 1, 2]))   # 1: (3, 1)  2: (1, 1)
    table.find_or_insert(to_dev([2, 3]))         # 2: (2, 2)  3: (1, 2)
    table.find_or_insert(to_dev([4]))            # 4: (1, 3)   -- the bucket is full
    # LRU would evict key 1 (used at 1), LFU key 3 or 4 (one use each): LFU_LRU takes key 3
    result = table.find_or_insert(to_dev([5]))   # 5: (1, 4)
    assert result.previous_keys.tolist() == [3]
    assert result.previous_scores.tolist() == [score(1, 2)]
    result = table.find_or_insert(to_dev([6]))   # among 4: (1, 3) and 5: (1, 4), key 4 goes
    assert result.previous_keys.tolist() == [4]
    assert sorted(table.export().keys.tolist()) == [1, 2, 5, 6]
    assert scores_of(table, to_dev, [1, 2, 5, 6]) == [score(3, 1), score(2, 2), score(1, 4),
                                                      score(1, 5)]


def test_both_parts_saturate_and_never_wrap(make_table, to_dev):
    table = make_table(16, bucket_size=16, policy=ScorePolicy.LFU_LRU)
    table.load_entries(to_dev([1]), to_dev([score(LFU_LRU_MAX_COUNT - 1, 7)]))
    table.find_or_insert(to_dev([1, 2]), assume_unique=True, counts=to_dev([5, 2**50]))
    clock = table.clock
    assert scores_of(table, to_dev, [1, 2]) == [score(LFU_LRU_MAX_COUNT, clock)] * 2
    table.set_clock(LFU_LRU_MAX_CLOCK + 10)
    table.find_or_insert(to_dev([1, 3]))
    assert scores_of(table, to_dev, [1, 3]) == [score(LFU_LRU_MAX_COUNT, LFU_LRU_MAX_CLOCK),
                                               score(1, LFU_LRU_MAX_CLOCK)]
    assert min(scores_of(table, to_dev, [1, 2, 3])) > 0


def test_a_key_back_from_the_store_adds_its_old_count_and_keeps_its_new_use(make_table,
                                                                             to_dev):
    table = make_table(16, bucket_size=16, policy=ScorePolicy.LFU_LRU)
    table.set_clock(20)
    slots = table.find_or_insert(to_dev([7, 7, 8])).slots      # clock 21: 7: (2, 21) 8: (1, 21)
    table.restore_scores(slots, to_dev([score(5, 3), score(LFU_LRU_MAX_COUNT, 9)]))
    assert table.scores_at(slots).tolist() == [score(7, 21), score(LFU_LRU_MAX_COUNT, 21)]


def test_the_packing_helpers_match_integer_arithmetic():
    counts = torch.tensor([0, 1, 3, LFU_LRU_MAX_COUNT, LFU_LRU_MAX_COUNT + 9, -4])
    clocks = torch.tensor([0, 17, 2**40 - 1, 5, 2**45, 3])
    packed = pack_lfu_lru(counts, clocks)
    want = [score(min(max(c, 0), LFU_LRU_MAX_COUNT), min(max(t, 0), LFU_LRU_MAX_CLOCK))
            for c, t in zip(counts.tolist(), clocks.tolist())]
    assert packed.tolist() == want
    got_counts, got_clocks = unpack_lfu_lru(packed)
    assert got_counts.tolist() == [w // SHIFT for w in want]
    assert got_clocks.tolist() == [w % SHIFT for w in want]


def test_a_dump_selects_the_keys_used_since_a_clock_by_the_time_part(make_table, to_dev):
    table = make_table(64, policy=ScorePolicy.LFU_LRU)
    table.find_or_insert(to_dev([1, 1, 1, 1, 2]))   # clock 1: 1 is used often, long ago
    table.find_or_insert(to_dev([3]))               # clock 2
    table.find_or_insert(to_dev([2, 4]))            # clock 3
    exported = table.export()
    _, clocks = unpack_lfu_lru(exported.scores)
    assert sorted(exported.keys[clocks >= 2].tolist()) == [2, 3, 4]
    # the raw score says nothing about time: key 1's is the largest
    assert exported.scores[exported.keys == 1].item() == exported.scores.max().item()


def test_given_scores_are_refused(make_table, to_dev):
    table = make_table(16, policy=ScorePolicy.LFU_LRU)
    with pytest.raises(ValueError, match="CUSTOMIZED"):
        table.find_or_insert(to_dev([1]), to_dev([5]))
    assert table.size() == 0
