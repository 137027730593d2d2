"""Models holding dynamic collections under ``torch.fx`` tracing and ``torch.jit.script``.

Traced models are checked against the same model run eagerly and against TorchRec's own
``EmbeddingCollection`` / ``EmbeddingBagCollection`` (started from the same rows, trained by
plain SGD) traced the same way: the forward outputs and the rows after training must agree.
"""
import io

import pytest
import torch
import torch.fx
import torchrec.fx
from torchrec import (EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection,
                      EmbeddingConfig, PoolingType)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbBagCollection, DynamicEmbCollection, DynamicEmbTableOptions,
                    Initializer, InitializerKind, OptimizerConfig, OptimizerType)
from dynemb.serving import to_static

NUM_IDS = 40
DIM = 4
LR = 0.1
FEATURES = ["f", "g"]
TRACERS = {"torchrec": torchrec.fx.symbolic_trace, "torch": torch.fx.symbolic_trace}


def _linear(width: int) -> torch.nn.Linear:
    """A linear layer with fixed weights, so two models built alike start alike."""
    layer = torch.nn.Linear(width, 1)
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(-1.0, 1.0, width))
        layer.bias.fill_(0.25)
    return layer


class SequenceModel(torch.nn.Module):
    """Embeddings per feature, then a linear layer and a loss over every id."""

    def __init__(self, ec: torch.nn.Module):
        super().__init__()
        self.ec = ec
        self.dense = _linear(DIM)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        out = self.ec(kjt)
        return (self.dense(out["f"].values()) ** 2).sum() + self.dense(out["g"].values()).sum()


class PooledModel(torch.nn.Module):
    """Pooled bags of both features, then a linear layer and a loss per sample."""

    def __init__(self, ebc: torch.nn.Module):
        super().__init__()
        self.ebc = ebc
        self.dense = _linear(2 * DIM)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return (self.dense(self.ebc(kjt).values()) ** 2).sum()


def _dynamic(pooled: bool) -> torch.nn.Module:
    options = DynamicEmbTableOptions(
        initializer=Initializer(InitializerKind.UNIFORM, low=-0.5, high=0.5), seed=5)
    optimizer = OptimizerConfig(OptimizerType.SGD, learning_rate=LR)
    if pooled:
        configs = [EmbeddingBagConfig(name="t", embedding_dim=DIM, num_embeddings=NUM_IDS,
                                      feature_names=FEATURES, pooling=PoolingType.SUM)]
        return PooledModel(DynamicEmbBagCollection(configs, table_options=options,
                                                   optimizer=optimizer))
    configs = [EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=NUM_IDS,
                               feature_names=FEATURES)]
    return SequenceModel(DynamicEmbCollection(configs, table_options=options,
                                              optimizer=optimizer))


def _collection(model: torch.nn.Module):
    return model.ebc if isinstance(model, PooledModel) else model.ec


def _torchrec_twin(model: torch.nn.Module) -> torch.nn.Module:
    """TorchRec's module over the ids 0..NUM_IDS-1, starting from the rows ``model``'s
    dynamic table gives them, with the same dense layer."""
    dynamic = _collection(model)
    table = dynamic.tables["t"]
    rows = table.options.initializer.rows(torch.arange(NUM_IDS), DIM, seed=table.options.seed,
                                          table_id=table.table_id)
    if isinstance(model, PooledModel):
        twin = PooledModel(EmbeddingBagCollection(dynamic.embedding_bag_configs()))
        weight = twin.ebc.embedding_bags["t"].weight
    else:
        twin = SequenceModel(EmbeddingCollection(dynamic.embedding_configs()))
        weight = twin.ec.embeddings["t"].weight
    with torch.no_grad():
        weight.copy_(rows)
    twin.dense.load_state_dict(model.dense.state_dict())
    return twin


def _batches(steps: int):
    g = torch.Generator().manual_seed(11)
    for _ in range(steps):
        lengths = torch.randint(0, 4, (2 * 3,), generator=g)
        values = torch.randint(0, NUM_IDS, (int(lengths.sum()),), generator=g)
        yield KeyedJaggedTensor.from_lengths_sync(FEATURES, values, lengths)


