"""Drop-in: what TorchRec's unsharded ``EmbeddingCollection`` / ``EmbeddingBagCollection``
accept, the dynamic modules accept and answer alike (keys, order, shapes, values, gradients),
from the same initial rows: a feature read by two tables, features of no table, weights on
an unweighted bag collection, variable-batch KJTs, the meta device, ``reset_parameters``."""
import pytest
import torch
from torchrec import (EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection,
                      EmbeddingConfig)
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbBagCollection, DynamicEmbCollection, DynamicEmbTableOptions,
                    Initializer, InitializerKind, OptimizerConfig, OptimizerType)
from dynemb.serving import iter_rows, to_static

NUM_IDS = 50
LR = 0.5
OPTIONS = DynamicEmbTableOptions(
    initializer=Initializer(InitializerKind.UNIFORM, low=-0.1, high=0.1), seed=5)
SGD = OptimizerConfig(OptimizerType.SGD, learning_rate=LR)


def seq_tables():
    """f2 is read by t1 and t2 (TorchRec names its outputs f2@t1 and f2@t2)."""
    return [EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=NUM_IDS,
                            feature_names=["f1", "f2"]),
            EmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=NUM_IDS,
                            feature_names=["f2"])]


def bag_tables():
    return [EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=NUM_IDS,
                               feature_names=["f1", "f2"], pooling=PoolingType.SUM),
            EmbeddingBagConfig(name="t2", embedding_dim=3, num_embeddings=NUM_IDS,
                               feature_names=["f2"], pooling=PoolingType.MEAN)]


def twin_of(dyn, reference):
    """``reference`` (TorchRec's module) with every row set to what ``dyn`` gives its id."""
    weights = (reference.embeddings if isinstance(reference, EmbeddingCollection)
               else reference.embedding_bags)
    ids = torch.arange(NUM_IDS)
    with torch.no_grad():
        for name, table in dyn.tables.items():
            weights[name].weight.copy_(table.options.initializer.rows(
                ids, table.dim, seed=table.options.seed, table_id=table.table_id))
    return reference


def seq_pair(**kwargs):
    dyn = DynamicEmbCollection(seq_tables(), table_options=OPTIONS, optimizer=SGD, **kwargs)
    return dyn, twin_of(dyn, EmbeddingCollection(seq_tables(), **kwargs))


def bag_pair(is_weighted=False):
    dyn = DynamicEmbBagCollection(bag_tables(), is_weighted=is_weighted,
                                  table_options=OPTIONS, optimizer=SGD)
    return dyn, twin_of(dyn, EmbeddingBagCollection(bag_tables(), is_weighted=is_weighted))


def kjt(features, ids, lengths, weights=None):
    return KeyedJaggedTensor.from_lengths_sync(
        features, torch.tensor(ids), torch.tensor(lengths),
        None if weights is None else torch.tensor(weights))


#: f3 is read by no table, the features are not in config order, and the KJT has weights
MIXED = kjt(["f3", "f2", "f1"], [49, 1, 2, 2, 3, 4, 7], [1, 0, 2, 1, 1, 2],
            [9.0, 0.5, 1.5, 2.0, 1.0, 3.0, 0.25])


def assert_same_sequence_outputs(out, expected):
    assert list(out) == list(expected)  # names and order (config order, table by table)
    for name, jt in expected.items():
        torch.testing.assert_close(out[name].values(), jt.values())
        assert torch.equal(out[name].lengths(), jt.lengths())
        if jt.weights_or_none() is None:
            assert out[name].weights_or_none() is None
        else:
            assert torch.equal(out[name].weights(), jt.weights())


def assert_sgd_step_matches(dyn, reference, loss_of):
    """One backward of ``loss_of(outputs)`` in both: dynemb's fused SGD against TorchRec's
    gradient applied by hand."""
    loss_of(dyn(MIXED)).backward()
    loss_of(reference(MIXED)).backward()
    weights = (reference.embeddings if isinstance(reference, EmbeddingCollection)
               else reference.embedding_bags)
    ids = torch.arange(NUM_IDS)
    for name in dyn.tables:
        param = weights[name].weight
        expected = (param - LR * param.grad).detach()
        rows, found = dyn.read_rows(name, ids)
        assert found.any()
        torch.testing.assert_close(rows[found], expected[found])
        assert not param.grad[~found].any()  # every id TorchRec trained is in the table


