"""``FrequencyAdmission(initializer=...)``: what a key that admission refuses reads in
training. Refused keys read the admission initializer's rows (None: the table's), nothing is
stored and their gradients are dropped; once admitted a key starts from the table's
initializer row and trains. Checked against hand-computed rows in every storage mode, both
backends, sequence and pooled modules; the option travels to the shards and is no part of a
checkpoint."""
import io

import pytest
import torch
from torchrec import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbBagCollection, DynamicEmbCollection, DynamicEmbTableOptions,
                    FrequencyAdmission, Initializer, InitializerKind, OptimizerConfig,
                    OptimizerType, StorageMode)
from dynemb.modules.rank_share import local_table_options
from key_reference import initial_rows

#: table_identity("t"), pinned in test_initializers.py: new rows of table "t" start from it
TABLE_T_ID = 6256752092847567818
DIM = 4
SGD = OptimizerConfig(OptimizerType.SGD, learning_rate=0.5)
INIT = Initializer(InitializerKind.UNIFORM, low=-0.1, high=0.1)
QUARTER = Initializer(InitializerKind.CONSTANT, value=0.25)
ZEROS = Initializer(InitializerKind.CONSTANT, value=0.0)
ROW_BYTES = DIM * 4  # SGD keeps no state
#: a budget of 16 device rows: the 64-id table does not fit, so CACHE and DEFAULT
MODES = {"hbm_direct": {}, "cache": dict(caching=True, local_hbm_for_values=16 * ROW_BYTES),
         "default": dict(local_hbm_for_values=16 * ROW_BYTES)}


def table_rows(ids):
    """The table's initializer rows of ``ids`` (the Python reference)."""
    return torch.tensor(initial_rows(INIT, ids, DIM, seed=0, table_id=TABLE_T_ID))


def constant(value, n):
    return torch.full((n, DIM), value)


def options(mode, admission_init, threshold=2):
    return DynamicEmbTableOptions(
        initializer=INIT, bucket_size=16, **MODES[mode],
        admission=FrequencyAdmission(threshold=threshold, counter_capacity=128,
                                     initializer=admission_init))


def sequence(mode, admission_init, backend, device):
    tables = [EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=64,
                              feature_names=["f"])]
    ec = DynamicEmbCollection(tables, table_options=options(mode, admission_init),
                              optimizer=SGD, device=device, backend=backend)
    assert ec.storage_modes() == {"t": StorageMode(mode)}
    return ec


def kjt(ids, device, lengths=None):
    ids = torch.as_tensor(ids, dtype=torch.int64, device=device)
    lengths = torch.tensor([ids.numel()] if lengths is None else lengths, device=device)
    return KeyedJaggedTensor.from_lengths_sync(["f"], ids, lengths)


def step(ec, ids, device):
    """One training step whose loss is the sum of the outputs: each stored row moves by
    -lr = -0.5 per use. Returns the outputs (one row per id, or per bag)."""
    out = ec(kjt(ids, device))
    values = out["f"].values() if isinstance(out, dict) else out.values()
    values.sum().backward()
    return values.detach().cpu()


def rows_of(ec, ids, device):
    rows, found = ec.read_rows("t", torch.tensor(ids, device=device))
    return rows.cpu(), found.cpu().tolist()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_refused_keys_read_the_admission_initializer_until_admitted(mode, backend):
    backend, device = backend
    ec = sequence(mode, QUARTER, backend, device)
    # step 1: 10 and 20 seen once each, both refused: 0.25 rows, nothing stored
    torch.testing.assert_close(step(ec, [10, 20], device), constant(0.25, 2))
    assert rows_of(ec, [10, 20], device)[1] == [False, False]
    # step 2: 10 reaches the threshold and reads the table's initializer row; 30 refused
    out = step(ec, [10, 30], device)
    torch.testing.assert_close(out, torch.cat([table_rows([10]), constant(0.25, 1)]))
    # step 3: 10 trained once already; 20 admitted now, from the table's initializer row
    out = step(ec, [10, 20], device)
    torch.testing.assert_close(out, torch.cat([table_rows([10]) - 0.5, table_rows([20])]))
    rows, found = rows_of(ec, [10, 20, 30], device)
    assert found == [True, True, False]  # the refused sightings' gradients were dropped
    torch.testing.assert_close(rows[:2], table_rows([10, 20]) - torch.tensor([[1.0], [0.5]]))
    stats = ec.stats()["t"]
    assert stats["admission_rejects"] == 3 and stats["inserts"] == 2


