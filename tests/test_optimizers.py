"""Fused optimizers follow fbgemm's TBE optimizers, on both backends and every weight dtype;
rows of float16 / bfloat16 tables round stochastically with noise drawn from the key."""
import math
import struct
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynemb.rows.flat_table import RowLayout
from dynemb.rows.optimizers import (OptimizerConfig, OptimizerType, clip_gradients, fused_update,
                               round_rows)
from key_reference import random_bits32, update_stream

SGD, ADAM, ADAGRAD, ROWWISE = (OptimizerType.SGD, OptimizerType.ADAM, OptimizerType.ADAGRAD,
                               OptimizerType.ROWWISE_ADAGRAD)
HALF = [torch.float16, torch.bfloat16]


def flat(rows, config, dtype=torch.float32, device="cpu"):
    """[E, dim + state] table holding ``rows`` with zero state."""
    state = torch.zeros(rows.shape[0], config.state_dim(rows.shape[1]))
    return torch.cat([rows, state], 1).to(dtype=dtype, device=device)


def step_all(weights, slots, grads, config, backend, *, lr=None, steps=(1,), **kwargs):
    name, device = backend
    for step in steps:
        fused_update(weights, torch.as_tensor(slots, device=device), grads.to(device),
                     dim=grads.shape[1], config=config,
                     lr=config.learning_rate if lr is None else lr, step=step, backend=name,
                     **kwargs)


# -- 1. Against fbgemm's CPU TBE --------------------------------------------------------------

E, D = 6, 8
#: Per step: lookups (one per bag); row 2 is hit twice every step, rows 0 and 5 never.
INDICES = [[2, 1, 2, 4], [3, 2, 1, 2], [2, 4, 3, 2], [1, 2, 2, 3]]


def case_data():
    """(initial rows [E, D], per step the gradient of each lookup's output [4, D])."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(E, D, generator=gen)
    return w0, [torch.randn(len(ix), D, generator=gen) * 2 for ix in INDICES]


def fbgemm_params(params):
    """``params`` with the ``weight_decay_mode`` name replaced by fbgemm's enum."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode
    if "weight_decay_mode" in params:
        params = {**params, "weight_decay_mode": WeightDecayMode[params["weight_decay_mode"]]}
    return params


def fbgemm_case(optim_name, pooling, fused_params):
    """Train fbgemm's CPU TBE on ``case_data()``; return (final rows, final optimizer states)."""
    fbgemm = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (EmbeddingLocation,
                                                                      PoolingMode)
    w0, out_grads = case_data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tbe = fbgemm.SplitTableBatchedEmbeddingBagsCodegen(
            [(E, D, EmbeddingLocation.HOST, fbgemm.ComputeDevice.CPU)],
            optimizer=getattr(EmbOptimType, optim_name),
            pooling_mode=getattr(PoolingMode, pooling), **fbgemm_params(fused_params))
        tbe.split_embedding_weights()[0].copy_(w0)
        for ix, go in zip(INDICES, out_grads):
            out = tbe(torch.tensor(ix), torch.arange(len(ix) + 1))
            out.backward(go)
    states = tbe.split_optimizer_states()[0] if optim_name != "EXACT_SGD" else []
    return tbe.split_embedding_weights()[0].clone(), [s.clone() for s in states]


FBGEMM_CASES = [
    ("EXACT_SGD", "SUM", dict(learning_rate=0.1)),
    ("EXACT_SGD", "NONE", dict(learning_rate=0.1, gradient_clipping=True, max_gradient=1.5)),
    ("EXACT_ADAGRAD", "SUM", dict(learning_rate=0.1, eps=1e-3)),
    ("EXACT_ADAGRAD", "NONE", dict(learning_rate=0.1, gradient_clipping=True, max_gradient=1.0)),
    ("EXACT_ROWWISE_ADAGRAD", "SUM", dict(learning_rate=0.1, eps=1e-4)),
    ("EXACT_ROWWISE_ADAGRAD", "NONE", dict(learning_rate=0.1, eps=1e-4, weight_decay=0.1,
                                           weight_decay_mode="L2")),
    ("EXACT_ROWWISE_ADAGRAD", "NONE", dict(learning_rate=0.1, weight_decay=0.1,
                                           gradient_clipping=True, max_gradient=1.0)),
]


@pytest.mark.parametrize("optim_name,pooling,fused_params", FBGEMM_CASES,
                         ids=["sgd", "sgd-clip", "adagrad", "adagrad-clip", "rowwise",
                              "rowwise-l2", "rowwise-decay-ignored-clip"])
