"""Table groups under DynamicEmbBagCollection: a grouped pooled module and the same tables
pooled one by one (``group_tables=False``) agree bit for bit (outputs, rows, optimizer state,
scores, counters), with SUM and MEAN bags, per-id weights, several features per table, and
tables that pool differently in one group; in float32 training, the grouped module also
agrees with the group model (tests/group_reference.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import DynamicEmbBagCollection, DynamicEmbTableOptions
from dynemb.rows.optimizers import OptimizerConfig, OptimizerType
from dynemb.tables.groups import GroupBatch
from dynemb.types import ScorePolicy
from group_reference import GroupReference

FEATURES = ["a", "b", "c", "d", "e"]
BATCH = 6


def configs(poolings, data_type=DataType.FP32):
    # t1 reads two features; t3 has another dim (it trains alone)
    features = [["a"], ["b", "c"], ["d"], ["e"]]
    dims = [8, 8, 8, 4]
    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dims[i], num_embeddings=300,
                               feature_names=features[i], pooling=poolings[i],
                               data_type=data_type)
            for i in range(4)]


def twins(poolings, optimizer, weighted=False, clip=None, backend=None, device=None,
          data_type=DataType.FP32, capacity=128, **table_options):
    options = DynamicEmbTableOptions(max_capacity=capacity, bucket_size=32,
                                     score_strategy=ScorePolicy.LFU, stochastic_rounding=False,
                                     **table_options)
    config = OptimizerConfig(optimizer, learning_rate=0.05, max_gradient=clip)
    return [DynamicEmbBagCollection(configs(poolings, data_type), is_weighted=weighted,
                                    table_options=options, optimizer=config, group_tables=g,
                                    backend=backend, device=device)
            for g in (True, False)]


def batch(gen, weighted):
    lengths = torch.randint(0, 6, (len(FEATURES) * BATCH,), generator=gen)
    ids = torch.randint(0, 700, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(ids.numel(), generator=gen) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(FEATURES, ids, lengths, weights=weights)


POOLINGS = [
    ([PoolingType.SUM] * 4, False, None),
    ([PoolingType.SUM] * 4, True, 0.05),
    ([PoolingType.MEAN] * 4, False, None),
    ([PoolingType.MEAN] * 4, False, 0.05),
    ([PoolingType.SUM, PoolingType.MEAN, PoolingType.SUM, PoolingType.MEAN], False, None),
]


@pytest.mark.parametrize("poolings,weighted,clip", [
    ([PoolingType.SUM] * 4, False, None),
    ([PoolingType.SUM] * 4, True, 0.05),
    ([PoolingType.MEAN] * 4, False, None),
    ([PoolingType.MEAN] * 4, False, 0.05),
    ([PoolingType.SUM, PoolingType.MEAN, PoolingType.SUM, PoolingType.MEAN], False, None),
])
@pytest.mark.parametrize("optimizer", [OptimizerType.SGD, OptimizerType.ADAM,
                                       OptimizerType.ROWWISE_ADAGRAD])
def test_a_grouped_bag_module_trains_bit_for_bit_as_its_tables_one_by_one(
        poolings, weighted, clip, optimizer):
    grouped, alone = twins(poolings, optimizer, weighted, clip)
    train_alike(grouped, alone, weighted, steps=15, seed=1, reference=GroupReference(grouped))
    assert sum(s["evictions"] for s in grouped.stats().values()) > 0


@pytest.mark.parametrize("poolings,weighted,clip", POOLINGS[:3])
def test_grouped_host_only_bag_tables_train_bit_for_bit_as_alone(poolings, weighted, clip):
    grouped, alone = twins(poolings, OptimizerType.ADAM, weighted, clip,
                           local_hbm_for_values=0)
    assert {m.name for m in grouped.storage_modes().values()} == {"HOST_ONLY"}
    assert grouped.table_groups() == [("t0", "t1", "t2"), ("t3",)]
    train_alike(grouped, alone, weighted, steps=12, seed=4, reference=GroupReference(grouped))
    assert sum(s["evictions"] for s in grouped.stats().values()) > 0


@pytest.mark.parametrize("data_type", [DataType.FP16, DataType.BF16])
@pytest.mark.parametrize("poolings", [[PoolingType.MEAN] * 4, [PoolingType.SUM] * 4,
                                      [PoolingType.SUM, PoolingType.MEAN] * 2])
def test_a_grouped_half_precision_bag_module_trains_bit_for_bit_as_its_tables_one_by_one(
        poolings, data_type):
    """float16 / bfloat16 rows (rounded to nearest): a MEAN bag divides the float32 sum of
    its rows alike grouped and alone."""
    grouped, alone = twins(poolings, OptimizerType.ADAM, data_type=data_type)
    train_alike(grouped, alone, False, steps=6, seed=4)


def test_a_grouped_bag_module_trains_as_its_tables_one_by_one_after_one_table_is_reset():
    """A reset table comes last in the module's tables but keeps its place in its group:
    each id's gradient still reaches its own table's row (the bags are read in the group's
    order, that of its ids)."""
    grouped, alone = twins([PoolingType.SUM, PoolingType.MEAN, PoolingType.SUM,
                            PoolingType.SUM], OptimizerType.SGD)
    train_alike(grouped, alone, False, steps=2, seed=5)
    for module in (grouped, alone):
        module.reset_parameters(["t0"])
    assert list(grouped.tables)[-1] == "t0"
    train_alike(grouped, alone, False, steps=3, seed=6)


def train_alike(grouped, alone, weighted, steps, seed, device="cpu", by_key=False,
                reference=None):
    """Both modules train on the same batches; outputs, then state and counters, are equal
    bit for bit. ``by_key``: the state is compared key by key (rows, optimizer state), not
    slot by slot: on a GPU, concurrent inserts into one bucket may take its slots in
    another order. ``reference``: a ``GroupReference`` of ``grouped`` (float32 rows) that
    follows the steps and is compared with it at the end."""
    assert grouped.table_groups() == [("t0", "t1", "t2"), ("t3",)]  # t3: a group of one
    gen = torch.Generator().manual_seed(seed)
    probe = torch.randn(BATCH, 8 * 4 + 4, generator=gen).to(device)
    for _ in range(steps):
        kjt = batch(gen, weighted).to(device)
        out_g, out_a = grouped(kjt), alone(kjt)
        assert torch.equal(out_g.values(), out_a.values())
        assert out_g.keys() == out_a.keys()
        (out_g.values() * probe).sum().backward()
        (out_a.values() * probe).sum().backward()
        if reference is not None:
            starts = dict(zip(out_g.keys(), np.cumsum([0] + out_g.length_per_key())))
            reference.step(kjt, out_g, lambda f, pooled: probe[:, starts[f]:starts[f]
                                                                + pooled.shape[1]].cpu().numpy())
    assert grouped.stats() == alone.stats()
    if reference is not None:
        reference.check()
    if by_key:
        keys = torch.arange(700, device=device)
        for name in grouped.tables:
            rows_g, found_g = grouped.read_rows(name, keys, with_state=True)
            rows_a, found_a = alone.read_rows(name, keys, with_state=True)
            assert torch.equal(found_g, found_a) and found_g.any(), name
            assert same_bits(rows_g[found_g], rows_a[found_a]), name
        return
    state_g, state_a = grouped.state_dict(), alone.state_dict()
    for key in state_g:
        assert same_bits(state_g[key], state_a[key]), key


def same_bits(a, b):
    """Bitwise equality (half-precision rows carry float32 optimizer state as raw bits, which
    may read as NaN)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("poolings,weighted,clip", POOLINGS)