@pytest.mark.parametrize("mode", sorted(MODES))
def test_without_an_admission_initializer_refused_keys_read_the_tables(mode, backend):
    backend, device = backend
    ec = sequence(mode, None, backend, device)
    torch.testing.assert_close(step(ec, [10, 20], device), table_rows([10, 20]))
    assert rows_of(ec, [10, 20], device)[1] == [False, False]
    torch.testing.assert_close(step(ec, [20], device), table_rows([20]))  # admitted: same row
    rows, found = rows_of(ec, [10, 20], device)
    assert found == [False, True]
    torch.testing.assert_close(rows[1:], table_rows([20]) - 0.5)


@pytest.mark.parametrize("mode", ["hbm_direct", "default"])
def test_pooled_bags_sum_the_admission_initializer_rows(mode, backend):
    backend, device = backend
    tables = [EmbeddingBagConfig(name="t", embedding_dim=DIM, num_embeddings=64,
                                 feature_names=["f"], pooling=PoolingType.SUM)]
    ebc = DynamicEmbBagCollection(tables, table_options=options(mode, ZEROS), optimizer=SGD,
                                  device=device, backend=backend)
    # one bag of 10, 20 and 20: 20 is admitted (seen twice), 10 refused and reads zeros
    pooled = step(ebc, [10, 20, 20], device)
    torch.testing.assert_close(pooled, 2 * table_rows([20]))
    # a second bag of 10 alone: admitted now, its table row
    torch.testing.assert_close(step(ebc, [10], device), table_rows([10]))
    rows, found = rows_of(ebc, [10, 20], device)
    assert found == [True, True]
    torch.testing.assert_close(rows, table_rows([10, 20]) - torch.tensor([[0.5], [1.0]]))


def test_a_bad_admission_initializer_is_refused():
    with pytest.raises(TypeError, match="admission.initializer must be an Initializer"):
        FrequencyAdmission(initializer="zeros")
    with pytest.raises(TypeError, match="admission.initializer"):
        FrequencyAdmission(threshold=2, initializer=0.0)


def test_the_shards_keep_the_admission_initializer():
    local = local_table_options(options("hbm_direct", ZEROS), world_size=4)
    assert local.admission.initializer == ZEROS
    assert local.admission.counter_capacity == 32  # 128 split over 4 ranks


@pytest.mark.parametrize("mode", sorted(MODES))
def test_checkpoints_do_not_hold_the_admission_initializer(mode):
    """A state saved with one admission initializer loads into a model with another: the
    same rows, scores and counts; refused keys then read each model's own initializer."""
    saved = sequence(mode, QUARTER, "cpu", "cpu")
    for ids in ([10, 20], [10, 30], [10, 20, 40]):
        step(saved, ids, "cpu")
    buffer = io.BytesIO()
    torch.save(saved.state_dict(), buffer)
    buffer.seek(0)
    loaded = sequence(mode, None, "cpu", "cpu")
    loaded.load_state_dict(torch.load(buffer, weights_only=False))
    ids = [10, 20, 30, 40, 50]
    assert rows_of(loaded, ids, "cpu")[1] == rows_of(saved, ids, "cpu")[1] == [
        True, True, False, False, False]
    torch.testing.assert_close(rows_of(loaded, ids, "cpu")[0], rows_of(saved, ids, "cpu")[0])
    # 30 and 40 reach their threshold in both (their counts were saved); 50 is refused
    expected = torch.cat([table_rows([30, 40]), constant(0.25, 1)])
    torch.testing.assert_close(step(saved, [30, 40, 50], "cpu"), expected)
    expected = table_rows([30, 40, 50])
    torch.testing.assert_close(step(loaded, [30, 40, 50], "cpu"), expected)
    rows_a, found_a = rows_of(saved, ids, "cpu")
    rows_b, found_b = rows_of(loaded, ids, "cpu")
    assert found_a == found_b == [True, True, True, True, False]
    assert torch.equal(rows_a, rows_b)
