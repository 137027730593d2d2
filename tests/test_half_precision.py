"""float16 / bfloat16 tables in a DynamicEmbCollection: float32 optimizer state, stochastic
rounding of the updated rows, and the same rows in every storage mode. The rounding itself is
tested in test_optimizers.py, the row layout in test_flat_table.py."""
import pytest
import torch
from torchrec import EmbeddingConfig
from torchrec.modules.embedding_configs import DataType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, Initializer, InitializerKind,
                    OptimizerConfig, OptimizerType)
from dynemb.rows.flat_table import RowLayout
from key_reference import initial_rows

HALF = [torch.float16, torch.bfloat16]
DATA_TYPES = {torch.float32: DataType.FP32, torch.float16: DataType.FP16,
              torch.bfloat16: DataType.BF16}
UNIFORM = Initializer(InitializerKind.UNIFORM, low=-0.1, high=0.1)
#: table_identity("t"), pinned in test_initializers.py
TABLE_T_ID = 6256752092847567818
SGD, ADAM, ADAGRAD, ROWWISE = (OptimizerType.SGD, OptimizerType.ADAM, OptimizerType.ADAGRAD,
                               OptimizerType.ROWWISE_ADAGRAD)


def make(dtype, optimizer, *, dim=16, num_embeddings=1024, **options):
    tables = [EmbeddingConfig(name="t", embedding_dim=dim, num_embeddings=num_embeddings,
                              feature_names=["f"], data_type=DATA_TYPES[dtype])]
    options.setdefault("initializer", UNIFORM)
    return DynamicEmbCollection(tables, table_options=DynamicEmbTableOptions(**options),
                                optimizer=optimizer)


def train(ec, batches, grad_scale=1.0, seed=0):
    """One step per batch of ids; the gradient of each output row is a fixed random draw."""
    gen = torch.Generator().manual_seed(seed)
    dim = ec.tables["t"].dim
    for ids in batches:
        ids = torch.as_tensor(ids, dtype=torch.int64)
        out = ec(KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.tensor([ids.numel()])))
        grads = torch.randn(ids.numel(), dim, generator=gen) * grad_scale
        (out["f"].values() * grads).sum().backward()


def rows_of(ec, keys):
    rows, found = ec.read_rows("t", torch.as_tensor(keys, dtype=torch.int64))
    assert found.all()
    return rows.float()


def state_of(ec, keys):
    """The float32 optimizer state of ``keys``' device rows."""
    table = ec.tables["t"]
    return table.tier.flat.state[table.tier.hash.find(torch.as_tensor(keys))]


# -- small updates -------------------------------------------------------------------------------
def test_fp16_sgd_small_updates_move_the_row_by_their_sum():
    # Rows start at 1.0, where float16's spacing is 2^-10 above and 2^-11 below: an update of
    # lr * grad = 1e-4 is below half a spacing, so rounding to nearest never moves the row.
    lr, steps, dim = 1e-4, 100, 64
    one = Initializer(InitializerKind.CONSTANT, value=1.0)
    moved = {}
    for rounding in (True, False):
        ec = make(torch.float16, OptimizerConfig(SGD, learning_rate=lr), dim=dim,
                  initializer=one, stochastic_rounding=rounding)
        for _ in range(steps):
            out = ec(KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([7]),
                                                         torch.tensor([1])))
            out["f"].values().sum().backward()  # gradient 1 per element
        moved[rounding] = 1.0 - rows_of(ec, [7])[0]
    expected = steps * lr  # 0.01
    # Stochastic rounding: each step's rounding error is bounded by one spacing (4.9e-4) and
    # has mean 0, so the mean over 64 columns of 100 steps is within ~3e-4 (one std) of the
    # exact move; 10% of it (1e-3) leaves a wide margin.
    assert abs(moved[True].mean().item() - expected) < 0.1 * expected, moved[True]
    assert (moved[True] > 0).all()
    assert (moved[False] == 0).all()  # round to nearest loses every update


