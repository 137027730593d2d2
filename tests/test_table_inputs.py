"""split_by_table and its per-key-order plans (dynemb.modules.table_inputs): each table's ids, from
KJTs whose keys come in any order, against the ids picked feature by feature by hand."""
import pytest
import torch
from torchrec import EmbeddingConfig, KeyedJaggedTensor

from dynemb.modules.table_inputs import TableInputs, split_by_table
from dynemb.types import EMPTY_KEY

CPU = torch.device("cpu")


def configs():
    return [EmbeddingConfig(name="t0", embedding_dim=4, num_embeddings=64, feature_names=["a"]),
            EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=64,
                            feature_names=["c", "b"]),
            EmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=64,
                            feature_names=["a", "d"])]


def kjt_of(ids_by_feature, batch=2):
    """A KJT of ``{feature: [ids]}`` in the dict's order, each feature's ids in its first
    sample."""
    keys = list(ids_by_feature)
    values = [i for f in keys for i in ids_by_feature[f]]
    lengths = []
    for f in keys:
        lengths += [len(ids_by_feature[f])] + [0] * (batch - 1)
    return KeyedJaggedTensor.from_lengths_sync(keys, torch.tensor(values, dtype=torch.int64),
                                               torch.tensor(lengths, dtype=torch.int64))


def expected(ids_by_feature):
    """Each table's ids and segments, picked feature by feature."""
    out = {}
    for config in configs():
        present = [f for f in config.feature_names if f in ids_by_feature]
        out[config.name] = ([i for f in present for i in ids_by_feature[f]],
                            [(f, len(ids_by_feature[f])) for f in present])
    return out


def test_a_kjt_lacking_a_feature_a_table_reads_raises_key_error():
    """As TorchRec's collections do; a feature no table reads may be absent or extra."""
    with pytest.raises(KeyError, match=r"features \['c', 'd'\] of this collection are not in "
                                       r"the KJT \(its features: \['b', 'a', 'e'\]\)"):
        split_by_table(kjt_of({"b": [3], "a": [1, 2], "e": [9, 9]}), TableInputs(configs()),
                       CPU, validate=True)


@pytest.mark.parametrize("order", [
    {"a": [1, 2], "b": [3], "c": [4, 5, 6], "d": [7]},
    {"d": [7], "c": [4, 5, 6], "b": [3], "a": [1, 2]},  # reversed
    {"b": [3], "a": [1, 2], "e": [9, 9], "c": [], "d": [4]},  # e read by no table
    {"c": [], "a": [], "b": [8], "d": []},  # empty features
])
def test_each_table_gets_its_features_ids_in_its_feature_order(order):
    inputs = TableInputs(configs())
    for _ in range(2):  # the second call goes through the remembered plan
        got = split_by_table(kjt_of(order), inputs, CPU, validate=True)
        for name, (ids, segments) in expected(order).items():
            keys, got_segments, occurrences = got[name]
            assert keys.dtype == torch.int64 and keys.tolist() == ids, name
            assert got_segments == segments and occurrences is None
        assert {f: v.tolist() for f, v in got["__lengths__"].items()} == {
            f: [len(ids), 0] for f, ids in order.items()}


def test_plans_follow_the_key_order_and_are_bounded():
    inputs = TableInputs(configs())
    first = {"a": [1], "b": [2], "c": [3], "d": [4]}
    second = {"d": [4], "c": [3], "b": [2], "a": [1]}
    for ids in (first, second, first):  # alternating orders reuse their own plans
        got = split_by_table(kjt_of(ids), inputs, CPU, validate=False)
        assert got["t1"][0].tolist() == [3, 2] and got["t2"][0].tolist() == [1, 4]
    assert len(inputs._plans) == 2
    for n in range(TableInputs.MAX_PLANS + 3):  # many orders: the cache starts over
        inputs.plan(("a", "b", "c", "d", f"x{n}"))
    assert len(inputs._plans) <= TableInputs.MAX_PLANS
    got = split_by_table(kjt_of(second), inputs, CPU, validate=False)
    assert got["t1"][0].tolist() == [3, 2] and got["t1"][1] == [("c", 1), ("b", 1)]


def test_weights_as_counts_follow_the_same_plan():
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["d", "a", "b", "c"], torch.tensor([7, 1, 2]), torch.tensor([1, 0, 2, 0, 0, 0, 0, 0]),
        weights=torch.tensor([3.0, 1.0, 2.0]))
    got = split_by_table(kjt, TableInputs(configs()), CPU, validate=True,
                         weights_are_counts=True)
    keys, segments, occurrences = got["t2"]
    assert keys.tolist() == [1, 2, 7] and segments == [("a", 2), ("d", 1)]
    assert occurrences.dtype == torch.int64 and occurrences.tolist() == [1, 2, 3]
    assert got["t1"][0].numel() == 0 and got["t1"][2].numel() == 0


def test_a_reserved_key_is_named_by_its_table():
    bad = kjt_of({"b": [3], "d": [EMPTY_KEY]})
    with pytest.raises(ValueError, match="t2"):
        split_by_table(bad, TableInputs(configs()), CPU, validate=True)
