"""``load_state_dict`` of a state dict that lacks a table (a model that gained one since its
checkpoint) or holds one the model lacks, against TorchRec's ``EmbeddingCollection`` doing
the same load: with ``strict=False`` the tables present load and the others are reported as
TorchRec reports them (one missing key per absent table; the keys of an unknown table as
unexpected); with ``strict=True`` the load raises and no dynamic table changes. On both
kernel backends (CUDA under the simulator here). The sharded case is in
tests/test_checkpoint_reload_sharded.py."""
import pytest
import torch
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, Initializer, InitializerKind,
                    OptimizerConfig, OptimizerType)

NUM_IDS = 40
LR = 0.5
OPTIONS = DynamicEmbTableOptions(
    initializer=Initializer(InitializerKind.UNIFORM, low=-0.1, high=0.1), seed=5)
SGD = OptimizerConfig(OptimizerType.SGD, learning_rate=LR)
IDS = torch.arange(NUM_IDS)


def configs():
    return [EmbeddingConfig(name=f"t{i}", embedding_dim=4, num_embeddings=NUM_IDS,
                            feature_names=[f"f{i}"]) for i in range(2)]


def pair(backend, seed):
    """A dynamic collection and TorchRec's with the same rows, each trained by the same SGD
    step on a batch drawn from ``seed`` (the TorchRec one by hand)."""
    dyn = DynamicEmbCollection(configs(), table_options=OPTIONS, optimizer=SGD,
                               backend=backend)
    ref = EmbeddingCollection(configs())
    with torch.no_grad():
        for name, table in dyn.tables.items():
            ref.embeddings[name].weight.copy_(table.options.initializer.rows(
                IDS, table.dim, seed=table.options.seed, table_id=table.table_id))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, NUM_IDS, (12,), generator=g)
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], ids, torch.full((8,), 1) +
                                              torch.tensor([1, 0] * 4))
    for module in (dyn, ref):
        loss = sum((jt.values() * (1 + torch.arange(jt.values().shape[1]))).sum()
                   for jt in module(kjt).values())
        loss.backward()
    with torch.no_grad():
        for param in ref.parameters():
            param -= LR * param.grad
            param.grad = None
    return dyn, ref


def rows_of(dyn, ref):
    """Per table: the dynamic module's rows of the ids it holds, TorchRec's rows of those ids,
    and which ids it holds."""
    out = {}
    for name in dyn.tables:
        rows, found = dyn.read_rows(name, IDS)
        out[name] = (rows[found], ref.embeddings[name].weight.detach()[found].clone(), found)
    return out


def renamed(state, old, new):
    """``state`` with table ``old``'s entries under table ``new``'s name (the model that saved
    it had ``new`` where this one has ``old``)."""
    out = {}
    for key, value in state.items():
        parts = key.split(".")
        if parts[1] == old:
            parts[1] = new
        out[".".join(parts)] = value
    return out


def tables_in(keys):
    return sorted({key.split(".")[1] for key in keys})


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_without_strict_the_tables_present_load_and_the_others_are_reported(backend):
    source_dyn, source_ref = pair(backend, seed=1)
    saved = rows_of(source_dyn, source_ref)
    assert all(torch.equal(a, b) for a, b, _ in saved.values())  # twins
    dyn, ref = pair(backend, seed=2)   # trained on another batch
    before = rows_of(dyn, ref)
    dyn_state = renamed(source_dyn.state_dict(), "t1", "t9")
    ref_state = renamed(source_ref.state_dict(), "t1", "t9")

    got = dyn.load_state_dict(dyn_state, strict=False)
    expected = ref.load_state_dict(ref_state, strict=False)

    assert tables_in(got.missing_keys) == tables_in(expected.missing_keys) == ["t1"]
    assert got.missing_keys == ["dynamic_tables.t1.signature"]  # one key per table
    assert tables_in(got.unexpected_keys) == tables_in(expected.unexpected_keys) == ["t9"]
    after = rows_of(dyn, ref)
    # t0 holds the saved rows, exactly the ids saved (TorchRec's t0 holds them too)
    rows, ref_rows, found = after["t0"]
    assert torch.equal(found, saved["t0"][2]) and found.sum() > 0
    assert torch.equal(rows, saved["t0"][0]) and torch.equal(rows, ref_rows)
    # t1 as it was, in both
    for was, now in zip(before["t1"], after["t1"]):
        assert torch.equal(was, now)
    assert torch.equal(after["t1"][0], after["t1"][1])


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
@pytest.mark.parametrize("change", ["missing", "unexpected"])
def test_with_strict_the_load_raises_as_torchrecs_and_no_table_changes(backend, change):
    source_dyn, source_ref = pair(backend, seed=1)
    dyn, ref = pair(backend, seed=2)
    states = [source_dyn.state_dict(), source_ref.state_dict()]
    if change == "missing":
        states = [{k: v for k, v in s.items() if ".t1." not in k} for s in states]
        message = r"Missing key\(s\) in state_dict: \"?.*t1"
    else:
        states = [{**s, **{k: v for k, v in renamed(s, "t1", "t9").items() if ".t9." in k}}
                  for s in states]
        message = r"Unexpected key\(s\) in state_dict: \"?.*t9"
    before = rows_of(dyn, ref)
    with pytest.raises(RuntimeError, match=message):
        ref.load_state_dict(states[1])
    with pytest.raises(RuntimeError, match=message):
        dyn.load_state_dict(states[0])
    after = rows_of(dyn, ref)
    for name in dyn.tables:  # TorchRec copies t0 before it raises; the dynamic t0 stays
        assert torch.equal(before[name][0], after[name][0])
        assert torch.equal(before[name][2], after[name][2])


def test_a_state_dict_of_no_dynamic_table_leaves_the_tables_and_a_pending_backward_alone():
    dyn, ref = pair("cpu", seed=1)
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.tensor([3, 5, 7]),
                                              torch.tensor([1, 1, 1, 0]))
    results, losses = [], []
    for module in (dyn, ref):
        model = torch.nn.ModuleDict({"emb": module, "dense": torch.nn.Linear(2, 1)})
        losses.append(sum(jt.values().sum() for jt in module(kjt).values()))  # not backward yet
        results.append(model.load_state_dict({"dense.weight": torch.ones(1, 2),
                                              "dense.bias": torch.zeros(1)}, strict=False))
        assert torch.equal(model["dense"].weight, torch.ones(1, 2))
    assert tables_in([k[len("emb."):] for k in results[0].missing_keys]) == \
        tables_in([k[len("emb."):] for k in results[1].missing_keys]) == ["t0", "t1"]
    for loss in losses:  # the lookup made before the load still trains its rows
        loss.backward()
    with torch.no_grad():
        for param in ref.parameters():
            param -= LR * param.grad
    for rows, ref_rows, found in rows_of(dyn, ref).values():
        assert found.sum() > 0 and torch.equal(rows, ref_rows)