# -- Adam's state ---------------------------------------------------------------------------------
#: After 200 Adam steps (lr 1e-3, gradients ~1e-3: rows move by 0.012 on average, 0.04 at
#: most), the largest difference to float32 allowed: a few rounding spacings at |w| < 0.5
#: (float16 2.4e-4, bfloat16 2e-3) accumulated as a random walk. Measured: float16 1e-3,
#: bfloat16 7.5e-3.
ADAM_TOLERANCE = {torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", HALF)
def test_half_adam_tracks_float32_with_a_float32_second_moment(dtype):
    # Gradients of 1e-3 give (1 - beta2) * g^2 ~ 1e-9, below float16's smallest subnormal
    # (6e-8): a float16 second moment would stay 0 and each step divide m by eps.
    optimizer = OptimizerConfig(ADAM, learning_rate=1e-3)
    keys = list(range(8))
    batches = [keys] * 200
    ref = make(torch.float32, optimizer)
    train(ref, batches, grad_scale=1e-3)
    ec = make(dtype, optimizer)
    train(ec, batches, grad_scale=1e-3)
    start = torch.tensor(initial_rows(UNIFORM, keys, 16, seed=0, table_id=TABLE_T_ID))
    moved = (rows_of(ref, keys) - start).abs().mean().item()
    assert moved > 0.005, moved  # the rows really moved
    error = (rows_of(ec, keys) - rows_of(ref, keys)).abs()
    assert error.max().item() < ADAM_TOLERANCE[dtype], error.max()
    assert error.mean().item() < 0.25 * moved  # measured: float16 1.4%, bfloat16 12%
    state = state_of(ec, keys)
    assert state.dtype == torch.float32 and state.shape == (8, 32)
    second_moment = state[:, 16:]
    assert (second_moment > 0).all()
    torch.testing.assert_close(state, state_of(ref, keys), rtol=1e-6, atol=0)


# -- every optimizer through the collection -----------------------------------------------------
#: Largest difference to float32 after 200 steps on 8 keys (rows move by ~0.05-0.13):
#: stochastic rounding errors add up as a random walk of ~sqrt(200) / 2 spacings.
#: Measured max: float16 1.6e-3 (SGD) and 1.1e-3 (others); bfloat16 1.9e-2 (SGD) and
#: 7.5e-3 (others).
TRACK_TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 4e-2}
#: The same for the mean difference. Measured: float16 3e-4, bfloat16 2.6e-3.
TRACK_MEAN_TOLERANCE = {torch.float16: 1e-3, torch.bfloat16: 8e-3}
OPTIMIZERS = [OptimizerConfig(SGD, learning_rate=0.01),
              OptimizerConfig(ADAGRAD, learning_rate=0.01),
              OptimizerConfig(ROWWISE, learning_rate=0.01),
              OptimizerConfig(ADAM, learning_rate=1e-3)]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=[o.type.value for o in OPTIMIZERS])
def test_half_training_tracks_float32(optimizer, dtype):
    keys = list(range(8))
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 8, (12,), generator=gen) for _ in range(200)]
    ref = make(torch.float32, optimizer)
    train(ref, batches)
    ec = make(dtype, optimizer)
    train(ec, batches)
    assert ec.tables["t"].tier.flat.weights.dtype == dtype
    diff = (rows_of(ec, keys) - rows_of(ref, keys)).abs()
    assert diff.max().item() < TRACK_TOLERANCE[dtype], diff.max()
    assert diff.mean().item() < TRACK_MEAN_TOLERANCE[dtype], diff.mean()
    if optimizer.type is not SGD:  # gradients do not depend on the rows: same state
        state = state_of(ec, keys)
        assert state.dtype == torch.float32
        torch.testing.assert_close(state, state_of(ref, keys), rtol=1e-6, atol=0)


# -- storage modes ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF)
def test_cache_and_default_rows_equal_hbm_direct_bit_for_bit(dtype):
    optimizer = OptimizerConfig(ADAM, learning_rate=1e-2)
    dim = 7  # odd: padded before the float32 state
    row_bytes = RowLayout(dim, optimizer.state_dim(dim), dtype).row_bytes
    budget = 128 * row_bytes  # one bucket of 128 device rows for 400 keys
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 400, (96,), generator=gen) for _ in range(30)]
    results = {}
    for mode, caching, hbm in (("hbm_direct", False, None), ("cache", True, budget),
                               ("default", False, budget)):
        ec = make(dtype, optimizer, dim=dim, caching=caching, local_hbm_for_values=hbm)
        assert ec.storage_modes()["t"].value == mode
        train(ec, batches)
        results[mode] = ec.read_rows("t", torch.arange(400), with_state=True)
        if mode == "cache":
            assert ec.stats()["t"]["write_backs"] > 0 and ec.stats()["t"]["loads"] > 0
    rows, found = results["hbm_direct"]
    assert rows.dtype == torch.float32 and rows.shape == (400, dim + 2 * dim)
    for mode in ("cache", "default"):
        assert torch.equal(results[mode][1], found)
        assert torch.equal(results[mode][0], rows), mode


def test_read_rows_with_state_gives_the_logical_rows():
    optimizer = OptimizerConfig(ROWWISE, learning_rate=0.1)
    ec = make(torch.bfloat16, optimizer, dim=5)
    train(ec, [[1, 2, 3]])
    table = ec.tables["t"]
    assert table.width == 6 + 2  # 5 bfloat16 columns, 1 of padding, one float32 accumulator
    full, _ = ec.read_rows("t", torch.tensor([1, 2, 3]), with_state=True)
    embedding, _ = ec.read_rows("t", torch.tensor([1, 2, 3]))
    assert embedding.dtype == torch.bfloat16 and full.dtype == torch.float32
    assert torch.equal(full[:, :5], embedding.float())
    assert torch.equal(full[:, 5:], state_of(ec, [1, 2, 3]))
    assert (full[:, 5] > 0).all()


# -- memory ---------------------------------------------------------------------------------------
def test_built_half_table_matches_the_planner():
    from dynemb.planning import measure_allocated, table_footprint
    optimizer = OptimizerConfig(ADAM)
    config = EmbeddingConfig(name="t", embedding_dim=7, num_embeddings=1024,
                             feature_names=["f"], data_type=DataType.FP16)
    ec = DynamicEmbCollection([config], optimizer=optimizer)
    weights = ec.tables["t"].tier.flat.weights
    assert weights.shape == (1664, 8 + 28) and weights.is_contiguous()
    actual = measure_allocated(ec)["t"]
    estimate = table_footprint(config, DynamicEmbTableOptions(), optimizer)
    assert actual.values_bytes == estimate.values_bytes == 1664 * 8 * 2
    assert actual.optimizer_bytes == estimate.optimizer_bytes == 1664 * 14 * 4
