"""HBM_DIRECT (HbmDirectTable), a bare table running its batches as a group of one: a
training prefetch inserts and starts new rows; an eval lookup finds without inserting or
rescoring, and unseen keys read the eval initializer."""
import torch

from dynemb import Initializer, InitializerKind, ScorePolicy, StorageMode
from dynemb.types import EMPTY_KEY
from table_builder import DIM, build, prefetch, rows_of, start_rows, update


def test_training_prefetch_inserts_and_starts_new_rows():
    table = build()
    assert type(table).__name__ == "HbmDirectTable" and table.mode is StorageMode.HBM_DIRECT
    batch = prefetch(table, torch.tensor([7, 9, 7]))
    # the unique keys are padded to the input's length: EMPTY_KEY (count 0) has no slot
    assert batch.keys.tolist() == [7, 9, EMPTY_KEY] and batch.counts.tolist() == [2, 1, 0]
    assert table.tier.hash.size() == 2 and batch.slots.ge(0).tolist() == [True, True, False]
    torch.testing.assert_close(rows_of(batch), start_rows([7, 9, 7]))


def test_eval_prefetch_reads_without_inserting_or_rescoring():
    table = build(eval_initializer=Initializer(InitializerKind.CONSTANT, value=-3.0),
                  score_strategy=ScorePolicy.LRU)
    train = prefetch(table, torch.tensor([1, 2]))
    update(table, train, torch.ones(2, DIM), lr=0.5, step=1)
    scores = table.tier.hash.export().scores.tolist()
    batch = prefetch(table, torch.tensor([2, 3]), training=False)
    assert batch.member("t").slots.tolist()[batch.keys.tolist().index(3)] == -1
    assert table.tier.hash.pinned_count() == 1
    rows = rows_of(batch)
    torch.testing.assert_close(rows[0], start_rows([2])[0] - 0.5)
    torch.testing.assert_close(rows[1], torch.full((DIM,), -3.0))
    batch.release()
    assert table.tier.hash.pinned_count() == 0 and table.tier.hash.size() == 2
    assert table.tier.hash.export().scores.tolist() == scores
    stats = table.stats()
    assert (stats["hits"], stats["misses"], stats["inserts"]) == (1, 3, 2)