def test_a_feature_read_by_two_tables_answers_like_embedding_collection():
    dyn, reference = seq_pair(need_indices=True)
    assert dyn.embedding_names_by_table() == reference.embedding_names_by_table() == [
        ["f1", "f2@t1"], ["f2@t2"]]
    assert_same_sequence_outputs(dyn(MIXED), reference(MIXED))

    def loss(out):
        return sum((jt.values() * (i + 1)).pow(2).sum() for i, jt in enumerate(out.values()))
    assert_sgd_step_matches(dyn, reference, loss)


def test_a_feature_read_by_two_tables_answers_like_embedding_bag_collection():
    dyn, reference = bag_pair()
    out, expected = dyn(MIXED), reference(MIXED)
    assert out.keys() == expected.keys() == ["f1", "f2@t1", "f2@t2"]
    assert out.length_per_key() == expected.length_per_key() == [4, 4, 3]
    torch.testing.assert_close(out.values(), expected.values())

    def loss(out):
        values = out.values()
        return (values * torch.arange(values.shape[1])).pow(2).sum()
    assert_sgd_step_matches(dyn, reference, loss)


def test_features_of_no_table_are_ignored_and_not_counted():
    dyn, reference = seq_pair()
    assert_same_sequence_outputs(dyn(MIXED), reference(MIXED))
    # f3's id 49 was neither looked up nor inserted
    assert dyn.stats()["t1"]["lookups"] == 6 and dyn.stats()["t2"]["lookups"] == 3
    assert not dyn.read_rows("t1", torch.tensor([49]))[1].any()
    bags, bag_reference = bag_pair()
    torch.testing.assert_close(bags(MIXED).values(), bag_reference(MIXED).values())


@pytest.mark.parametrize("pooled", [False, True])
def test_a_kjt_lacking_a_feature_raises_key_error_like_torchrec_and_changes_nothing(pooled):
    """TorchRec's collections raise ``KeyError`` for a feature they read that the KJT lacks;
    so do the dynamic ones, before any table changes, in forward and in prefetch."""
    dyn, reference = bag_pair() if pooled else seq_pair()
    lacking = kjt(["f2", "f3"], [1, 2, 3], [1, 1, 0, 0, 1, 0])  # f1 (read by t1) is absent
    with pytest.raises(KeyError):
        reference(lacking)
    for call in (dyn, dyn.prefetch):
        with pytest.raises(KeyError, match=r"features \['f1'\] of this collection are not in "
                                           r"the KJT \(its features: \['f2', 'f3'\]\)"):
            call(lacking)
    with torch.no_grad():
        with pytest.raises(KeyError):
            dyn(lacking)
    assert all(s["lookups"] == 0 and s["inserts"] == 0 for s in dyn.stats().values())
    assert dyn.pending_prefetches == 0
    if not pooled:  # on the meta device too, as TorchRec's
        meta_configs = seq_tables()
        with pytest.raises(KeyError):
            EmbeddingCollection(meta_configs, device=torch.device("meta"))(lacking)
        with pytest.raises(KeyError, match=r"features \['f1'\]"):
            DynamicEmbCollection(meta_configs, device=torch.device("meta"))(lacking)


def test_an_unweighted_bag_collection_ignores_the_kjts_weights():
    dyn, reference = bag_pair(is_weighted=False)
    torch.testing.assert_close(dyn(MIXED).values(), reference(MIXED).values())
    unweighted = kjt(MIXED.keys(), MIXED.values().tolist(), MIXED.lengths().tolist())
    torch.testing.assert_close(dyn(MIXED).values(), dyn(unweighted).values())


def test_a_weighted_bag_collection_still_needs_weights():
    weighted = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=NUM_IDS,
                                   feature_names=["f1"])]
    dyn = DynamicEmbBagCollection(weighted, is_weighted=True, table_options=OPTIONS)
    with pytest.raises(ValueError, match="has no weights"):
        dyn(kjt(["f1"], [1], [1]))
    assert dyn.stats()["t"]["lookups"] == 0


def test_outputs_follow_the_config_order_whatever_the_kjt_order():
    dyn, reference = seq_pair()
    reordered = kjt(["f2", "f1"], [1, 2, 3], [1, 1, 1, 0])
    assert list(dyn(reordered)) == list(reference(reordered)) == ["f1", "f2@t1", "f2@t2"]


#: f1 has 3 samples, f2 one (a variable-batch KJT)
VARIABLE = KeyedJaggedTensor(["f1", "f2"], torch.tensor([1, 2, 3, 4, 5]),
                             lengths=torch.tensor([2, 0, 1, 2]),
                             stride_per_key_per_rank=[[3], [1]])


