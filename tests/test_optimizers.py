"""Fused optimizers follow fbgemm's TBE optimizers, on both backends and every weight dtype."""
import math
import warnings

import pytest
import torch

from dynemb.flat_table import RowLayout
from dynemb.optimizers import OptimizerConfig, OptimizerType, clip_gradients, fused_update

SGD, ADAM, ADAGRAD, ROWWISE = (OptimizerType.SGD, OptimizerType.ADAM, OptimizerType.ADAGRAD,
                               OptimizerType.ROWWISE_ADAGRAD)


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


def test_fbgemm_cpu_tbe_has_no_adam():
    """ADAM runs on GPU only in fbgemm; on CPU ours is checked against torch's AdamW below."""
    pytest.importorskip("fbgemm_gpu")
    with pytest.raises(AssertionError, match="not supported in CPU mode"):
        fbgemm_case("ADAM", "SUM", dict(learning_rate=0.1))


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_matches_torch_adamw(weight_decay, backend):
    """fbgemm's ADAM (w -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * w)) is AdamW."""
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
])
def test_bad_config(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        OptimizerConfig(**kwargs)


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
