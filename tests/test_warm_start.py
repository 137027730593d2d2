"""``warm_start``: dynamic tables built from TorchRec's own modules. The round trip TorchRec
module -> dynemb -> ``to_static`` gives back the same rows; a warm-started module answers as
the TorchRec module does for the ids its rows were given, pooled or not, from the module or
its ``state_dict``; from a (one-rank) sharded TorchRec module trained by fbgemm's fused
optimizer it takes the rows and the optimizer state, then trains on exactly as TorchRec
does (tests/torchrec_twin.py); bad input raises and writes nothing."""
from __future__ import annotations

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbBagCollection, DynamicEmbCollection, DynamicEmbTableOptions,
                    OptimizerConfig, OptimizerType, warm_start)
from dynemb.serving import to_static
from tests.torchrec_twin import TorchRecTwin, same_batches

TABLES = [EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=50, feature_names=["fa"]),
          EmbeddingConfig(name="b", embedding_dim=4, num_embeddings=30, feature_names=["fb"])]
BAGS = [EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=50, feature_names=["fa"]),
        EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=30, feature_names=["fb"])]
SGD = OptimizerConfig(OptimizerType.SGD, learning_rate=0.1)


def static_ec():
    torch.manual_seed(0)
    return EmbeddingCollection(tables=TABLES)


def test_torchrec_to_dynemb_to_static_gives_back_the_same_rows():
    source = static_ec()
    dyn = DynamicEmbCollection(TABLES, optimizer=SGD)
    assert warm_start(dyn, source) == {"a": 50, "b": 30}
    exported = to_static(dyn).ec
    for config in TABLES:
        want = source.embeddings[config.name].weight.detach()
        got = exported.embeddings[config.name].weight.detach()
        assert got.shape[0] == config.num_embeddings + 1  # the rows, then the default row
        assert torch.equal(got[:-1], want)
    stats = dyn.stats()["a"]
    assert (stats["write_inserts"], stats["write_overwrites"]) == (50, 0)


def _kjt(features, ids_by_feature, lengths_by_feature):
    return KeyedJaggedTensor.from_lengths_sync(
        features, torch.cat([ids_by_feature[f] for f in features]),
        torch.cat([lengths_by_feature[f] for f in features]))


def test_a_model_holding_one_dynamic_module_is_warm_started_through_it():
    model = torch.nn.ModuleDict({"sparse": DynamicEmbCollection(TABLES, optimizer=SGD),
                                 "dense": torch.nn.Linear(4, 1)})
    assert warm_start(model, static_ec()) == {"a": 50, "b": 30}
    two = torch.nn.ModuleDict({"x": DynamicEmbCollection(TABLES, optimizer=SGD),
                               "y": DynamicEmbCollection(TABLES, optimizer=SGD)})
    with pytest.raises(TypeError, match=r"ModuleDict holds 2: \['x', 'y'\], pass one"):
        warm_start(two, static_ec())


def test_a_mapping_of_ids_answers_as_the_torchrec_module_for_those_ids():
    source = static_ec()
    gen = torch.Generator().manual_seed(1)
    ids = {"a": torch.randperm(1 << 20, generator=gen)[:50] * 1000 + 7}  # "b": row i is id i
    dyn = DynamicEmbCollection(TABLES, optimizer=SGD)
    warm_start(dyn, source.state_dict(), ids=ids)
    rows = {"fa": torch.randint(0, 50, (12,), generator=gen),
            "fb": torch.randint(0, 30, (12,), generator=gen)}
    lengths = {f: torch.tensor([3, 0, 5, 4]) for f in rows}
    want = source(_kjt(["fa", "fb"], rows, lengths))
    got = dyn.eval()(_kjt(["fa", "fb"], {"fa": ids["a"][rows["fa"]], "fb": rows["fb"]},
                          lengths))
    for f in ("fa", "fb"):
        assert torch.equal(got[f].values(), want[f].values().detach())
        assert torch.equal(got[f].lengths(), want[f].lengths())


def test_a_bag_collection_pools_as_the_torchrec_one():
    torch.manual_seed(2)
    source = EmbeddingBagCollection(tables=BAGS)
    dyn = DynamicEmbBagCollection(BAGS, optimizer=SGD)
    warm_start(dyn, source)
    gen = torch.Generator().manual_seed(3)
    rows = {"fa": torch.randint(0, 50, (9,), generator=gen),
            "fb": torch.randint(0, 30, (9,), generator=gen)}
    lengths = {f: torch.tensor([2, 0, 3, 4]) for f in rows}
    kjt = _kjt(["fa", "fb"], rows, lengths)
    want, got = source(kjt), dyn.eval()(kjt)
    for f in ("fa", "fb"):
        torch.testing.assert_close(got[f], want[f].detach(), rtol=0, atol=1e-6)
    exported = to_static(dyn).ebc  # and back: the same rows
    for config in BAGS:
        assert torch.equal(exported.embedding_bags[config.name].weight.detach()[:-1],
                           source.embedding_bags[config.name].weight.detach())


