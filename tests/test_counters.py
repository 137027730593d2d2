"""Per-table counters: ints and device tensors add up, one snapshot reads them all."""
import torch

from dynemb.foundations.counters import COUNTER_NAMES, TableCounters


def test_counters_add_ints_and_tensors_and_reset():
    c = TableCounters(torch.device("cpu"))
    assert c.snapshot() == dict.fromkeys(COUNTER_NAMES, 0)
    c.add("hits", torch.tensor(3))
    c.add("hits", 2)
    c.add_many(inserts=4, evictions=1)                       # the one-op path
    c.add_many(misses=torch.tensor(6), inserts=torch.tensor(1))
    snap = c.snapshot()
    assert (snap["hits"], snap["inserts"], snap["evictions"], snap["misses"]) == (5, 5, 1, 6)
    assert sum(snap.values()) == 17 and list(snap) == list(COUNTER_NAMES)
    c.reset()
    assert set(c.snapshot().values()) == {0}


def test_counters_hold_one_int64_each():
    assert TableCounters(torch.device("cpu")).nbytes() == 8 * len(COUNTER_NAMES)
    assert len(set(COUNTER_NAMES)) == len(COUNTER_NAMES)
