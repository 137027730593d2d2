"""DynamicEmbCollection behaviour: admission, eviction order per score strategy, eval mode,
queued prefetches, shared tables, empty input, counters, bad input."""
import pytest
import torch
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, FrequencyAdmission,
                    Initializer, InitializerKind, OptimizerConfig,
                    OptimizerType, ScorePolicy, StorageMode, TableFullError)
from key_reference import initial_rows

#: table_identity("t"), pinned in test_initializers.py: new rows of table "t" start from it
TABLE_T_ID = 6256752092847567818

DIM = 4
SGD = OptimizerConfig(OptimizerType.SGD, learning_rate=0.5)
INIT = Initializer(InitializerKind.UNIFORM, low=-0.1, high=0.1)


def make(options=None, features=("f",), num_embeddings=1024, optimizer=SGD, **kwargs):
    tables = [EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=num_embeddings,
                              feature_names=list(features))]
    return DynamicEmbCollection(tables, table_options=options or DynamicEmbTableOptions(
        initializer=INIT), optimizer=optimizer, **kwargs)


def kjt(ids, features=("f",), lengths=None):
    ids = torch.as_tensor(ids, dtype=torch.int64)
    if lengths is None:
        lengths = [ids.numel()] + [0] * (len(features) - 1)
    return KeyedJaggedTensor.from_lengths_sync(list(features), ids, torch.tensor(lengths))


def train_step(ec, ids, **kw):
    """One step whose loss is the sum of all embeddings: each row moves by -lr per use."""
    out = ec(kjt(ids, **kw))
    loss = sum(jt.values().sum() for jt in out.values())
    loss.backward()
    return out


def init_rows(ids, seed=0):
    """The rows INIT starts ``ids`` of table "t" from (the Python reference)."""
    return torch.tensor(initial_rows(INIT, ids, DIM, seed=seed, table_id=TABLE_T_ID))


def stored(ec, ids, table="t"):
    return ec.read_rows(table, torch.as_tensor(ids, dtype=torch.int64))[1].tolist()


# -- admission -----------------------------------------------------------------------------
def test_admission_stores_a_key_on_its_threshold_th_sighting():
    ec = make(DynamicEmbTableOptions(initializer=INIT, admission=FrequencyAdmission(threshold=3)))
    out = train_step(ec, [10, 20])  # first sighting of both: refused, initializer rows
    torch.testing.assert_close(out["f"].values(), init_rows([10, 20]))
    assert stored(ec, [10, 20]) == [False, False]
    train_step(ec, [10])  # second sighting: still refused, its gradient is dropped
    assert stored(ec, [10]) == [False]
    out = train_step(ec, [10, 30, 30, 30])  # 10: third sighting; 30: three in one batch
    torch.testing.assert_close(out["f"].values(), init_rows([10, 30, 30, 30]))
    assert stored(ec, [10, 20, 30]) == [True, False, True]
    rows, _ = ec.read_rows("t", torch.tensor([10, 30]))
    expected = init_rows([10, 30]) - 0.5 * torch.tensor([[1.0], [3.0]])
    torch.testing.assert_close(rows, expected)
    s = ec.stats()["t"]
    assert s["admission_rejects"] == 3 and s["inserts"] == 2 and s["rows_device"] == 2


def test_new_rows_start_from_the_table_seed_and_name():
    ec = make(DynamicEmbTableOptions(initializer=INIT, seed=5))
    out = train_step(ec, [3, -(2**62), 3])
    torch.testing.assert_close(out["f"].values(), init_rows([3, -(2**62), 3], seed=5))
    rows, _ = ec.read_rows("t", torch.tensor([3, -(2**62)]))
    torch.testing.assert_close(rows, init_rows([3, -(2**62)], seed=5) - 0.5 * torch.tensor(
        [[2.0], [1.0]]))


# -- eviction order per score strategy -------------------------------------------------------
def _one_bucket(policy):
    return make(DynamicEmbTableOptions(initializer=INIT, max_capacity=4, bucket_size=4,
                                       score_strategy=policy))


