"""Table names: refused at construction where TorchRec's modules refuse them, and every name
that is accepted survives a state_dict round trip and a file dump."""
import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import DynamicEmbBagCollection, DynamicEmbCollection
from dynemb.checkpoint import dump, load

MODULES = [
    (EmbeddingCollection, DynamicEmbCollection, EmbeddingConfig),
    (EmbeddingBagCollection, DynamicEmbBagCollection, EmbeddingBagConfig),
]


def tables(config_type, name):
    return [config_type(name=name, embedding_dim=4, num_embeddings=64, feature_names=["f"])]


@pytest.mark.parametrize("name", ["a.b", "../x", ".", "x."])
@pytest.mark.parametrize("torchrec_type, dynemb_type, config_type", MODULES)
def test_a_name_with_a_dot_is_refused_at_construction_like_torchrec(torchrec_type, dynemb_type,
                                                                    config_type, name):
    with pytest.raises(KeyError, match=r'contain "\."'):
        torchrec_type(tables=tables(config_type, name), device=torch.device("cpu"))
    with pytest.raises(KeyError, match=r'contains "\."'):
        dynemb_type(tables=tables(config_type, name))


@pytest.mark.parametrize("torchrec_type, dynemb_type, config_type", MODULES)
def test_a_name_that_is_not_a_string_is_refused(torchrec_type, dynemb_type, config_type):
    with pytest.raises(TypeError, match="table name must be a str"):
        dynemb_type(tables=tables(config_type, 7))


def batch():
    return KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([3, 10**12, 3, 5]),
                                               torch.tensor([2, 2]))


def train_step(module):
    out = module(batch())
    values = out["f"].values() if isinstance(out, dict) else out.values()
    values.pow(2).sum().backward()


@pytest.mark.parametrize("name", ["a/b", "x y", "-"])
@pytest.mark.parametrize("torchrec_type, dynemb_type, config_type", MODULES)
def test_names_torchrec_accepts_round_trip_through_state_dict_and_files(
        torchrec_type, dynemb_type, config_type, name, tmp_path):
    torchrec_type(tables=tables(config_type, name), device=torch.device("cpu"))  # accepted there
    trained = dynemb_type(tables=tables(config_type, name))
    train_step(trained)
    keys = torch.tensor([3, 5, 10**12])
    rows, found = trained.read_rows(name, keys)
    assert bool(found.all())

    fresh = dynemb_type(tables=tables(config_type, name))
    fresh.load_state_dict(trained.state_dict())
    assert torch.equal(fresh.read_rows(name, keys)[0], rows)

    dump(trained, tmp_path / "ckpt")
    from_files = dynemb_type(tables=tables(config_type, name))
    load(from_files, tmp_path / "ckpt")
    assert torch.equal(from_files.read_rows(name, keys)[0], rows)
