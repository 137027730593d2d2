"""The life of one lookup in DynamicEmbCollection: how long its rows stay pinned, what its
backward may update, and what eval / no_grad / retain_graph / a bad learning rate do.

Expected rows are hand-computed: with the loss ``sum(embeddings)`` and SGD, a row moves by
``-lr * uses`` per backward.
"""
import pytest
import torch
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, Initializer, InitializerKind,
                    OptimizerConfig, OptimizerType, ScorePolicy, TableFullError)
from dynemb.rows.initializers import table_identity

DIM = 4
LR = 0.5
SGD = OptimizerConfig(OptimizerType.SGD, learning_rate=LR)
INIT = Initializer(InitializerKind.CONSTANT, value=1.0)
EVAL_INIT = Initializer(InitializerKind.CONSTANT, value=-7.0)


def make(tables=("t",), capacity=1024, bucket=None, **options):
    configs = [EmbeddingConfig(name=name, embedding_dim=DIM, num_embeddings=capacity,
                               feature_names=[f"f_{name}"]) for name in tables]
    opts = DynamicEmbTableOptions(initializer=INIT, eval_initializer=EVAL_INIT,
                                  bucket_size=bucket or min(128, capacity), **options)
    return DynamicEmbCollection(configs, table_options=opts, optimizer=SGD)


def batch(ids_by_feature):
    """{feature: [ids]} -> one-sample KJT."""
    features = list(ids_by_feature)
    ids = [i for f in features for i in ids_by_feature[f]]
    lengths = [len(ids_by_feature[f]) for f in features]
    return KeyedJaggedTensor.from_lengths_sync(features, torch.tensor(ids, dtype=torch.int64),
                                               torch.tensor(lengths))


def pinned(ec, table="t"):
    return ec.tables[table].tier.hash.pinned_count()


def row(ec, key, table="t"):
    rows, found = ec.read_rows(table, torch.tensor([key]))
    return rows[0] if bool(found[0]) else None


def total(out, features=None):
    return sum(jt.values().sum() for f, jt in out.items() if features is None or f in features)


# -- pin lifetime ------------------------------------------------------------------------------
def test_a_table_unused_by_the_loss_does_not_hold_its_rows_for_ever():
    # 16 rows in one bucket; each step looks up 4 new ids in "u" but trains only "t". Before
    # pins had a lifetime, "u" filled with pinned rows and raised TableFullError at step 5.
    ec = make(tables=("t", "u"), capacity=16, score_strategy=ScorePolicy.LRU)
    for step in range(40):
        out = ec(batch({"f_t": [1], "f_u": list(range(4 * step, 4 * step + 4))}))
        total(out, ["f_t"]).backward()
        assert pinned(ec, "u") == 4  # this step's rows only
    assert pinned(ec, "t") == 0
    torch.testing.assert_close(row(ec, 1), torch.full((DIM,), 1.0 - 40 * LR))


@pytest.mark.parametrize("how", ["del", "autograd.grad", "exception"])
def test_lookups_whose_backward_never_comes_release_at_the_next_training_forward(how):
    ec = make(capacity=16, score_strategy=ScorePolicy.LRU)
    weight = torch.ones(1, requires_grad=True)
    for step in range(12):
        out = ec(batch({"f_t": list(range(4 * step, 4 * step + 4))}))
        if how == "del":
            del out
        elif how == "autograd.grad":
            (grad,) = torch.autograd.grad((weight * 3).sum(), [weight])
            assert grad.item() == 3.0
        else:
            with pytest.raises(RuntimeError, match="mid-step"):
                raise RuntimeError("mid-step")
        assert pinned(ec) == 4
    assert ec.stats()["t"]["evictions"] > 0  # old rows became evictable: no TableFullError


def test_clear_prefetched_and_eval_end_pins_of_lookups_awaiting_backward():
    ec = make()
    ec(batch({"f_t": [1, 2, 3]}))
    assert pinned(ec) == 3
    ec.clear_prefetched()
    assert pinned(ec) == 0
    ec(batch({"f_t": [4, 5]}))
    ec.eval()
    assert pinned(ec) == 0