def _train(model: torch.nn.Module, steps: int):
    """Losses of ``steps`` SGD steps (dense layer by torch.optim.SGD, embeddings by the
    collection's fused optimizer or, for TorchRec's modules, by the same SGD)."""
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for kjt in _batches(steps):
        sgd.zero_grad()
        loss = model(kjt)
        loss.backward()
        sgd.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def _rows(model: torch.nn.Module) -> torch.Tensor:
    """Rows of ids 0..NUM_IDS-1 of ``model``'s table (ids never looked up: their initial row)."""
    collection = model.ebc if hasattr(model, "ebc") else model.ec
    if isinstance(collection, EmbeddingBagCollection):
        return collection.embedding_bags["t"].weight.detach()
    if isinstance(collection, EmbeddingCollection):
        return collection.embeddings["t"].weight.detach()
    rows, found = collection.read_rows("t", torch.arange(NUM_IDS))
    return torch.where(found.unsqueeze(1), rows, _initial(collection))


def _initial(dynamic) -> torch.Tensor:
    table = dynamic.tables["t"]
    return table.options.initializer.rows(torch.arange(NUM_IDS), DIM, seed=table.options.seed,
                                          table_id=table.table_id)


@pytest.mark.parametrize("pooled", [False, True], ids=["sequence", "pooled"])
@pytest.mark.parametrize("tracer", sorted(TRACERS))
def test_trace_records_the_collection_as_one_call_module_node(tracer, pooled):
    model = _dynamic(pooled)
    traced = TRACERS[tracer](model)
    name = "ebc" if pooled else "ec"
    calls = [n.target for n in traced.graph.nodes if n.op == "call_module"]
    assert calls == [name] + ["dense"] * (1 if pooled else 2)
    assert getattr(traced, name) is _collection(model)  # the graph runs the same tables
    assert _collection(model).stats()["t"]["lookups"] == 0  # tracing looked nothing up