def test_matches_fbgemm_cpu_tbe(optim_name, pooling, fused_params, backend):
    want_rows, want_states = fbgemm_case(optim_name, pooling, fused_params)
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    w0, out_grads = case_data()
    config = OptimizerConfig.from_fbgemm(getattr(EmbOptimType, optim_name),
                                         **fbgemm_params(fused_params))
    weights = flat(w0, config, device=backend[1])
    for step, (ix, go) in enumerate(zip(INDICES, out_grads), start=1):
        # fbgemm clips each lookup's gradient, then sums the gradients of a row.
        slots, inverse = torch.unique(torch.tensor(ix), return_inverse=True)
        summed = torch.zeros(slots.numel(), D).index_add_(0, inverse, clip_gradients(go, config))
        step_all(weights, slots, summed, config, backend, steps=(step,))
    got = weights.cpu()
    torch.testing.assert_close(got[:, :D], want_rows, rtol=1e-5, atol=1e-5)
    assert len(want_states) == (optim_name != "EXACT_SGD")
    for state in want_states:  # AdaGrad [E, D], row-wise AdaGrad [E]
        torch.testing.assert_close(got[:, D:].reshape(state.shape), state, rtol=1e-5, atol=1e-5)


def test_clipping_case_clips_a_row_sum_above_max_gradient():
    """The clipped fbgemm cases above would fail if clipping happened after the sum."""
    per_lookup = clip_gradients(case_data()[1][0], OptimizerConfig(max_gradient=1.5))
    summed = per_lookup[0] + per_lookup[2]  # row 2, hit twice in step 1
    assert (summed.abs() > 1.5).any()


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_matches_torch_adamw(weight_decay, backend):
    """fbgemm's ADAM (w -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * w)) is AdamW; fbgemm's CPU
    TBE has no ADAM to compare with."""
    gen = torch.Generator().manual_seed(1)
    w0, grads = torch.randn(3, 5, generator=gen), torch.randn(4, 3, 5, generator=gen)
    config = OptimizerConfig(ADAM, learning_rate=0.05, eps=1e-6, beta1=0.8, beta2=0.95,
                             weight_decay=weight_decay)
    param = torch.nn.Parameter(w0.clone())
    opt = torch.optim.AdamW([param], lr=0.05, betas=(0.8, 0.95), eps=1e-6,
                            weight_decay=weight_decay)
    weights = flat(w0, config, device=backend[1])
    for step, g in enumerate(grads, start=1):
        param.grad = g.clone()
        opt.step()
        step_all(weights, [0, 1, 2], g, config, backend, steps=(step,))
    got = weights.cpu()
    torch.testing.assert_close(got[:, :5], param.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[:, 5:10], opt.state[param]["exp_avg"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[:, 10:], opt.state[param]["exp_avg_sq"], rtol=1e-5, atol=1e-7)


def test_adagrad_initial_accumulator_matches_torch(backend):
    gen = torch.Generator().manual_seed(2)
    w0, grads = torch.randn(2, 3, generator=gen), torch.randn(3, 2, 3, generator=gen)
    config = OptimizerConfig(ADAGRAD, learning_rate=0.1, eps=1e-6, initial_accumulator_value=0.5)
    param = torch.nn.Parameter(w0.clone())
    opt = torch.optim.Adagrad([param], lr=0.1, eps=1e-6, initial_accumulator_value=0.5)
    weights = flat(w0, config, device=backend[1])  # zero state = the initial accumulator
    for g in grads:
        param.grad = g.clone()
        opt.step()
        step_all(weights, [0, 1], g, config, backend)
    got = weights.cpu()
    torch.testing.assert_close(got[:, :3], param.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[:, 3:] + 0.5, opt.state[param]["sum"], rtol=1e-5, atol=1e-6)


# -- 2. One step written out --------------------------------------------------------------------

W, G = [1.0, -2.0], [3.0, 4.0]
K = 0.1 / math.sqrt(12.5)  # row-wise AdaGrad multiplier: lr / sqrt(mean(9, 16))
KD = 0.1 / math.sqrt(10.0)  # ... with weight decay 1: g + w = [4, 2], mean(16, 4) = 10
HAND = [
    # w - lr g
    (OptimizerConfig(SGD), [0.7, -2.4]),
    # acc = g^2 = [9, 16]; w - lr g / sqrt(acc) = w - lr sign(g)
    (OptimizerConfig(ADAGRAD, eps=0.0), [0.9, -2.1, 9.0, 16.0]),
    # acc = mean(g^2) = 12.5; w - K g
    (OptimizerConfig(ROWWISE, eps=0.0), [1 - 3 * K, -2 - 4 * K, 12.5]),
    # L2: acc = 10; w - KD (g + w)
    (OptimizerConfig(ROWWISE, eps=0.0, weight_decay=1.0), [1 - 4 * KD, -2 - 2 * KD, 10.0]),
    # step 1: m = 0.1 g, v = 0.001 g^2, m_hat / sqrt(v_hat) = sign(g); w - lr (sign(g) + wd w)
    (OptimizerConfig(ADAM, eps=0.0, weight_decay=0.5),
     [1 - 0.1 * 1.5, -2.0, 0.3, 0.4, 0.009, 0.016]),
]


@pytest.mark.parametrize("config,expected", HAND,
                         ids=["sgd", "adagrad", "rowwise", "rowwise-l2", "adam-decay"])
def test_single_step_by_hand(config, expected, backend):
    weights = flat(torch.tensor([W]), config, device=backend[1])
    step_all(weights, [0], torch.tensor([G]), config, backend, lr=0.1)
    torch.testing.assert_close(weights.cpu()[0], torch.tensor(expected), rtol=1e-6, atol=1e-6)


# -- 3. Backends, dtypes, arguments ---------------------------------------------------------------

CONFIGS = [OptimizerConfig(SGD), OptimizerConfig(ADAM, weight_decay=0.01, eps=1e-4),
           OptimizerConfig(ADAGRAD, eps=1e-4, initial_accumulator_value=0.1),
           OptimizerConfig(ROWWISE, eps=1e-4, weight_decay=0.05)]
IDS = [c.type.value for c in CONFIGS]


def random_case(config, dim=37, rows=7, seed=3):
    gen = torch.Generator().manual_seed(seed)
    weights = flat(torch.randn(rows, dim, generator=gen), config)
    weights[:, dim:] = torch.rand(rows, config.state_dim(dim), generator=gen)
    return weights, torch.tensor([5, -1, 0, 3, -7]), torch.randn(5, dim, generator=gen)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_backends_agree_and_skip_negative_slots(config):
    from conftest import BACKENDS
    w0, slots, grads = random_case(config)
    results = []
    for backend in BACKENDS:
        weights = w0.to(backend[1], copy=True)
        step_all(weights, slots, grads, config, backend, lr=0.1, steps=(1, 2))
        results.append(weights.cpu())
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-6)
    untouched = [1, 2, 4, 6]
    assert torch.equal(results[0][untouched], w0[untouched])
    assert not torch.equal(results[0][[0, 3, 5]], w0[[0, 3, 5]])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_half_weights_follow_float32(config, dtype, backend):
    """Half rows keep a float32 state: rounding to nearest, the embedding is the float32
    result rounded once and the state is the float32 state, bit for bit."""
    dim = 5  # odd: the embedding is padded to 6 columns before the float32 state
    w0, slots, grads = random_case(config, dim=dim)
    w0[:, :dim] = w0[:, :dim].to(dtype).float()  # the same start in both
    want = w0.to(backend[1], copy=True)
    step_all(want, slots, grads, config, backend, lr=0.1)
    layout = RowLayout(dim, config.state_dim(dim), dtype)
    weights = layout.to_physical(w0).to(backend[1])
    step_all(weights, slots, grads, config, backend, lr=0.1, stochastic_rounding=False)
    assert weights.dtype == dtype and weights.shape[1] == layout.width
    assert torch.equal(layout.embeddings(weights), want[:, :dim].to(dtype))
    assert torch.equal(layout.state(weights), want[:, dim:])