def test_a_variable_batch_kjt_answers_like_embedding_collection():
    dyn, reference = seq_pair(need_indices=True)
    out = dyn(VARIABLE)
    assert_same_sequence_outputs(out, reference(VARIABLE))
    assert out["f1"].lengths().tolist() == [2, 0, 1] and out["f2@t2"].lengths().tolist() == [2]

    def loss(out):
        return sum(jt.values().pow(2).sum() for jt in out.values())
    loss(out).backward()
    loss(reference(VARIABLE)).backward()
    param = reference.embeddings["t2"].weight
    rows, found = dyn.read_rows("t2", torch.tensor([4, 5]))
    assert found.all()
    torch.testing.assert_close(rows, (param - LR * param.grad).detach()[[4, 5]])


def test_a_variable_batch_kjt_is_refused_by_the_bag_collection_naming_why():
    dyn, _ = bag_pair()
    with pytest.raises(ValueError, match="different batch size per feature"):
        dyn(VARIABLE)
    assert all(s["lookups"] == 0 for s in dyn.stats().values())


def test_on_the_meta_device_outputs_have_torchrecs_names_shapes_and_device():
    meta = torch.device("meta")
    dyn = DynamicEmbCollection(seq_tables(), device=meta)
    reference = EmbeddingCollection(seq_tables(), device=meta)
    assert dyn.device == reference.device == meta
    for batch in MIXED, MIXED.to(meta):
        out, expected = dyn(batch), reference(batch)
        assert list(out) == list(expected)
        for name, jt in expected.items():
            assert out[name].values().device == meta
            assert out[name].values().shape == jt.values().shape
            assert torch.equal(out[name].lengths(), jt.lengths())
    bags = DynamicEmbBagCollection(bag_tables(), device=meta)
    bag_reference = EmbeddingBagCollection(bag_tables(), device=meta)
    assert bags.device == bag_reference.device == meta
    out, expected = bags(MIXED), bag_reference(MIXED)
    assert out.keys() == expected.keys() and out.length_per_key() == expected.length_per_key()
    assert out.values().device == meta and out.values().shape == expected.values().shape


def test_forward_takes_torchrecs_keyword_features():
    dyn, reference = seq_pair(need_indices=True)
    assert_same_sequence_outputs(dyn(features=MIXED), reference(features=MIXED))
    bags, bag_reference = bag_pair()
    torch.testing.assert_close(bags(features=MIXED).values(),
                               bag_reference(features=MIXED).values())


def weights_of(module):
    tables = (module.embeddings if isinstance(module, (EmbeddingCollection,
                                                       DynamicEmbCollection))
              else module.embedding_bags)
    return {name: table.weight for name, table in tables.items()}


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_each_tables_view_tells_its_device_dtype_and_shape_as_torchrecs_weight(device):
    seq = seq_tables()
    seq[1].data_type = DataType.FP16
    bags = bag_tables()
    pairs = [(DynamicEmbCollection(seq, device=device), EmbeddingCollection(seq, device=device)),
             (DynamicEmbBagCollection(bags, device=device),
              EmbeddingBagCollection(bags, device=device))]
    for dyn, reference in pairs:
        got, expected = weights_of(dyn), weights_of(reference)
        assert list(got) == list(expected) == ["t1", "t2"]
        for name, weight in expected.items():
            assert got[name].device == weight.device == torch.device(device)
            assert got[name].dtype == weight.dtype
            assert got[name].shape == weight.shape and got[name].size(1) == weight.size(1)
    weight = weights_of(pairs[0][0])["t1"]
    with pytest.raises(AttributeError, match="no 'data'.*read_rows"):
        weight.data
    with pytest.raises(TypeError, match="cannot be indexed.*read_rows"):
        weight[0]
    with pytest.raises(TypeError, match="cannot take the weight.*read_rows"):
        torch.nn.init.uniform_(weight)
    with pytest.raises(KeyError, match="no table 'x'"):
        pairs[0][0].embeddings["x"]