@pytest.mark.parametrize("pooled", [False, True], ids=["sequence", "pooled"])
@pytest.mark.parametrize("tracer", sorted(TRACERS))
def test_the_collection_traced_alone_calls_itself_and_trains_like_eager(tracer, pooled):
    """Traced as the root (as TorchRec's own tests trace its modules), the collection is the
    GraphModule's child ``collection``: the graph answers and trains as the eager module."""
    traced_model, eager = _dynamic(pooled), _dynamic(pooled)
    collection = _collection(traced_model)
    gm = TRACERS[tracer](collection)
    assert gm.collection is collection
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["collection"]
    assert collection.stats()["t"]["lookups"] == 0  # tracing looked nothing up
    for kjt in _batches(3):
        out, expected = gm(kjt), _collection(eager)(features=kjt)
        if pooled:
            assert out.keys() == expected.keys() == FEATURES
            torch.testing.assert_close(out.values(), expected.values(), rtol=0, atol=0)
            out.values().pow(2).sum().backward()
            expected.values().pow(2).sum().backward()
        else:
            assert list(out) == list(expected) == FEATURES
            for name in FEATURES:
                torch.testing.assert_close(out[name].values(), expected[name].values(),
                                           rtol=0, atol=0)
            sum(jt.values().pow(2).sum() for jt in out.values()).backward()
            sum(jt.values().pow(2).sum() for jt in expected.values()).backward()
    torch.testing.assert_close(_rows(traced_model), _rows(eager), rtol=0, atol=0)
    assert not torch.equal(_rows(eager), _initial(_collection(eager)))  # it did train
    saved = io.BytesIO()  # the GraphModule saves whole, as TorchRec's does
    torch.save(gm, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False).eval()
    with torch.no_grad():
        out, expected = loaded(kjt), gm.eval()(kjt)
    for name in FEATURES:
        torch.testing.assert_close(out[name] if pooled else out[name].values(),
                                   expected[name] if pooled else expected[name].values(),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("pooled", [False, True], ids=["sequence", "pooled"])
def test_traced_model_trains_like_eager_and_like_torchrec(pooled):
    eager = _dynamic(pooled)
    twin = _torchrec_twin(eager)
    reference = torchrec.fx.symbolic_trace(twin)
    traced = torchrec.fx.symbolic_trace(_dynamic(pooled))
    steps = 4
    eager_losses = _train(eager, steps)
    torch.testing.assert_close(_train(traced, steps), eager_losses, rtol=0, atol=0)
    torch.testing.assert_close(_train(reference, steps), eager_losses, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_rows(traced), _rows(eager), rtol=0, atol=0)
    torch.testing.assert_close(_rows(twin), _rows(eager), rtol=1e-5, atol=1e-5)
    assert not torch.equal(_rows(eager), _initial(_collection(eager)))  # it did train
    torch.testing.assert_close(traced.dense.weight, eager.dense.weight, rtol=0, atol=0)


class IteratingModel(SequenceModel):
    """Iterates the collection's output dict, as models over TorchRec's module may."""

    def forward(self, kjt: KeyedJaggedTensor):
        return {name: self.dense(jt.values()) for name, jt in self.ec(kjt).items()}


@pytest.mark.parametrize("tracer", sorted(TRACERS))
def test_a_model_iterating_the_output_dict_traces_and_trains_like_eager_and_torchrec(tracer):
    eager = IteratingModel(_dynamic(pooled=False).ec)
    traced = TRACERS[tracer](IteratingModel(_dynamic(pooled=False).ec))
    twin = IteratingModel(_torchrec_twin(eager).ec)
    reference = TRACERS[tracer](twin)  # trains twin's own weights
    models = [traced, eager, reference]
    sgds = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    for kjt in _batches(3):
        outs = [model(kjt) for model in models]
        assert list(outs[0]) == list(outs[1]) == list(outs[2]) == FEATURES
        for name in FEATURES:
            torch.testing.assert_close(outs[0][name], outs[1][name], rtol=0, atol=0)
            torch.testing.assert_close(outs[2][name], outs[1][name])
        for out, sgd in zip(outs, sgds):
            sgd.zero_grad()
            sum((i + 1) * v.pow(2).sum() for i, v in enumerate(out.values())).backward()
            sgd.step()
    torch.testing.assert_close(_rows(traced), _rows(eager), rtol=0, atol=0)
    torch.testing.assert_close(_rows(twin), _rows(eager), rtol=1e-5, atol=1e-5)
    assert not torch.equal(_rows(eager), _initial(eager.ec))  # it did train


@pytest.mark.parametrize("pooled", [False, True], ids=["sequence", "pooled"])
def test_traced_model_in_eval_reads_without_inserting(pooled):
    model = _dynamic(pooled)
    traced = torchrec.fx.symbolic_trace(model).eval()
    kjt = next(_batches(1))
    with torch.no_grad():
        torch.testing.assert_close(traced(kjt), model.eval()(kjt), rtol=0, atol=0)
    assert _collection(model).stats()["t"]["rows_device"] == 0


@pytest.mark.parametrize("pooled", [False, True], ids=["sequence", "pooled"])
def test_script_raises_naming_to_static_and_changes_nothing(pooled):
    model = _dynamic(pooled)
    kjt = next(_batches(1))
    model(kjt).backward()
    before = _rows(model).clone()
    kind = "DynamicEmbBagCollection" if pooled else "DynamicEmbCollection"
    with pytest.raises(RuntimeError, match=f"cannot compile {kind}.*to_static"):
        torch.jit.script(model)
    with pytest.raises(RuntimeError, match=f"cannot compile {kind}"):
        torch.jit.script(_collection(model))
    torch.testing.assert_close(_rows(model), before, rtol=0, atol=0)
    assert model(kjt).requires_grad  # the module still runs eagerly


def test_the_named_way_scripts():
    """What the error recommends works: the static export's collection and id remap script,
    and together they answer like the trained module's eval forward."""
    model = _dynamic(pooled=False)
    kjt = next(_batches(1))
    model(kjt).backward()
    ec, remaps = to_static(model.ec)
    scripted_ec, scripted_remap = torch.jit.script(ec), torch.jit.script(remaps["t"])
    rows = scripted_remap(kjt.values())
    out = scripted_ec(KeyedJaggedTensor.from_lengths_sync(FEATURES, rows, kjt.lengths()))
    with torch.no_grad():
        expected = model.ec.eval()(kjt)
    for feature in FEATURES:
        torch.testing.assert_close(out[feature].values(), expected[feature].values(),
                                   rtol=0, atol=0)


class KjtBuildingModel(torch.nn.Module):
    """Builds its KJT from plain tensors inside forward (traced as a Proxy too)."""

    def __init__(self, ec: torch.nn.Module):
        super().__init__()
        self.ec = ec

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        kjt = KeyedJaggedTensor(keys=FEATURES, values=values, lengths=lengths)
        return self.ec(kjt)["g"].values()


def test_a_kjt_built_inside_the_traced_forward():
    eager = KjtBuildingModel(_dynamic(pooled=False).ec)
    traced = torchrec.fx.symbolic_trace(KjtBuildingModel(_dynamic(pooled=False).ec))
    reference = torchrec.fx.symbolic_trace(KjtBuildingModel(_torchrec_twin(
        SequenceModel(eager.ec)).ec))
    kjt = next(_batches(1))
    expected = eager(kjt.values(), kjt.lengths())
    torch.testing.assert_close(traced(kjt.values(), kjt.lengths()), expected, rtol=0, atol=0)
    torch.testing.assert_close(reference(kjt.values(), kjt.lengths()), expected)
