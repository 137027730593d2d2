"""cut_by_feature: rows cut into one JaggedTensor per feature, in segment order."""
import pytest
import torch

from dynemb.modules.jagged import cut_by_feature


def test_rows_are_cut_in_segment_order_with_each_features_lengths_and_ids():
    rows = torch.arange(10.0).view(5, 2)  # rows 0..4
    lengths = {"a": torch.tensor([2, 0]), "b": torch.tensor([1, 2])}
    ids = {"a": torch.tensor([10, 11]), "b": torch.tensor([20, 21, 22])}
    out = cut_by_feature(rows, [("a", 2), ("b", 3)], lengths, ids)
    assert list(out) == ["a", "b"]
    assert out["a"].values().tolist() == [[0.0, 1.0], [2.0, 3.0]]
    assert out["b"].values().tolist() == [[4.0, 5.0], [6.0, 7.0], [8.0, 9.0]]
    assert out["b"].lengths().tolist() == [1, 2] and out["b"].weights().tolist() == [20, 21, 22]


def test_without_ids_there_are_no_weights_and_an_empty_feature_is_kept():
    out = cut_by_feature(torch.ones(2, 3), [("a", 0), ("b", 2)],
                         {"a": torch.tensor([0, 0]), "b": torch.tensor([1, 1])})
    assert out["a"].values().shape == (0, 3)
    assert out["b"].weights_or_none() is None


def test_gradients_flow_back_to_the_rows():
    rows = torch.zeros(3, 2, requires_grad=True)
    out = cut_by_feature(rows, [("a", 1), ("b", 2)],
                         {"a": torch.tensor([1]), "b": torch.tensor([2])})
    (out["a"].values().sum() + 2 * out["b"].values().sum()).backward()
    assert rows.grad.tolist() == [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]]


@pytest.mark.parametrize("segments", [[("a", 2)], [("a", 1), ("a", 1)]])
def test_segments_name_the_output_keys(segments):
    out = cut_by_feature(torch.ones(2, 1), segments, {"a": torch.tensor([1])})
    assert list(out) == ["a"]


def test_an_unused_feature_gets_a_zero_gradient_and_one_feature_is_the_rows_themselves():
    rows = torch.ones(3, 2, requires_grad=True)
    lengths = {"a": torch.tensor([1]), "b": torch.tensor([2])}
    out = cut_by_feature(rows, [("a", 1), ("b", 2)], lengths)
    (3 * out["b"].values().sum()).backward()  # "a" is not in the loss
    assert rows.grad.tolist() == [[0.0, 0.0], [3.0, 3.0], [3.0, 3.0]]
    whole = cut_by_feature(rows, [("b", 3)], {"b": torch.tensor([3])})
    assert whole["b"].values() is rows


def test_a_count_that_does_not_add_up_to_the_rows_raises():
    with pytest.raises(RuntimeError):
        cut_by_feature(torch.ones(3, 2), [("a", 1), ("b", 1)],
                       {"a": torch.tensor([1]), "b": torch.tensor([1])})