def test_a_module_built_inside_a_meta_device_block_is_on_meta_as_torchrecs():
    with torch.device("meta"):
        dyn, bags = DynamicEmbCollection(seq_tables()), DynamicEmbBagCollection(bag_tables())
        reference = EmbeddingBagCollection(bag_tables())
        on_cpu = DynamicEmbCollection(seq_tables(), table_options=OPTIONS, device="cpu")
    meta = torch.device("meta")
    assert dyn.device == bags.device == reference.device == meta
    assert weights_of(dyn)["t1"].device == weights_of(bags)["t1"].device == meta
    assert all(jt.values().device == meta for jt in dyn(MIXED).values())
    assert bags(MIXED).values().device == meta
    # what needs rows says why there are none
    for lookup in (lambda: dyn.read_rows("t1", torch.tensor([1])), lambda: dyn.prefetch(MIXED),
                   lambda: list(iter_rows(bags, "t1")), lambda: to_static(dyn)):
        with pytest.raises(RuntimeError, match="meta device.*DistributedModelParallel.*to_empty"):
            lookup()
    with pytest.raises(RuntimeError, match="cannot be moved.*shard it with Distributed.*"
                                           r"to_empty\(device=...\)"):
        dyn.to("cpu")  # as TorchRec's: a meta module cannot be copied out of meta
    # a module given a real device inside the block is built there, as one built outside
    outside = DynamicEmbCollection(seq_tables(), table_options=OPTIONS, device="cpu")
    assert on_cpu.device == torch.device("cpu")
    assert_same_sequence_outputs(on_cpu(MIXED), outside(MIXED))


class Holder(torch.nn.Module):
    def __init__(self, embeddings):
        super().__init__()
        self.embeddings = embeddings
        self.dense = torch.nn.Linear(4, 1)


@pytest.mark.parametrize("pooled", [False, True], ids=["sequence", "pooled"])
def test_a_meta_model_materialized_by_to_empty_trains_as_one_built_on_the_device(pooled):
    """TorchRec's way to materialize a meta model: ``to_empty(device=...)``, then
    ``reset_parameters()``; the dynamic module's tables are built there."""
    make = ((lambda: DynamicEmbBagCollection(bag_tables(), table_options=OPTIONS,
                                             optimizer=SGD)) if pooled else
            (lambda: DynamicEmbCollection(seq_tables(), table_options=OPTIONS, optimizer=SGD)))
    with torch.device("meta"):
        model = Holder(make())
    model.embeddings.fused_optimizer.param_groups[0]["lr"] = LR / 2
    optimizer = model.embeddings.fused_optimizer
    assert model.to_empty(device="cpu") is model
    model.embeddings.reset_parameters()
    reference = make()
    reference.fused_optimizer.param_groups[0]["lr"] = LR / 2
    dyn = model.embeddings
    assert dyn.device == model.dense.weight.device == torch.device("cpu")
    assert dyn.fused_optimizer is optimizer  # schedulers set on it keep working
    for _ in range(2):
        out, expected = dyn(MIXED), reference(MIXED)
        if pooled:
            torch.testing.assert_close(out.values(), expected.values(), rtol=0, atol=0)
            out, expected = out.values(), expected.values()
        else:
            assert_same_sequence_outputs(out, expected)
            out, expected = out["f2@t2"].values(), expected["f2@t2"].values()
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
    for name in dyn.tables:
        rows, found = dyn.read_rows(name, torch.arange(NUM_IDS))
        expected_rows, expected_found = reference.read_rows(name, torch.arange(NUM_IDS))
        assert torch.equal(found, expected_found) and found.any()
        torch.testing.assert_close(rows, expected_rows, rtol=0, atol=0)
    assert dyn.stats() == reference.stats()


@pytest.mark.parametrize("pooled", [False, True], ids=["sequence", "pooled"])
def test_reset_parameters_empties_every_table_back_to_its_initial_rows(pooled):
    dyn, _ = bag_pair() if pooled else seq_pair()
    initial = {name: t.options.initializer.rows(torch.arange(NUM_IDS), t.dim,
                                                seed=t.options.seed, table_id=t.table_id)
               for name, t in dyn.tables.items()}
    for _ in range(2):
        out = dyn(MIXED)
        (out.values() if pooled else torch.cat([jt.values() for jt in out.values()])
         ).pow(2).sum().backward()
    pending = dyn(MIXED)  # its backward would update rows that reset_parameters drops
    dyn.prefetch(MIXED)
    dyn.reset_parameters()
    assert dyn.pending_prefetches == 0
    for name, stats in dyn.stats().items():
        assert stats["rows_device"] == 0 and stats["lookups"] == 0
    with pytest.raises(RuntimeError, match="Run a new forward"):
        (pending.values() if pooled else pending["f1"].values()).sum().backward()
    dyn(MIXED)  # new rows start from the initializer again
    for name, rows in initial.items():
        got, found = dyn.read_rows(name, torch.arange(NUM_IDS))
        assert found.any()
        torch.testing.assert_close(got[found], rows[found])