@pytest.mark.parametrize("policy, expected_victim", [
    (ScorePolicy.LRU, 2),    # last used: 1 at step 4, 2 at step 2, 3 at step 3, 4 at step 4
    (ScorePolicy.LFU, 3),    # uses: 1 four times, 2 twice, 3 once, 4 twice (with step 5)
    (ScorePolicy.STEP, 1),   # inserted at steps 1, 2, 3, 4: hits do not matter
])
def test_eviction_order_per_score_strategy(policy, expected_victim):
    ec = _one_bucket(policy)
    train_step(ec, [1])            # step 1
    train_step(ec, [2, 2, 1])      # step 2
    train_step(ec, [3, 1])         # step 3
    train_step(ec, [4, 1])         # step 4: the bucket of 4 is now full
    if policy is ScorePolicy.LFU:  # make 3 strictly less frequent than 4
        train_step(ec, [4])
    train_step(ec, [5])            # evicts one
    present = dict(zip([1, 2, 3, 4, 5], stored(ec, [1, 2, 3, 4, 5])))
    assert present[5] and not present[expected_victim]
    assert sum(present.values()) == 4
    assert ec.stats()["t"]["evictions"] == 1


def test_no_eviction_raises_and_leaves_the_table_unchanged():
    ec = _one_bucket(ScorePolicy.NO_EVICTION)
    train_step(ec, [1, 2, 3, 4])
    before = ec.read_rows("t", torch.tensor([1, 2, 3, 4]))[0].clone()
    with pytest.raises(TableFullError, match="found no slot"):
        ec(kjt([5, 1]))
    assert stored(ec, [1, 2, 3, 4, 5]) == [True] * 4 + [False]
    torch.testing.assert_close(ec.read_rows("t", torch.tensor([1, 2, 3, 4]))[0], before)
    assert ec.tables["t"].tier.hash.pinned_count() == 0
    train_step(ec, [1])  # still usable


# -- eval mode -------------------------------------------------------------------------------
@pytest.mark.parametrize("caching", [False, True])
def test_eval_inserts_nothing_and_uses_the_eval_initializer(caching):
    opts = DynamicEmbTableOptions(initializer=INIT, caching=caching,
                                  local_hbm_for_values=None if not caching else 16 * DIM * 4,
                                  bucket_size=16, eval_initializer=Initializer(
                                      InitializerKind.CONSTANT, value=0.25))
    ec = make(opts)
    for start in range(0, 64, 8):  # with caching, most of these end up in the store only
        train_step(ec, list(range(start, start + 8)))
    trained, _ = ec.read_rows("t", torch.arange(64))
    size_before = ec.stats()["t"]["rows_device"]
    ec.eval()
    out = ec(kjt([3, 1000, 60]))["f"].values()
    assert not out.requires_grad
    torch.testing.assert_close(out[0], trained[3])
    torch.testing.assert_close(out[1], torch.full((DIM,), 0.25))
    torch.testing.assert_close(out[2], trained[60])
    assert stored(ec, [1000]) == [False]
    assert ec.stats()["t"]["rows_device"] == size_before
    assert ec.tables["t"].tier.hash.pinned_count() == 0


# -- prefetch queue --------------------------------------------------------------------------
def test_forward_consumes_prefetches_oldest_first():
    ec = make()
    a, b = kjt([1, 2]), kjt([3, 4, 5])
    state_a = ec.prefetch(a)
    ec.prefetch(b)
    assert ec.pending_prefetches == 2 and state_a.storage_modes == {"t": StorageMode.HBM_DIRECT}
    assert ec.tables["t"].tier.hash.pinned_count() == 5
    with pytest.raises(ValueError, match="order of prefetch"):
        ec(b)  # a is the oldest: refused, the queue is left as it was
    assert ec.pending_prefetches == 2 and ec.tables["t"].tier.hash.pinned_count() == 5
    ec(a)["f"].values().sum().backward()
    out = ec(b)["f"].values()
    assert out.shape == (3, DIM)
    out.sum().backward()
    assert ec.tables["t"].tier.hash.pinned_count() == 0


def test_forward_rejects_other_ids_of_the_same_shape():
    ec = make()
    ec.prefetch(kjt([1, 2]))
    with pytest.raises(ValueError, match="order of prefetch.*nothing changed"):
        ec(kjt([3, 4]))
    assert stored(ec, [3, 4]) == [False, False]
    ec.clear_prefetched()
    assert ec.pending_prefetches == 0 and ec.tables["t"].tier.hash.pinned_count() == 0