def test_half_weights_need_keys_for_stochastic_rounding():
    config = OptimizerConfig(ADAM)
    weights = torch.zeros(4, RowLayout(4, 8, torch.float16).width, dtype=torch.float16)
    with pytest.raises(ValueError, match="keys are needed"):
        fused_update(weights, torch.tensor([1]), torch.ones(1, 4), dim=4, config=config,
                     lr=0.1, step=1)
    with pytest.raises(ValueError, match=r"keys must be an int64 tensor of shape \(1,\)"):
        fused_update(weights, torch.tensor([1]), torch.ones(1, 4), dim=4, config=config,
                     lr=0.1, step=1, keys=torch.tensor([1, 2]))


def test_lr_and_step_take_effect(backend):
    config = OptimizerConfig(ADAM)
    w0, slots, grads = random_case(config, dim=4)
    results = {}
    for lr, step in [(0.1, 1), (0.2, 1), (0.1, 5), (0.0, 1)]:
        weights = w0.to(backend[1], copy=True)
        step_all(weights, slots, grads, config, backend, lr=lr, steps=(step,))
        results[lr, step] = weights.cpu()
    assert torch.equal(results[0.0, 1][:, :4], w0[:, :4])  # lr 0: weights stay, moments move
    assert not torch.equal(results[0.0, 1][:, 4:], w0[:, 4:])
    delta = {k: (r - w0)[:, :4] for k, r in results.items()}
    torch.testing.assert_close(delta[0.2, 1], 2 * delta[0.1, 1])
    assert not torch.allclose(delta[0.1, 5], delta[0.1, 1])


