"""Memory stashing and what else holds a table's rows, on CPU, checked against hand-computed
rows: every row starts at 1.0 (a constant initializer), the loss is the sum of the looked-up
values, so SGD moves a key's row by ``-lr * (its occurrences in the batch)``, exactly.

- a reference to a table's own rows tensor (``tier.flat.weights``) does not keep the table
  from being stashed: the tensor is the table's, empty while the rows are away and holding
  the rows again, updated, once they are back;
- a view of the rows, or a numpy array of them, kept across a step keeps the memory, so the
  rows stay on the device (a warning), and the view reads the table's rows after the step.
"""
import warnings

import pytest
import torch
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, Initializer, InitializerKind,
                    OptimizerConfig, OptimizerType)
from dynemb.options import StashMode

LR = 0.25
DIM = 4
NAMES = ("t0", "t1")


def _collection(group_tables=True):
    configs = [EmbeddingConfig(name=name, embedding_dim=DIM, num_embeddings=64,
                               feature_names=[f"f{i}"]) for i, name in enumerate(NAMES)]
    options = {name: DynamicEmbTableOptions(
        max_capacity=64, bucket_size=16, stash=StashMode.ALL,
        initializer=Initializer(InitializerKind.CONSTANT, value=1.0)) for name in NAMES}
    return DynamicEmbCollection(configs, table_options=options,
                                optimizer=OptimizerConfig(OptimizerType.SGD, learning_rate=LR),
                                group_tables=group_tables)


# per feature, the ids of one sample each: 3 occurs twice in f0, 7 once; 5 three times in f1
IDS = {"f0": [3, 7, 3], "f1": [5, 5, 5, 2]}
COUNTS = {"t0": {3: 2, 7: 1}, "t1": {5: 3, 2: 1}}


def _batch():
    values = torch.tensor(IDS["f0"] + IDS["f1"])
    lengths = torch.tensor([len(IDS["f0"]), len(IDS["f1"])])
    return KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], values, lengths)


def _loss(out):
    return sum(jt.values().sum() for jt in out.values())


def _expected(name, steps):
    """Each counted key's row after ``steps`` training steps of the batch above."""
    return {key: torch.full((DIM,), 1.0 - LR * count * steps)
            for key, count in COUNTS[name].items()}


def _assert_rows(ec, steps):
    for name in NAMES:
        keys = torch.tensor(sorted(COUNTS[name]))
        rows, found = ec.read_rows(name, keys)
        assert bool(found.all()), name
        want = _expected(name, steps)
        assert torch.equal(rows, torch.stack([want[int(k)] for k in keys])), name


@pytest.mark.parametrize("group_tables", [True, False], ids=["grouped", "alone"])
def test_a_reference_to_the_rows_tensor_does_not_keep_the_table_from_stashing(group_tables):
    ec = _collection(group_tables)
    _loss(ec(_batch())).backward()
    held = ec.tables["t1"].tier.flat.weights  # the table's own tensor, not a view of it
    slot_of = {}
    for key in COUNTS["t1"]:
        rows, _ = ec.read_rows("t1", torch.tensor([key]))
        slot_of[key] = [s for s in range(held.shape[0])
                        if torch.equal(held[s, :DIM], rows[0])][:1]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out = ec(_batch())
    assert ec.memory_stash.stashed == list(NAMES)
    assert held.untyped_storage().nbytes() == 0 and held.shape[0] == 0  # away
    _loss(out).backward()
    assert ec.memory_stash.stashed == []
    assert held is ec.tables["t1"].tier.flat.weights  # the same tensor, refilled
    assert held.shape == (64, DIM)
    want = _expected("t1", 2)
    for key, count in COUNTS["t1"].items():
        rows, _ = ec.read_rows("t1", torch.tensor([key]))
        assert torch.equal(rows[0], want[key])
        assert any(torch.equal(held[s, :DIM], want[key]) for s in range(held.shape[0]))
    _assert_rows(ec, 2)


@pytest.mark.parametrize("group_tables", [True, False], ids=["grouped", "alone"])
def test_a_view_kept_across_a_step_reads_the_updated_rows(group_tables):
    """The view holds the memory, so the table stays (warned); after the step the view is
    still the table's rows, with the update in it."""
    ec = _collection(group_tables)
    _loss(ec(_batch())).backward()
    view = ec.tables["t0"].tier.flat.weights[:, :DIM]
    with pytest.warns(RuntimeWarning, match="stay on the device"):
        out = ec(_batch())
    assert "t0" not in ec.memory_stash.stashed
    assert ec.memory_stash.stashed == ([] if group_tables else ["t1"])
    _loss(out).backward()
    want = _expected("t0", 2)
    for key in COUNTS["t0"]:
        assert any(torch.equal(view[s], want[key]) for s in range(view.shape[0]))
    assert torch.equal(view, ec.tables["t0"].tier.flat.weights[:, :DIM])
    _assert_rows(ec, 2)
    del view
    _loss(ec(_batch())).backward()  # nothing holds the rows now: they go
    assert ec.memory_stash.table_stashes()["t0"].stashes == 2  # steps 1 and 3
    _assert_rows(ec, 3)


def test_a_numpy_array_of_the_rows_keeps_them_in_place():
    """A numpy array of the rows points at their memory: releasing it under the array would
    leave it reading freed memory."""
    ec = _collection(group_tables=False)
    _loss(ec(_batch())).backward()
    array = ec.tables["t1"].tier.flat.weights.numpy()
    with pytest.warns(RuntimeWarning, match="'t1'.*stay on the device"):
        out = ec(_batch())
    assert ec.memory_stash.stashed == ["t0"]
    _loss(out).backward()
    assert torch.equal(torch.from_numpy(array), ec.tables["t1"].tier.flat.weights)
    _assert_rows(ec, 2)
