"""What every storage mode shares (DynamicTable), through the simplest one (HBM_DIRECT), a
bare table running its batches as a group of one: prefetch counts, an update then its pins
end, held batches across growth, what a table holds."""
import torch

from dynemb.foundations.counters import COUNTER_NAMES
from dynemb.tables import DynamicTable
from dynemb.types import EMPTY_KEY
from table_builder import DIM, build, prefetch, rows_of, start_rows, update


def test_prefetch_dedups_and_counts_occurrences():
    table = build()
    batch = prefetch(table, torch.tensor([5, 7, 5]), occurrences=torch.tensor([2, 1, 3]))
    # padded to the input's length with EMPTY_KEY (count 0), which no input key points to
    assert sorted(batch.keys.tolist()) == sorted([5, 7, EMPTY_KEY])
    assert batch.keys[batch.inverse].tolist() == [5, 7, 5]
    assert dict(zip(batch.keys.tolist(), batch.counts.tolist())) == {5: 5, 7: 1, EMPTY_KEY: 0}
    prefetch(table, torch.tensor([7, 7]))
    stats = table.stats()
    assert (stats["lookups"], stats["unique_keys"], stats["inserts"], stats["hits"]) == (
        8, 3, 2, 1)


def test_a_batch_updates_its_rows_then_lets_them_go():
    table = build()
    batch = prefetch(table, torch.tensor([1, 2, 1]))
    torch.testing.assert_close(rows_of(batch), start_rows([1, 2, 1]))
    assert table.tier.hash.pinned_count() == 2
    grads = torch.tensor([[2.0] * DIM if k == 1 else [1.0] * DIM for k in batch.keys.tolist()])
    update(table, batch, grads, lr=0.5, step=1)
    assert table.tier.hash.pinned_count() == 0
    expected = start_rows([1, 2]) - 0.5 * torch.tensor([[2.0], [1.0]])
    rows, found = table.read_rows(torch.tensor([1, 2, 3]))
    assert found.tolist() == [True, True, False]
    torch.testing.assert_close(rows[:2], expected)


def test_a_held_batch_follows_its_rows_when_a_later_prefetch_grows_the_table():
    table = build(init_capacity=8, max_capacity=128, bucket_size=8)
    first = prefetch(table, torch.tensor([100, 101, 102]))
    prefetch(table, torch.arange(40))      # grows the table under ``first``
    assert table.tier.hash.capacity > 8
    torch.testing.assert_close(rows_of(first), start_rows([100, 101, 102]))
    update(table, first, torch.ones(3, DIM), lr=0.5, step=1)
    rows, _ = table.read_rows(torch.tensor([100, 101, 102, 0]))
    torch.testing.assert_close(rows, torch.cat([start_rows([100, 101, 102]) - 0.5,
                                                start_rows([0])]))


def test_besides_its_rows_a_table_holds_its_counters_only():
    """Hand-computed: one int64 per counter on the device, nothing on the host (no count of
    slot failures per table: a group counts those)."""
    memory = build().memory_breakdown()
    assert (memory.other_bytes, memory.host_other_bytes) == (8 * len(COUNTER_NAMES), 0)


def test_fixed_memory_is_what_a_built_table_holds_besides_its_rows():
    table = build()
    fixed, held = DynamicTable.fixed_memory(), table.memory_breakdown()
    assert (held.other_bytes, held.host_other_bytes) == (fixed.other_bytes,
                                                         fixed.host_other_bytes)