def test_empty_batch_is_a_no_op(backend):
    config = OptimizerConfig(ROWWISE)
    weights = flat(torch.ones(3, 4), config, device=backend[1])
    step_all(weights, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 4), config, backend)
    assert torch.equal(weights.cpu(), flat(torch.ones(3, 4), config))


@pytest.mark.parametrize("kwargs,message", [
    (dict(type="sgd"), "type must be an OptimizerType"),
    (dict(learning_rate=-0.1), "learning_rate must be >= 0"),
    (dict(learning_rate=math.inf), "learning_rate must be finite"),
    (dict(eps="1e-8"), "eps must be a number"),
    (dict(eps=-1e-8), "eps must be >= 0"),
    (dict(beta1=1.0), r"beta1 must lie in \[0, 1\)"),
    (dict(beta2=-0.1), r"beta2 must lie in \[0, 1\)"),
    (dict(type=ROWWISE, weight_decay=-1.0), "weight_decay must be >= 0"),
    (dict(type=SGD, weight_decay=0.1), "weight_decay must be 0 for sgd"),
    (dict(type=ADAGRAD, weight_decay=0.1), "weight_decay must be 0 for adagrad"),
    (dict(initial_accumulator_value=-1.0), "initial_accumulator_value must be >= 0"),
    (dict(max_gradient=0.0), "max_gradient must be > 0"),
    (dict(max_gradient=math.nan), "max_gradient must be finite"),
    (dict(learning_rate=True), "learning_rate must be a number"),
    (dict(learning_rate="0.1"), "learning_rate must be a number"),
    (dict(learning_rate=torch.tensor(0.1)), "learning_rate must be a number"),
    (dict(learning_rate=None), "learning_rate must be a number"),
    (dict(learning_rate=10 ** 400), "learning_rate must be finite"),
    (dict(beta1="0.9"), "beta1 must be a number"),
    (dict(beta2=math.nan), "beta2 must be finite"),
    (dict(weight_decay=False), "weight_decay must be a number"),
    (dict(initial_accumulator_value=-math.inf), "initial_accumulator_value must be finite"),
    (dict(max_gradient="1.0"), "max_gradient must be a number"),
    (dict(max_gradient=True), "max_gradient must be a number"),
])
def test_bad_config(kwargs, message):
    error = TypeError if "must be a number" in message or "OptimizerType" in message else (
        ValueError)
    with pytest.raises(error, match=message):
        OptimizerConfig(**kwargs)


def test_hyperparameters_are_stored_as_floats():
    import numpy as np
    cfg = OptimizerConfig(learning_rate=1, eps=np.float32(0.5), max_gradient=2)
    assert [type(v) for v in (cfg.learning_rate, cfg.eps, cfg.max_gradient)] == [float] * 3
    assert (cfg.learning_rate, cfg.eps, cfg.max_gradient) == (1.0, 0.5, 2.0)


@pytest.mark.parametrize("key", ["learning_rate", "eps", "beta1", "weight_decay",
                                 "max_gradient"])
@pytest.mark.parametrize("bad", ["0.1", True])
def test_from_fbgemm_refuses_fused_params_that_are_not_numbers(key, bad):
    O = pytest.importorskip("fbgemm_gpu.split_embedding_configs").EmbOptimType
    params = {key: bad, "gradient_clipping": True, "weight_decay_mode": 1}
    with pytest.raises(TypeError, match=rf"fused_params\['{key}'\] must be a number"):
        OptimizerConfig.from_fbgemm(O.ADAM, **params)


def test_state_dim():
    assert [OptimizerConfig(t).state_dim(8) for t in (SGD, ADAM, ADAGRAD, ROWWISE)] == [0, 16, 8, 1]
    with pytest.raises(ValueError, match="dim must be positive"):
        OptimizerConfig().state_dim(0)