@pytest.mark.parametrize("case,match", [
    ("twice", "ids must be distinct, id 5 is given to 2 rows"),
    ("length", r"ids must be an int64 tensor of shape \[50\]"),
    ("unknown", r"the source has tables \['extra'\] that the module lacks"),
    ("dim", "the dynamic table's dim is 4"),
    ("ids_of_nothing", r"ids given for tables \['zz'\]"),
    ("table_twice", "the source holds table 'a' twice"),
])
def test_bad_input_raises_naming_it_and_writes_nothing(case, match):
    source = static_ec().state_dict()
    ids = None
    if case == "twice":
        ids = {"a": torch.arange(50)}
        ids["a"][7] = 5
    elif case == "length":
        ids = {"a": torch.arange(49)}
    elif case == "unknown":
        source["embeddings.extra.weight"] = torch.zeros(3, 4)
    elif case == "dim":
        source["embeddings.a.weight"] = torch.zeros(50, 5)
        match = "the dynamic table's dim is 4"
    elif case == "table_twice":  # two modules' state in one dict
        source = {**source, **{f"other.{k}": v for k, v in source.items()}}
    else:
        ids = {"zz": torch.arange(3)}
    dyn = DynamicEmbCollection(TABLES, optimizer=SGD)
    with pytest.raises(ValueError, match=match):
        warm_start(dyn, source, ids=ids)
    assert all(t.stats()["rows_device"] == 0 for t in dyn.tables.values())


def test_optimizer_state_that_does_not_map_is_refused():
    dyn = DynamicEmbCollection(TABLES, optimizer=SGD)
    fused = {"state": {"ec.embeddings.a.weight": {"a.momentum1": torch.zeros(50)}}}
    with pytest.raises(ValueError, match="trains with SGD, which keeps none"):
        warm_start(dyn, static_ec(), optimizer_state=fused)
    adam = DynamicEmbCollection(TABLES, optimizer=OptimizerConfig(OptimizerType.ADAM))
    with pytest.raises(ValueError, match="does not map to ADAM"):
        warm_start(adam, static_ec(), optimizer_state=fused)
    rowwise = DynamicEmbCollection(TABLES, optimizer=OptimizerConfig(
        OptimizerType.ROWWISE_ADAGRAD))
    bad = {"state": {"ec.embeddings.a.weight": {"a.momentum1": torch.zeros(50, 4)}}}
    with pytest.raises(ValueError, match=r"must hold \[50\] values"):
        warm_start(rowwise, static_ec(), optimizer_state=bad)
    for module in (dyn, adam, rowwise):
        assert all(t.stats()["rows_device"] == 0 for t in module.tables.values())


FEATURES = ["fa", "fb"]
STEPS_BEFORE, STEPS_AFTER = 3, 4


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adagrad"])
def test_a_module_warm_started_from_trained_torchrec_trains_on_as_torchrec(kind):
    fbgemm, ours = {"sgd": (EmbOptimType.EXACT_SGD, OptimizerType.SGD),
                    "rowwise_adagrad": (EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                        OptimizerType.ROWWISE_ADAGRAD),
                    "adagrad": (EmbOptimType.EXACT_ADAGRAD, OptimizerType.ADAGRAD)}[kind]
    gen = torch.Generator().manual_seed(4)
    initial = {c.name: torch.rand(c.num_embeddings, c.embedding_dim, generator=gen) - 0.5
               for c in TABLES}
    twin = TorchRecTwin(TABLES, initial, dict(optimizer=fbgemm, learning_rate=0.1, eps=1e-8))
    batches = same_batches(STEPS_BEFORE + STEPS_AFTER, FEATURES, 30, 4, seed=5)

    def loss(out):
        return sum(((jt.values() - 0.3) ** 2).sum() for jt in out.values())
    for lengths, values in batches[:STEPS_BEFORE]:  # TorchRec trains first
        loss(twin(KeyedJaggedTensor.from_lengths_sync(FEATURES, values, lengths))).backward()
    dyn = DynamicEmbCollection(TABLES, optimizer=OptimizerConfig(ours, learning_rate=0.1,
                                                                 eps=1e-8),
                               table_options=DynamicEmbTableOptions(bucket_size=16))
    warm_start(dyn, twin.dmp)  # the rows, and the fused optimizer's momentum
    weights = twin.weights()
    momentum = {key.split(".")[0]: value.local_shards()[0].tensor
                for per_param in twin.dmp.fused_optimizer.state_dict()["state"].values()
                for key, value in per_param.items()}
    for name, rows in weights.items():
        got = dyn.read_rows(name, torch.arange(rows.shape[0]), with_state=True)[0]
        assert torch.equal(got[:, :rows.shape[1]], rows)
        if kind != "sgd":
            want = momentum[name]
            assert torch.equal(got[:, rows.shape[1]:], want[:, None] if want.dim() == 1
                               else want)
    for lengths, values in batches[STEPS_BEFORE:]:  # then both, on the same batches
        kjt = KeyedJaggedTensor.from_lengths_sync(FEATURES, values, lengths)
        want, got = twin(kjt), dyn(kjt)
        for f in FEATURES:
            torch.testing.assert_close(got[f].values(), want[f].values(), rtol=1e-5,
                                       atol=1e-6)
        loss(want).backward()
        loss(got).backward()
    for name, rows in twin.weights().items():
        got = dyn.read_rows(name, torch.arange(rows.shape[0]))[0]
        torch.testing.assert_close(got, rows, rtol=1e-5, atol=1e-6)