@pytest.mark.parametrize("mismatch", ["ids", "lengths", "features"])
def test_a_refused_forward_changes_nothing_and_the_retry_counts_once(mismatch):
    """prefetch(a), forward(b) refused, forward(a): the same counters, LFU scores and rows as
    prefetch(a), forward(a) on a twin module."""
    options = DynamicEmbTableOptions(initializer=INIT, score_strategy=ScorePolicy.LFU)
    refused, twin = make(options, features=("f", "g")), make(options, features=("f", "g"))
    a = kjt([1, 2, 2], features=("f", "g"), lengths=[2, 1])
    b = {"ids": kjt([1, 3, 2], features=("f", "g"), lengths=[2, 1]),
         "lengths": kjt([1, 2, 2], features=("f", "g"), lengths=[1, 2]),
         "features": kjt([1, 2, 2], features=("g", "f"), lengths=[2, 1])}[mismatch]
    for ec in refused, twin:
        ec.prefetch(a)
    before = refused.stats()["t"]
    with pytest.raises(ValueError, match="order of prefetch"):
        refused(b)
    assert refused.stats()["t"] == before and refused.pending_prefetches == 1
    for ec in refused, twin:
        out = ec(a)
        (out["f"].values().sum() + out["g"].values().sum()).backward()
    assert refused.stats()["t"] == twin.stats()["t"]
    assert refused.stats()["t"]["lookups"] == 3
    keys = torch.tensor([1, 2, 3])
    for got, want in zip(refused.read_rows("t", keys), twin.read_rows("t", keys)):
        assert torch.equal(got, want)
    hash_table = refused.tables["t"].tier.hash
    slots = hash_table.find(keys[:2])
    assert hash_table.scores_at(slots).tolist() == [1, 2]  # LFU: one count per occurrence


def test_eval_forward_leaves_a_queued_training_batch_alone():
    ec = make()
    train_batch = kjt([1, 2])
    ec.prefetch(train_batch)
    ec.eval()
    assert ec(kjt([7]))["f"].values().shape == (1, DIM)
    ec.train()
    assert ec.pending_prefetches == 1
    ec(train_batch)["f"].values().sum().backward()
    assert stored(ec, [1, 2, 7]) == [True, True, False]


def test_forward_without_grad_releases_pins_and_inserts_nothing():
    ec = make()
    with torch.no_grad():
        ec(kjt([1, 2, 3]))
    assert ec.tables["t"].tier.hash.pinned_count() == 0
    assert stored(ec, [1, 2, 3]) == [False] * 3


def test_clear_prefetched_drops_pins():
    ec = make()
    ec.prefetch(kjt([1, 2]))
    ec.clear_prefetched()
    assert ec.pending_prefetches == 0 and ec.tables["t"].tier.hash.pinned_count() == 0


# -- layouts of the input --------------------------------------------------------------------
def test_shared_table_gives_one_row_per_id_across_features():
    ec = make(features=("a", "b"))
    out = train_step(ec, [7, 8, 7], features=("a", "b"), lengths=[2, 1])
    torch.testing.assert_close(out["a"].values()[0], out["b"].values()[0])
    rows, _ = ec.read_rows("t", torch.tensor([7, 8]))
    expected = init_rows([7, 8]) - 0.5 * torch.tensor([[2.0], [1.0]])
    torch.testing.assert_close(rows, expected)


def test_empty_batch_and_zero_length_features():
    ec = make(features=("a", "b"))
    empty = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.empty(0, dtype=torch.int64),
                                                torch.zeros(6, dtype=torch.int64))
    out = ec(empty)
    assert out["a"].values().shape == (0, DIM) and out["a"].lengths().tolist() == [0, 0, 0]
    sum(jt.values().sum() for jt in out.values()).backward()
    out = ec(KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.tensor([5, 6]),
                                                 torch.tensor([0, 2, 0, 0])))
    assert out["a"].values().shape == (2, DIM) and out["b"].values().shape == (0, DIM)
    assert out["b"].lengths().tolist() == [0, 0]
    assert out["a"].lengths().tolist() == [0, 2]


