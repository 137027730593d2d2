"""The collections start new rows as TorchRec starts the same EmbeddingConfig / EmbeddingBagConfig
(its weight_init range, or a torch.nn.init init_fn), and refuse an init_fn they cannot draw
per id when they are built."""
import functools

import pytest
import torch
from torchrec import EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbBagCollection, DynamicEmbCollection, DynamicEmbTableOptions,
                    Initializer, InitializerKind)
from dynemb.rows.initializers import table_identity
from key_reference import initial_rows

DIM = 8


def lookup(ec, ids):
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.as_tensor(ids),
                                              torch.ones(len(ids), dtype=torch.int64))
    return ec(kjt)["f"].values().detach()  # a training lookup: new ids get rows


def test_rows_follow_the_configs_weight_init_range():
    config = EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=1000,
                             feature_names=["f"], weight_init_min=-1.0, weight_init_max=1.0)
    ec = DynamicEmbCollection([config], table_options=DynamicEmbTableOptions(seed=4))
    ec.train()
    ids = [3, 2**50 + 9, -8]
    want = initial_rows(Initializer(InitializerKind.UNIFORM, low=-1.0, high=1.0), ids, DIM,
                        seed=4, table_id=table_identity("t"))
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor(ids), torch.ones(3).long())
    torch.testing.assert_close(ec(kjt)["f"].values().detach(), torch.tensor(want),
                               rtol=2e-7, atol=1e-7)
    # what a sharder hands each rank: the settled initializer
    assert ec.table_options["t"].initializer == Initializer(InitializerKind.UNIFORM,
                                                            low=-1.0, high=1.0)


def test_default_range_is_torchrecs_sqrt_of_one_over_num_embeddings():
    config = EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=10_000,
                             feature_names=["f"])
    torchrec = EmbeddingCollection(tables=[config]).embeddings["t"].weight.detach()
    ec = DynamicEmbCollection([config])
    rows = ec(KeyedJaggedTensor.from_lengths_sync(
        ["f"], torch.arange(4000) * 31 + 1, torch.ones(4000).long()))["f"].values().detach()
    for weights in (torchrec, rows):
        assert float(weights.abs().max()) <= 0.01
        assert float(weights.std()) == pytest.approx(0.02 / 12**0.5, rel=0.05)


def test_bag_collection_rows_follow_its_configs_init_fn():
    config = EmbeddingBagConfig(name="t", embedding_dim=DIM, num_embeddings=1000,
                                feature_names=["f"], pooling=PoolingType.SUM,
                                init_fn=functools.partial(torch.nn.init.constant_, val=0.75))
    ebc = DynamicEmbBagCollection([config])
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([1, 2, 3]),
                                              torch.tensor([1, 2]))
    pooled = ebc(kjt)["f"]
    assert pooled.tolist() == [[0.75] * DIM, [1.5] * DIM]


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_an_init_fn_that_cannot_run_per_id_is_refused_at_construction(device):
    bad = torch.nn.init.xavier_uniform_
    with pytest.raises(ValueError, match=r"DynamicEmbTableOptions\(initializer=Initializer"):
        DynamicEmbCollection([EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=64,
                                              feature_names=["f"], init_fn=bad)], device)
    with pytest.raises(ValueError, match=r"table 'b': init_fn"):
        DynamicEmbBagCollection([EmbeddingBagConfig(name="b", embedding_dim=DIM,
                                                    num_embeddings=64, feature_names=["g"],
                                                    init_fn=bad)], device=device)
    # an explicit initializer is the supported way, and wins over the config
    ok = DynamicEmbCollection(
        [EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=64, feature_names=["f"],
                         init_fn=bad)], device,
        table_options=DynamicEmbTableOptions(initializer=Initializer(
            InitializerKind.CONSTANT, value=0.5)))
    if device == "cpu":
        assert (lookup(ok, [1, 2]) == 0.5).all()