def test_a_backward_after_the_pins_ended_never_writes_another_keys_row():
    # one bucket of 4 slots: key 1 is looked up, its pins end at the next training forward,
    # a third forward evicts it and gives its slot to key 9; then key 1's backward runs.
    ec = make(capacity=4, bucket=4, score_strategy=ScorePolicy.LRU)
    first = ec(batch({"f_t": [1]}))
    total(ec(batch({"f_t": [2, 3, 4]}))).backward()  # 1's pins end here
    total(ec(batch({"f_t": [9]}))).backward()         # evicts 1 (least recent)
    assert row(ec, 1) is None
    nine = row(ec, 9).clone()
    total(first).backward()
    torch.testing.assert_close(row(ec, 9), nine)  # untouched
    assert ec.stats()["t"]["dropped_updates"] == 1


def test_a_backward_after_the_pins_ended_still_updates_rows_that_stayed():
    # two lookups in one step (two towers reading one module): both updates land
    ec = make()
    a = ec(batch({"f_t": [1, 2]}))
    b = ec(batch({"f_t": [2, 3]}))  # ends a's pins, after pinning its own rows
    (total(a) + total(b)).backward()
    for key, uses in ((1, 1), (2, 2), (3, 1)):
        torch.testing.assert_close(row(ec, key), torch.full((DIM,), 1.0 - uses * LR))
    assert ec.stats()["t"]["dropped_updates"] == 0 and pinned(ec) == 0


def test_two_lookups_in_one_step_both_update_in_default_mode():
    # DEFAULT gathers rows in forward; a backward must not write back a stale copy over the
    # other lookup's update
    ec = make(capacity=256, bucket=16, local_hbm_for_values=16 * DIM * 4)
    assert ec.storage_modes()["t"].value == "default"
    a = ec(batch({"f_t": list(range(40))}))
    b = ec(batch({"f_t": list(range(40))}))
    (total(a) + total(b)).backward()
    rows, found = ec.read_rows("t", torch.arange(40))
    assert bool(found.all())
    torch.testing.assert_close(rows, torch.full((40, DIM), 1.0 - 2 * LR))


def test_table_full_error_says_what_holds_the_pins():
    ec = make(capacity=4, bucket=4)
    ec.prefetch(batch({"f_t": [1, 2]}))
    ec(batch({"f_t": [1, 2]}))  # consumed, awaiting backward
    ec.prefetch(batch({"f_t": [3, 4]}))
    with pytest.raises(TableFullError, match=r"1 prefetched batches not yet consumed by "
                                             r"forward and 1 looked-up batches waiting"):
        ec.prefetch(batch({"f_t": [5]}))


# -- backward ----------------------------------------------------------------------------------
def test_a_second_backward_through_one_lookup_is_an_error_and_updates_once():
    ec = make()
    out = ec(batch({"f_t": [1, 1]}))
    loss = total(out)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already ran"):
        loss.backward()
    torch.testing.assert_close(row(ec, 1), torch.full((DIM,), 1.0 - 2 * LR))


def test_a_negative_learning_rate_set_on_the_optimizer_is_rejected_at_backward():
    ec = make()
    out = ec(batch({"f_t": [1]}))
    ec.fused_optimizer.param_groups[0]["lr"] = -0.1
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\].*-0.1"):
        total(out).backward()
    torch.testing.assert_close(row(ec, 1), torch.full((DIM,), 1.0))
    with pytest.raises(ValueError, match="lr"):  # and at the next forward, before any change
        ec(batch({"f_t": [2]}))
    assert row(ec, 2) is None
    ec.fused_optimizer.param_groups[0]["lr"] = LR
    total(ec(batch({"f_t": [1]}))).backward()
    torch.testing.assert_close(row(ec, 1), torch.full((DIM,), 1.0 - LR))


@pytest.mark.parametrize("bad_lr, error", [("0.1", TypeError), (True, TypeError),
                                           (float("nan"), ValueError)])
def test_an_lr_that_is_not_a_number_is_rejected_at_forward_before_any_change(bad_lr, error):
    ec = make()
    ec.fused_optimizer.param_groups[0]["lr"] = bad_lr
    with pytest.raises(error, match=r"param_groups\[0\]\['lr'\].*nothing was updated"):
        ec(batch({"f_t": [2]}))
    assert row(ec, 2) is None and ec.stats()["t"]["lookups"] == 0