def test_bad_fused_update_arguments():
    config = OptimizerConfig(ROWWISE)
    weights, slots, grads = torch.zeros(4, 5), torch.tensor([0, 3]), torch.zeros(2, 4)

    def call(**kw):
        args = dict(weights=weights, slots=slots, grads=grads, dim=4, config=config, lr=0.1,
                    step=1)
        fused_update(**{**args, **kw})

    with pytest.raises(ValueError, match=r"weights must be \[C, W\] with W >= 5"):
        call(weights=torch.zeros(4, 4))
    with pytest.raises(TypeError, match="weights must have a dtype"):
        call(weights=torch.zeros(4, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="grads must be a float tensor of shape"):
        call(grads=torch.zeros(2, 3))
    with pytest.raises(TypeError, match="slots must be a 1-D int64 tensor"):
        call(slots=torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="slots must be < 4"):
        call(slots=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="step must be positive"):
        call(step=0)
    with pytest.raises(TypeError, match="config must be an OptimizerConfig"):
        call(config="sgd")
    with pytest.raises(ValueError, match="backend must be 'cpu' or 'cuda'"):
        call(backend="tpu")


def test_from_fbgemm():
    O = pytest.importorskip("fbgemm_gpu.split_embedding_configs").EmbOptimType
    cfg = OptimizerConfig.from_fbgemm(O.ADAM, learning_rate=0.5, eps=1e-6, beta1=0.8,
                                      beta2=0.9, weight_decay=0.1, stochastic_rounding=False)
    assert cfg == OptimizerConfig(ADAM, learning_rate=0.5, eps=1e-6, beta1=0.8, beta2=0.9,
                                  weight_decay=0.1)
    assert OptimizerConfig.from_fbgemm(O.EXACT_SGD).type is SGD
    # fbgemm ignores weight decay for exact SGD / AdaGrad, and for row-wise AdaGrad in mode NONE.
    assert OptimizerConfig.from_fbgemm(O.EXACT_ADAGRAD, weight_decay=0.1).weight_decay == 0
    assert OptimizerConfig.from_fbgemm(O.EXACT_ROWWISE_ADAGRAD, weight_decay=0.1).weight_decay == 0
    l2 = OptimizerConfig.from_fbgemm(O.EXACT_ROWWISE_ADAGRAD, weight_decay=0.1, weight_decay_mode=1)
    assert l2.weight_decay == 0.1
    assert OptimizerConfig.from_fbgemm(O.EXACT_SGD, max_gradient=2.0).max_gradient is None
    assert OptimizerConfig.from_fbgemm(O.EXACT_SGD, gradient_clipping=True).max_gradient == 1.0
    with pytest.raises(ValueError, match="LAMB is not supported"):
        OptimizerConfig.from_fbgemm(O.LAMB)
    with pytest.raises(ValueError, match="weight_decay_mode 2 is not supported"):
        OptimizerConfig.from_fbgemm(O.EXACT_ROWWISE_ADAGRAD, weight_decay=0.1, weight_decay_mode=2)
    with pytest.raises(ValueError, match="max_norm"):
        OptimizerConfig.from_fbgemm(O.EXACT_ROWWISE_ADAGRAD, max_norm=1.0)
    with pytest.raises(ValueError, match="fused_params\\['optimizer'\\]"):
        OptimizerConfig.from_fbgemm(O.EXACT_SGD, optimizer=O.ADAM)


# -- rounding to float16 / bfloat16 -----------------------------------------------------------------------
def _neighbours(x, dtype):
    """The representable values just below and above float32 ``x`` (finite, in range)."""
    near = x.to(dtype)
    below = torch.where(near.float() <= x, near, torch.nextafter(near, near.new_tensor(-1e30)))
    above = torch.where(near.float() >= x, near, torch.nextafter(near, near.new_tensor(1e30)))
    return below.float(), above.float()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("value", [1.0 + 0.3 * 2 ** -7, -3.7e-3, 1e-6, -2.5e-7, 60000.0 + 7.0])
def test_stochastic_rounding_is_unbiased(dtype, value):
    n = 40_000
    x = torch.full((n // 100, 100), value)
    got = round_rows(x, dtype, keys=torch.arange(n // 100), step=3).float()
    below, above = _neighbours(x[:1, :1], dtype)
    below, above = below.item(), above.item()
    assert below < value < above
    assert ((got == below) | (got == above)).all()
    p = (value - below) / (above - below)
    # the mean of n Bernoulli(p) draws: 5 standard deviations
    tolerance = 5 * (above - below) * (p * (1 - p) / n) ** 0.5
    assert abs(got.double().mean().item() - value) < tolerance


@pytest.mark.parametrize("dtype", HALF)
def test_representable_values_round_to_themselves(dtype):
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-2 ** 15, 2 ** 15, (64, 256), generator=gen, dtype=torch.int32)
    values = bits.to(torch.int16).view(dtype)
    values = torch.where(values.isnan(), torch.zeros_like(values), values)  # inf stays in
    got = round_rows(values.float(), dtype, keys=torch.arange(64), step=1)
    assert torch.equal(got.view(torch.int16), values.view(torch.int16))


@pytest.mark.parametrize("dtype", HALF)
def test_round_to_nearest_equals_torch(dtype):
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-2 ** 31, 2 ** 31, (200, 500), generator=gen, dtype=torch.int64)
    edges = torch.tensor([65504.0, 65519.99, 65520.0, 65535.9, 65536.0, 3.4028235e38,
                          2.0 ** -24, 2.0 ** -25, 1.5 * 2.0 ** -25, 2.0 ** -126, 1e-45, 0.0,
                          float("inf"), float("nan")])
    x = torch.cat([bits.to(torch.int32).view(torch.float32).flatten(), edges, -edges,
                   torch.logspace(-40, 39, 10_000)])[:, None]
    got = round_rows(x, dtype, keys=torch.zeros(x.shape[0], dtype=torch.int64), step=1,
                     stochastic=False)
    want = x.to(dtype)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


@pytest.mark.parametrize("dtype", HALF)
def test_stochastic_rounding_keeps_inf_and_nan_and_overflows_to_inf(dtype):
    x = torch.tensor([[float("inf"), -float("inf"), float("nan"), 3e38, -3.4e38, 1e39]])
    got = round_rows(x, dtype, keys=torch.tensor([1]), step=1).float()[0]
    assert got[0] == float("inf") and got[1] == -float("inf") and got[2].isnan()
    if dtype == torch.float16:
        assert got[3] == float("inf") and got[4] == -float("inf")
    assert got[5] == float("inf")


def _bfloat16_reference(x: float, key: int, step: int, seed: int, table_id: int, column: int):
    """The 16 bits of ``x`` rounded stochastically: up when the top 16 of the element's 32
    random bits fall below the 16 bits that bfloat16 drops."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    sign, magnitude = bits >> 16 & 0x8000, bits & 0x7FFFFFFF
    rand = random_bits32(update_stream(seed, table_id, key, step), column)
    return sign | ((magnitude >> 16) + ((rand >> 16) < (magnitude & 0xFFFF)))


def test_bfloat16_rounding_draws_from_the_key_update_stream(backend):
    name, device = backend
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 8, generator=gen) * torch.logspace(-30, 30, 8)
    keys = torch.tensor([0, 1, -1, 2**62 + 7, -(2**63) + 2, 12345])
    got = round_rows(x.to(device), torch.bfloat16, keys=keys.to(device), step=9, seed=4,
                     table_id=2**40 + 3, backend=name).cpu()
    want = [[_bfloat16_reference(x[i, j].item(), keys[i].item(), 9, 4, 2**40 + 3, j)
             for j in range(8)] for i in range(6)]
    assert (got.view(torch.int16).int() & 0xFFFF).tolist() == want


def test_rounding_noise_follows_key_step_and_column_only():
    x = torch.full((3, 64), 1.0 + 2 ** -12)  # a quarter of a float16 spacing above 1.0
    keys = torch.tensor([5, 9, 5])
    first = round_rows(x, torch.float16, keys=keys, step=4, seed=1, table_id=2)
    again = round_rows(x[[2, 1, 0]], torch.float16, keys=keys[[2, 1, 0]], step=4, seed=1,
                       table_id=2)
    assert torch.equal(first, again[[2, 1, 0]])
    assert torch.equal(first[0], first[2])  # the same key, at another position
    assert not torch.equal(first[0], first[1])
    for other in (dict(step=5, seed=1, table_id=2), dict(step=4, seed=2, table_id=2),
                  dict(step=4, seed=1, table_id=3)):
        assert not torch.equal(round_rows(x, torch.float16, keys=keys, **other), first)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("stochastic", [True, False])
def test_cpu_and_cuda_kernels_round_alike(dtype, stochastic):
    from conftest import BACKENDS
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(24, 16, generator=gen) * torch.logspace(-9, 4, 16)
    keys = torch.randint(-2 ** 62, 2 ** 62, (24,), generator=gen)
    got = [round_rows(x.to(device), dtype, keys=keys.to(device), step=11, seed=3,
                      table_id=1, stochastic=stochastic, backend=name).cpu()
           for name, device in BACKENDS]
    assert torch.equal(got[0].view(torch.int16), got[1].view(torch.int16))


def test_fused_update_rounds_by_key_not_by_slot():
    optimizer = OptimizerConfig(SGD)
    grads = torch.full((2, 8), 1.0)
    rows = {}
    for slots in ([0, 1], [3, 2]):
        weights = torch.ones(4, 8, dtype=torch.float16)
        fused_update(weights, torch.tensor(slots), grads, dim=8, config=optimizer, lr=1e-4,
                     step=1, keys=torch.tensor([10, 20]), seed=0, table_id=0)
        rows[tuple(slots)] = weights[slots]
    assert torch.equal(rows[0, 1], rows[3, 2])
    assert (rows[0, 1] < 1).any()  # some columns rounded down by a whole spacing


# -- Occurrence gradients: summed, clipped and scaled inside the kernel -----------------------

def _occurrences(seed, rows=7, n=40, dim=8):
    g = torch.Generator().manual_seed(seed)
    inverse = torch.randint(0, rows - 1, (n,), generator=g)  # the last row has none
    src = torch.randn(n, dim, generator=g) * 3
    scale = torch.rand(n, generator=g) + 0.5
    return inverse, src, scale


@pytest.mark.parametrize("opt", [SGD, ADAM, ADAGRAD, ROWWISE])
@pytest.mark.parametrize("clip,scaled", [(None, False), (1.0, False), (0.7, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_occurrence_grads_equal_their_hand_summed_rows(backend, opt, clip, scaled, dtype):
    from dynemb.rows.optimizers import OccurrenceGrads
    name, device = backend
    inverse, src, scale = _occurrences(3)
    rows, dim = 7, src.shape[1]
    # reference: clamp each occurrence, scale it, sum per row by a Python loop
    summed = torch.zeros(rows, dim)
    for i, u in enumerate(inverse.tolist()):
        x = src[i].clamp(-clip, clip) if clip is not None else src[i]
        summed[u] += x * (scale[i] if scaled else 1.0)
    config = OptimizerConfig(opt, learning_rate=0.1, weight_decay=0.01 if opt is ROWWISE else 0)
    start = torch.randn(10, dim, generator=torch.Generator().manual_seed(4))
    slots = torch.tensor([9, 0, 4, 2, -1, 7, 5], device=device)
    keys = torch.arange(rows, device=device)
    layout = RowLayout(dim, config.state_dim(dim), dtype)
    initial = layout.to_physical(flat(start, config)).to(device)
    expected, got = initial.clone(), initial.clone()
    for step in (1, 2):
        fused_update(expected, slots, summed.to(device), dim=dim, config=config, lr=0.1,
                     step=step, backend=name, keys=keys)
        occ = OccurrenceGrads.from_inverse(src.to(device), inverse.to(device), rows,
                                           scale=scale.to(device) if scaled else None,
                                           clip=clip)
        fused_update(got, slots, occ, dim=dim, config=config, lr=0.1, step=step, backend=name,
                     keys=keys)
    # bfloat16: one rounding step apart at most where the two sums differ in the last bit
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(layout.to_logical(got), layout.to_logical(expected), rtol=tol,
                               atol=tol)
    assert not torch.equal(got, initial)


# rows around the CUDA kernel's piece size (optim_cuda.PIECE = 64 occurrences) and far above
HOT_COUNTS = [0, 1, 5, 63, 64, 65, 128, 129, 700]


def _hot_rows(seed=11, dim=40):
    g = torch.Generator().manual_seed(seed)
    inverse = torch.repeat_interleave(torch.arange(len(HOT_COUNTS)), torch.tensor(HOT_COUNTS))
    inverse = inverse[torch.randperm(inverse.numel(), generator=g)]
    src = torch.randn(inverse.numel(), dim, generator=g)
    scale = torch.rand(inverse.numel(), generator=g) + 0.5
    return inverse, src, scale


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 40), min_size=1, max_size=30), piece=st.integers(1, 9))
def test_hot_row_pieces_cut_each_long_row_in_order(counts, piece):
    """The CUDA update's layout of pieces against a Python model: rows of more than
    ``piece`` occurrences are cut into ``ceil(count / piece)`` pieces, numbered row by row;
    the padding past the last piece belongs to no row."""
    from dynemb.backends.cuda_backend import CudaBackend
    from conftest import BACKENDS
    offsets = torch.tensor([0] + counts).cumsum(0).to(BACKENDS[1][1])
    layout = CudaBackend()._hot_row_layout(offsets, sum(counts), piece)
    piece_row, piece_end, piece_count = (t.cpu() for t in layout)
    want_rows = [r for r, c in enumerate(counts) if c > piece for _ in range(-(-c // piece))]
    if sum(counts) <= piece:
        assert piece_row.numel() == 0 and not piece_count.any()
        return
    model_counts = [-(-c // piece) if c > piece else 0 for c in counts]
    assert piece_count.tolist() == model_counts
    assert piece_end.tolist() == [sum(model_counts[:r + 1]) for r in range(len(counts))]
    assert piece_row.numel() >= len(want_rows)  # the bound holds
    assert piece_row[:len(want_rows)].tolist() == want_rows
    assert (piece_row[len(want_rows):] >= len(counts)).all()


@pytest.mark.parametrize("opt", [SGD, ROWWISE])
def test_rows_with_hundreds_of_occurrences_sum_them_all(backend, opt):
    """The CUDA kernel sums a row of more than 64 occurrences in pieces, each by its own
    warp: every occurrence counts once, against a float64 sum by hand."""
    from dynemb.rows.optimizers import OccurrenceGrads
    name, device = backend
    inverse, src, scale = _hot_rows()
    rows, dim = len(HOT_COUNTS), src.shape[1]
    summed = torch.zeros(rows, dim, dtype=torch.float64)
    summed.index_add_(0, inverse, (src.clamp(-1.5, 1.5) * scale.unsqueeze(1)).double())
    config = OptimizerConfig(opt, learning_rate=0.1)
    initial = flat(torch.randn(rows, dim, generator=torch.Generator().manual_seed(2)), config)
    slots = torch.arange(rows, device=device)
    expected, got = initial.to(device, copy=True), initial.to(device, copy=True)
    fused_update(expected, slots, summed.float().to(device), dim=dim, config=config, lr=0.1,
                 step=1, backend=name)
    occ = OccurrenceGrads.from_inverse(src.to(device), inverse.to(device), rows,
                                       scale=scale.to(device), clip=1.5)
    fused_update(got, slots, occ, dim=dim, config=config, lr=0.1, step=1, backend=name)
    torch.testing.assert_close(got.cpu(), expected.cpu(), rtol=1e-5, atol=1e-5)
    assert not torch.equal(got.cpu()[1:], initial[1:])


def test_a_hot_rows_update_does_not_depend_on_the_other_rows(backend):
    """A row's gradient is the same float32 sum in any batch (the CUDA pieces are cut per
    row): the grouped and the one-table paths update it bit for bit alike."""
    from dynemb.rows.optimizers import OccurrenceGrads
    name, device = backend
    inverse, src, _ = _hot_rows()
    hot = len(HOT_COUNTS) - 1
    mine = inverse == hot
    config = OptimizerConfig(ROWWISE, learning_rate=0.1)
    initial = flat(torch.randn(2, src.shape[1], generator=torch.Generator().manual_seed(5)),
                   config)
    results = []
    # the whole batch (rows before the hot one shift its pieces' places), then the row alone
    for batch_inverse, batch_src, rows, slot_of_hot in [(inverse, src, hot + 1, hot),
                                                        (inverse[mine] * 0, src[mine], 1, 0)]:
        slots = torch.full((rows,), -1)
        slots[slot_of_hot] = 1
        weights = initial.to(device, copy=True)
        occ = OccurrenceGrads.from_inverse(batch_src.to(device), batch_inverse.to(device), rows)
        fused_update(weights, slots.to(device), occ, dim=src.shape[1], config=config, lr=0.1,
                     step=1, backend=name)
        results.append(weights[1].cpu())
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("rows,n", [(1, 0), (5, 1), (64, 1000), (1000, 64)])
def test_occurrence_csr_lists_each_rows_positions_in_order(rows, n):
    from dynemb.backends.numba_backends import get_backend
    inverse = torch.randint(0, rows, (n,), generator=torch.Generator().manual_seed(n))
    expected_order = [i for u in range(rows) for i in range(n) if inverse[i] == u]
    expected_offsets = [0]
    for u in range(rows):
        expected_offsets.append(expected_offsets[-1] + int((inverse == u).sum()))
    for name in ("cpu", "cuda"):  # a numba counting sort, a torch sort (on CPU tensors here)
        offsets, order = get_backend(name).occurrence_csr(inverse, rows)
        assert offsets.tolist() == expected_offsets and order.tolist() == expected_order


def test_occurrence_grads_of_the_wrong_shape_are_refused():
    from dynemb.rows.optimizers import OccurrenceGrads
    occ = OccurrenceGrads.from_inverse(torch.ones(3, 4), torch.tensor([0, 1, 1]), 2)
    weights = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="3 rows of width 4, got 2 rows"):
        fused_update(weights, torch.tensor([0, 1, 2]), occ, dim=4,
                     config=OptimizerConfig(SGD), lr=0.1, step=1)
    with pytest.raises(ValueError, match="2 rows of width 8"):
        fused_update(torch.zeros(4, 8), torch.tensor([0, 1]), occ, dim=8,
                     config=OptimizerConfig(SGD), lr=0.1, step=1)
    assert not weights.any()