def test_output_layout_matches_embedding_collection():
    from torchrec import EmbeddingCollection
    ec = make(features=("a", "b"), need_indices=True)
    ref = EmbeddingCollection(tables=[EmbeddingConfig(name="t", embedding_dim=DIM,
                                                      num_embeddings=10, feature_names=["a", "b"])],
                              need_indices=True)
    batch = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.tensor([1, 2, 3, 4]),
                                                torch.tensor([1, 1, 2, 0]))
    out, want = ec(batch), ref(batch)
    assert list(out) == list(want)
    for f in want:
        assert out[f].values().shape == want[f].values().shape
        assert out[f].values().dtype == want[f].values().dtype
        assert torch.equal(out[f].lengths(), want[f].lengths())
        assert torch.equal(out[f].weights(), want[f].weights())


# -- counters ----------------------------------------------------------------------------------
def test_counters_hand_computed():
    ec = make()
    train_step(ec, [1, 2, 2])
    train_step(ec, [2, 3])
    s = ec.stats()["t"]
    assert (s["lookups"], s["unique_keys"], s["hits"], s["misses"], s["inserts"]) == (5, 4, 1, 3, 3)
    assert s["rows_device"] == 3 and s["evictions"] == 0
    assert s["storage_mode"] == "hbm_direct" and 0 < s["load_factor"] < 0.01


# -- bad input: clear error, nothing changed ---------------------------------------------------
def _snapshot(ec):
    return ec.stats()["t"], ec.read_rows("t", torch.arange(10))


#: KJTs that no setting makes acceptable: checked even with validate_inputs=False
MALFORMED = {
    "meta_ids": (lambda: kjt([1, 2]).to(torch.device("meta")), ValueError,
                 r"ids are on meta but the tables are on cpu"),
    "duplicated_feature": (lambda: KeyedJaggedTensor.from_lengths_sync(
        ["f", "f"], torch.tensor([1, 2, 5]), torch.tensor([1, 1, 1, 0])), ValueError,
        r"feature 'f' appears 2 times in the KJT's keys \['f', 'f'\]; each feature must appear"),
}


@pytest.mark.parametrize("bad, error, match", [
    (lambda: KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([1.0, 2.0]),
                                                 torch.tensor([2])), TypeError, "int64"),
    (lambda: KeyedJaggedTensor(["f"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1])),
     ValueError, "add up to 2"),
    (lambda: kjt([1, -2**63]), ValueError, "reserved"),
    (lambda: KeyedJaggedTensor(["f", "g"], torch.tensor([1, 2, 3]),
                               lengths=torch.tensor([1, 1, 1, 0]),
                               stride_per_key_per_rank=[[2], [1]]), ValueError,
     r"lengths has 4 entries, expected one per sample of each feature: 3 \(batch sizes "
     r"\{'f': 2, 'g': 1\}\)"),
    *MALFORMED.values(),
], ids=["float_ids", "lengths", "reserved_id", "variable_batch_lengths", *MALFORMED])
def test_bad_input_is_rejected_before_any_change(bad, error, match):
    _check_rejected_before_any_change(make(features=("f", "g")), bad, error, match)


@pytest.mark.parametrize("bad, error, match", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_input_is_rejected_without_validate_inputs(bad, error, match):
    _check_rejected_before_any_change(make(features=("f", "g"), validate_inputs=False), bad,
                                      error, match)


def _check_rejected_before_any_change(ec, bad, error, match):
    train_step(ec, [1, 2, 3], features=("f", "g"))
    before = _snapshot(ec)
    with pytest.raises(error, match=match):
        ec(bad())
    with pytest.raises(error, match=match):
        ec.prefetch(bad())
    after = _snapshot(ec)
    assert after[0] == before[0]
    torch.testing.assert_close(after[1][0], before[1][0])
    assert ec.pending_prefetches == 0 and ec.tables["t"].tier.hash.pinned_count() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cpu_ids_for_a_cuda_module_are_rejected_before_any_change():
    ec = make(device="cuda", backend="cuda")
    out = ec(kjt(torch.tensor([1, 2], device="cuda")))
    out["f"].values().sum().backward()
    before = ec.stats()["t"]
    with pytest.raises(ValueError, match=r"ids are on cpu but the tables are on cuda"):
        ec(kjt([1, 3]))
    assert ec.stats()["t"] == before


def test_reserved_id_in_a_later_table_leaves_earlier_tables_unchanged():
    tables = [EmbeddingConfig(name=n, embedding_dim=DIM, num_embeddings=64, feature_names=[f])
              for n, f in (("t0", "a"), ("t1", "b"))]
    ec = DynamicEmbCollection(tables)
    batch = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.tensor([5, -2**63 + 1]),
                                                torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="reserved"):
        ec(batch)
    assert ec.stats()["t0"]["rows_device"] == 0