def test_a_grouped_bag_module_pools_eval_lookups_as_its_tables_one_by_one(
        poolings, weighted, clip):
    """Eval and no_grad lookups of a group in one batch (unseen keys read their eval
    initializer's rows, pooled like stored ones): the same bits, counters and state."""
    grouped, alone = twins(poolings, OptimizerType.ADAM, weighted, clip)
    reference = GroupReference(grouped)
    train_alike(grouped, alone, weighted, steps=4, seed=2, reference=reference)
    gen = torch.Generator().manual_seed(9)
    for mode in ("no_grad", "eval", "eval"):
        if mode == "eval":
            grouped.eval(), alone.eval(), reference.eval()
        with torch.no_grad():
            kjt = batch(gen, weighted)
            out_g, out_a = grouped(kjt), alone(kjt)
        assert torch.equal(out_g.values(), out_a.values()), mode
        reference.lookup(kjt, out_g)
    reference.check()
    state_g, state_a = grouped.state_dict(), alone.state_dict()
    for key in state_g:
        assert torch.equal(state_g[key], state_a[key]), key
    assert grouped.stats() == alone.stats()
    assert grouped.stats()["t0"]["misses"] > 0
    assert not any(t.has_batches_in_flight() for t in grouped.tables.values())


@pytest.mark.parametrize("poolings,weighted,clip", POOLINGS[1::2] + POOLINGS[4:])
def test_a_grouped_bag_module_on_the_cuda_kernels_trains_as_its_tables_one_by_one(
        poolings, weighted, clip):
    """The CUDA kernels' group gathers every table's bag gradients in one op (their update
    kernel takes contiguous rows); the same bits as the tables alone. (Adam: row-wise
    AdaGrad's barriers make the simulator a hundred times slower.) Room for every id, so
    nothing is evicted: concurrent claims on a GPU may place keys in other slots of a bucket,
    or pick other victims among equal scores; rows are compared key by key."""
    from conftest import BACKENDS
    name, device = BACKENDS[1]
    assert name == "cuda"
    grouped, alone = twins(poolings, OptimizerType.ADAM, weighted, clip, backend="cuda",
                           device=torch.device(device), capacity=256)
    train_alike(grouped, alone, weighted, steps=3, seed=3, device=device, by_key=True,
                reference=GroupReference(grouped))
    assert sum(s["evictions"] for s in grouped.stats().values()) == 0


def test_eval_and_prefetched_bag_lookups_match_their_twin():
    grouped, alone = twins([PoolingType.SUM] * 4, OptimizerType.ADAGRAD)
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        kjt = batch(gen, False)
        state = grouped.prefetch(kjt)
        alone.prefetch(kjt)
        assert isinstance(state.batches["t0"], GroupBatch)
        grouped(kjt).values().sum().backward(), alone(kjt).values().sum().backward()
    kjt = batch(gen, False)
    grouped.eval(), alone.eval()
    assert torch.equal(grouped(kjt).values(), alone(kjt).values())
