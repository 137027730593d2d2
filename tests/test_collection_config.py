"""check_configs and options_by_table: bad table configs and options fail naming the table."""
import pytest
from torchrec import EmbeddingConfig

from dynemb import DynamicEmbTableOptions, ScorePolicy
from dynemb.modules.collection_config import check_configs, options_by_table


def config(name, features=None, dim=4):
    return EmbeddingConfig(name=name, embedding_dim=dim, num_embeddings=16,
                           feature_names=list(features) if features is not None else [])


def test_a_feature_of_several_tables_is_named_feature_at_table_as_in_torchrec():
    from torchrec.modules.embedding_modules import get_embedding_names_by_table
    from dynemb.modules.collection_config import output_name_of, output_names_by_table
    tables = check_configs([config("a", ["f", "g"]), config("b", ["f"]), config("c", ["h"])])
    names = [["f@a", "g"], ["f@b"], ["h"]]
    assert output_names_by_table(tables) == get_embedding_names_by_table(tables) == names
    assert output_name_of(tables) == {("a", "f"): "f@a", ("a", "g"): "g", ("b", "f"): "f@b",
                                      ("c", "h"): "h"}


def test_a_table_without_features_reads_the_feature_named_after_it():
    (c,) = check_configs([config("users")])
    assert c.feature_names == ["users"]


@pytest.mark.parametrize("tables, error, match", [
    ([], ValueError, "non-empty list"),
    ("t", ValueError, "non-empty list"),
    ([object()], TypeError, "EmbeddingConfig"),
    ([config("t"), config("t")], ValueError, "unique"),
    ([config("a", ["f", "g", "f"])], ValueError, r"table 'a' lists features \['f'\] more than"),
])
def test_bad_configs_are_rejected(tables, error, match):
    with pytest.raises(error, match=match):
        check_configs(tables)


def test_one_options_object_serves_every_table_and_a_dict_fills_in_defaults():
    lfu = DynamicEmbTableOptions(score_strategy=ScorePolicy.LFU)
    assert options_by_table(lfu, ["a", "b"]) == {"a": lfu, "b": lfu}
    out = options_by_table({"b": lfu}, ["a", "b"])
    assert out["a"] == DynamicEmbTableOptions() and out["b"] is lfu
    assert options_by_table(None, ["a"]) == {"a": DynamicEmbTableOptions()}


@pytest.mark.parametrize("options, error, match", [
    ({"c": DynamicEmbTableOptions()}, ValueError, r"unknown tables \['c'\]"),
    ({"a": "lru"}, TypeError, r"table_options\['a'\]"),
    (["a"], TypeError, "dict of them by table name"),
])
def test_bad_options_name_the_table(options, error, match):
    with pytest.raises(error, match=match):
        options_by_table(options, ["a", "b"])


@pytest.mark.parametrize("num_embeddings", [0, -3])
def test_a_table_without_rows_is_refused_naming_the_table_and_field(num_embeddings):
    """TorchRec's own EmbeddingConfig divides by num_embeddings when it picks the default
    init range (ZeroDivisionError there, before any module sees the config); with an init
    range given, the module names the problem."""
    from dynemb import DynamicEmbBagCollection, DynamicEmbCollection
    from torchrec import EmbeddingBagConfig

    for module, config_type in ((DynamicEmbCollection, EmbeddingConfig),
                                (DynamicEmbBagCollection, EmbeddingBagConfig)):
        config = config_type(name="t", embedding_dim=4, num_embeddings=num_embeddings,
                             feature_names=["f"], weight_init_min=-0.1, weight_init_max=0.1)
        with pytest.raises(ValueError, match=f"table 't': num_embeddings must be positive, "
                                             f"got {num_embeddings}"):
            module(tables=[config])
