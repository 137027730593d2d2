"""Frequency admission: a key is admitted on the call its tally reaches the threshold, then
leaves the counter; only candidates are counted; the counter table is sized in whole buckets."""
import torch

from dynemb.rows.admission import AdmissionCounter, counter_slots
from dynemb.types import EMPTY_KEY


def admit(counter, keys, counts, candidates=None):
    keys = torch.tensor(keys)
    candidates = torch.ones(keys.numel(), dtype=torch.bool) if candidates is None else (
        torch.tensor(candidates))
    return counter.admit(keys, torch.tensor(counts), candidates).tolist()


def test_a_key_is_admitted_on_the_call_its_tally_reaches_the_threshold():
    counter = AdmissionCounter(3, 65536, torch.device("cpu"))
    assert admit(counter, [7, 8], [1, 2]) == [False, False]    # tallies 1 and 2
    assert counter.size() == 2
    assert admit(counter, [7, 8, 9], [1, 1, 5]) == [False, True, True]  # 2, 3, 5
    assert counter.size() == 1                                # 8 and 9 left the counter
    assert admit(counter, [8], [1]) == [False]                # counted again from zero
    assert admit(counter, [7], [1]) == [True]


def test_only_candidates_are_counted():
    counter = AdmissionCounter(2, 65536, torch.device("cpu"))
    # 5 is stored already (not a candidate), EMPTY_KEY is padding
    assert admit(counter, [5, 6, EMPTY_KEY], [4, 1, 0], [False, True, False]) == [
        False, False, False]
    assert counter.size() == 1
    assert admit(counter, [5, 6], [1, 1]) == [False, True]    # 5 starts at 1 now


def test_counter_slots_are_whole_buckets_of_128():
    assert [counter_slots(c) for c in (1, 128, 129, 200)] == [
        128, 128, 256, 256]
    counter = AdmissionCounter(2, 200, torch.device("cpu"))
    assert counter.table.capacity == 256