@pytest.mark.parametrize("options, match", [
    (dict(max_capacity=0), "max_capacity"),
    (dict(init_capacity=0), "init_capacity"),
    (dict(local_hbm_for_values=100, caching=True), "below one bucket"),
    (dict(global_hbm_for_values=100), "global_hbm_for_values"),
    (dict(max_load_factor=0.0), "max_load_factor"),
    (dict(bucket_size=3), "bucket_size"),
    (dict(score_strategy="lru"), "score_strategy"),
    (dict(init_capacity=4096, max_capacity=1024), "init_capacity"),
    (dict(admission=lambda: FrequencyAdmission(threshold=0)), "admission.threshold"),
])
def test_unworkable_options_name_the_field(options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make(DynamicEmbTableOptions(**{k: v() if callable(v) else v
                                       for k, v in options.items()}))


def test_unworkable_table_configs():
    zero = EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=8, feature_names=["f"])
    zero.num_embeddings = 0  # TorchRec's own constructor divides by it
    with pytest.raises(ValueError, match="num_embeddings"):
        DynamicEmbCollection([zero])
    with pytest.raises(ValueError, match="unknown tables"):
        make({"other": DynamicEmbTableOptions()})
    tables = [EmbeddingConfig(name=n, embedding_dim=DIM, num_embeddings=8, feature_names=["f"])
              for n in ("a", "b")]
    assert DynamicEmbCollection(tables).embedding_names_by_table() == [["f@a"], ["f@b"]]
    twice = EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=8,
                            feature_names=["f", "g", "f"])
    with pytest.raises(ValueError, match=r"table 't' lists features \['f'\] more than once"):
        DynamicEmbCollection([twice])


# -- the CUDA kernels (simulator without a GPU) give the same training -----------------------
def test_cuda_backend_trains_like_the_cpu_backend():
    from tests.conftest import BACKENDS
    _, cuda_device = BACKENDS[1]
    results = []
    for backend, device in (("cpu", "cpu"), ("cuda", cuda_device)):
        ec = make(DynamicEmbTableOptions(initializer=INIT, max_capacity=64, bucket_size=16,
                                         admission=FrequencyAdmission(threshold=2,
                                                                      counter_capacity=128)),
                  optimizer=OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD, learning_rate=0.1),
                  device=device, backend=backend)
        for ids in ([1, 2, 2, 3], [3, 4, 1], [5, 1, 2, 9, 9]):
            out = ec(kjt(torch.tensor(ids, device=device)))
            (out["f"].values() ** 2).sum().backward()
        results.append((out["f"].values().detach().cpu(),
                        ec.read_rows("t", torch.tensor([1, 2, 3, 4, 5, 9], device=device))))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1][0], results[1][1][0].cpu())
    assert results[0][1][1].tolist() == results[1][1][1].cpu().tolist()


def test_sync_free_path_reports_slot_failures_at_the_next_prefetch():
    from tests.conftest import BACKENDS
    _, device = BACKENDS[1]
    ec = make(DynamicEmbTableOptions(initializer=INIT, max_capacity=4, bucket_size=4,
                                     score_strategy=ScorePolicy.NO_EVICTION),
              device=device, backend="cuda")
    out = ec(kjt(torch.tensor([1, 2, 3, 4, 5], device=device)))  # 5 keys, 4 slots
    values = out["f"].values()
    assert int((values.abs().sum(1) == 0).sum()) == 1  # the unplaced key reads zeros
    values.sum().backward()
    with pytest.raises(TableFullError, match="1 keys of earlier batches found no slot"):
        ec.prefetch(kjt(torch.tensor([1], device=device)))
    ec(kjt(torch.tensor([1], device=device)))  # reported once; the table keeps working
