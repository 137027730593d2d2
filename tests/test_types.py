"""Result types of the hash table: which inserts evicted a live key, slots per input key."""
import torch

from dynemb import ScorePolicy
from dynemb.types import EMPTY_KEY, TOMBSTONE_KEY, FindOrInsertResult


def test_an_insert_evicts_only_where_the_slot_held_a_live_key():
    result = FindOrInsertResult(
        keys=torch.tensor([1, 2, 3, 4, 5]), inverse=torch.tensor([4, 0, 0, 3]),
        slots=torch.tensor([10, 11, 12, 13, -1]),
        inserted=torch.tensor([True, True, True, False, False]),
        previous_keys=torch.tensor([EMPTY_KEY, TOMBSTONE_KEY, 77, 4, EMPTY_KEY]),
        previous_scores=torch.zeros(5, dtype=torch.int64),
        failed=torch.tensor([False, False, False, False, True]), remap=None)
    # a free slot, an erased slot, a displaced key, a hit, a failure
    assert result.evicted.tolist() == [False, False, True, False, False]
    assert result.input_slots.tolist() == [-1, 10, 10, 13]


def test_reserved_keys_are_the_two_lowest_int64():
    # part of the data layout: a checkpoint's empty and erased slots hold them
    assert (EMPTY_KEY, TOMBSTONE_KEY) == (-(2**63), -(2**63) + 1)


def test_policy_codes_are_distinct():
    assert len({p.code for p in ScorePolicy}) == len(ScorePolicy)