# -- no_grad -----------------------------------------------------------------------------------
def test_no_grad_in_training_mode_reads_without_inserting_or_rescoring():
    ec = make(capacity=4, bucket=4, score_strategy=ScorePolicy.LRU)
    for key in (1, 2, 3, 4):
        total(ec(batch({"f_t": [key]}))).backward()
    before = ec.stats()["t"]
    with torch.no_grad():
        out = ec(batch({"f_t": [1, 99]}))["f_t"].values()
    torch.testing.assert_close(out[0], torch.full((DIM,), 1.0 - LR))
    torch.testing.assert_close(out[1], torch.full((DIM,), -7.0))  # eval initializer
    after = ec.stats()["t"]
    assert after["rows_device"] == before["rows_device"] == 4
    assert after["inserts"] == before["inserts"] and after["evictions"] == 0
    assert row(ec, 99) is None and pinned(ec) == 0
    # key 1 was not rescored by the read: it is still the least recent, so it goes first
    total(ec(batch({"f_t": [5]}))).backward()
    assert row(ec, 1) is None and row(ec, 2) is not None


def test_no_grad_forward_leaves_a_queued_training_batch_for_its_training_forward():
    ec = make()
    train_batch = batch({"f_t": [1, 2]})
    ec.prefetch(train_batch)
    with torch.no_grad():
        ec(batch({"f_t": [7]}))
    assert ec.pending_prefetches == 1
    total(ec(train_batch)).backward()
    torch.testing.assert_close(row(ec, 1), torch.full((DIM,), 1.0 - LR))
    assert row(ec, 7) is None


# -- forward must match its prefetch -------------------------------------------------------------
@pytest.mark.parametrize("validate", [True, False])
def test_forward_with_the_prefetched_ids_but_other_lengths_is_rejected(validate):
    configs = [EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=64,
                               feature_names=["a", "b"])]
    ec = DynamicEmbCollection(configs, table_options=DynamicEmbTableOptions(initializer=INIT),
                              optimizer=SGD, validate_inputs=validate)
    ids = torch.tensor([1, 2, 3, 4])
    ec.prefetch(KeyedJaggedTensor.from_lengths_sync(["a", "b"], ids, torch.tensor([1, 1, 2, 0])))
    other = KeyedJaggedTensor.from_lengths_sync(["a", "b"], ids, torch.tensor([2, 0, 1, 1]))
    with pytest.raises(ValueError, match="other lengths"):
        ec(other)
    assert ec.pending_prefetches == 1 and pinned(ec) == 4  # refused: nothing changed
    ec.clear_prefetched()
    assert ec.pending_prefetches == 0 and pinned(ec) == 0
    out = ec(other)  # inline now, with its own lengths
    assert out["a"].lengths().tolist() == [2, 0] and out["b"].lengths().tolist() == [1, 1]


# -- table identity ------------------------------------------------------------------------------
def test_tables_of_two_modules_start_from_different_rows_for_the_same_id():
    init = Initializer(InitializerKind.UNIFORM, low=-1.0, high=1.0)

    def module(names):
        configs = [EmbeddingConfig(name=n, embedding_dim=DIM, num_embeddings=64,
                                   feature_names=[f"f_{n}"]) for n in names]
        return DynamicEmbCollection(configs, table_options=DynamicEmbTableOptions(
            initializer=init), optimizer=SGD)

    users, items, both = module(["users"]), module(["items"]), module(["items", "users"])
    first = {}
    for name, ec in (("users", users), ("items", items)):
        ec(batch({f"f_{name}": [42]}))
        first[name] = row(ec, 42, name)
    assert not torch.allclose(first["users"], first["items"])
    both(batch({"f_items": [42], "f_users": [42]}))  # other position in the module: same rows
    torch.testing.assert_close(row(both, 42, "users"), first["users"])
    torch.testing.assert_close(row(both, 42, "items"), first["items"])
    assert users.tables["users"].table_id == table_identity("users")
