"""Twin tests: DynamicEmbCollection against TorchRec's EmbeddingCollection trained by fbgemm's
fused CPU optimizers, from the same initial rows, on the same batches, in every storage mode.

CACHE runs with a 128-row cache over a 600-id working set, so every step evicts, writes back
and reloads rows. fbgemm's CPU TBE has no ADAM; Adam is checked against torch's SparseAdam
on an ``nn.Embedding`` (same update up to where eps enters: relative 1e-6 here).
"""
import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, Initializer, InitializerKind,
                    OptimizerConfig, OptimizerType, StorageMode)
from tests.torchrec_twin import TorchRecTwin, same_batches

NUM_IDS = 600
BATCH = 8
STEPS = 22
CACHE_ROWS = 128
FEATURES = ["f0", "f1", "f2"]
INIT = Initializer(InitializerKind.UNIFORM, low=-0.1, high=0.1)


def _tables():
    return [EmbeddingConfig(name="t0", embedding_dim=8, num_embeddings=NUM_IDS,
                            feature_names=["f0", "f1"]),  # a shared table
            EmbeddingConfig(name="t1", embedding_dim=8, num_embeddings=NUM_IDS,
                            feature_names=["f2"])]


def _options(mode: str, config: OptimizerConfig, cache_rows: int = CACHE_ROWS):
    out = {}
    for t in _tables():
        width = t.embedding_dim + config.state_dim(t.embedding_dim)
        budget = None if mode == "hbm_direct" else cache_rows * width * 4
        out[t.name] = DynamicEmbTableOptions(
            caching=mode == "cache", local_hbm_for_values=budget, max_capacity=2048,
            bucket_size=16, initializer=INIT, seed=3)
    return out


def _initial_rows(ec: DynamicEmbCollection):
    """The rows both models start from (what ``ec`` gives a new id)."""
    ids = torch.arange(NUM_IDS)
    return {name: t.options.initializer.rows(ids, t.dim, seed=t.options.seed,
                                             table_id=t.table_id)
            for name, t in ec.tables.items()}


def _kjt(lengths, values):
    return KeyedJaggedTensor.from_lengths_sync(FEATURES, values, lengths)


def _loss(out, targets):
    return sum(((jt.values() - targets[f]) ** 2).sum() * 0.5 + jt.values().sum()
               for f, jt in out.items())


def _targets():
    g = torch.Generator().manual_seed(7)
    return {"f0": torch.randn(8, generator=g), "f1": torch.randn(8, generator=g),
            "f2": torch.randn(8, generator=g)}


OPTIMIZERS = {
    "sgd": (OptimizerConfig(OptimizerType.SGD, learning_rate=0.05),
            {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.05}),
    "adagrad": (OptimizerConfig(OptimizerType.ADAGRAD, learning_rate=0.05, eps=1e-6),
                {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.05, "eps": 1e-6}),
    "rowwise_adagrad": (
        OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD, learning_rate=0.05, eps=1e-6,
                        weight_decay=0.01),
        {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-6,
         "weight_decay": 0.01, "weight_decay_mode": WeightDecayMode.L2}),
    "sgd_clipped": (OptimizerConfig(OptimizerType.SGD, learning_rate=0.05, max_gradient=0.5),
                    {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.05,
                     "gradient_clipping": True, "max_gradient": 0.5}),
}


def _train_both(mode, opt_name, prefetch_ahead=0, cache_rows=CACHE_ROWS):
    config, fused = OPTIMIZERS[opt_name]
    dyn = DynamicEmbCollection(_tables(), table_options=_options(mode, config, cache_rows),
                               optimizer=config)
    assert set(dyn.storage_modes().values()) == {StorageMode(mode)}
    twin = TorchRecTwin(_tables(), _initial_rows(dyn), fused)
    targets = _targets()
    batches = [_kjt(*b) for b in same_batches(STEPS, FEATURES, NUM_IDS, BATCH, seed=11)]
    for b in batches[:prefetch_ahead]:
        dyn.prefetch(b)
    for step, kjt in enumerate(batches):
        if step == STEPS // 2:  # the learning rate is adjustable between steps
            dyn.fused_optimizer.param_groups[0]["lr"] = config.learning_rate / 2
            twin.set_learning_rate(config.learning_rate / 2)
        if step + prefetch_ahead < STEPS:
            dyn.prefetch(batches[step + prefetch_ahead])
        out, ref = dyn(kjt), twin(kjt)
        for f in FEATURES:
            torch.testing.assert_close(out[f].values(), ref[f].values(), rtol=1e-4, atol=1e-5)
            assert torch.equal(out[f].lengths(), ref[f].lengths())
        loss, ref_loss = _loss(out, targets), _loss(ref, targets)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-4)
        loss.backward()
        ref_loss.backward()
    return dyn, twin, batches


def _ids_seen(batches):
    seen = {"t0": set(), "t1": set()}
    for kjt in batches:
        for f, jt in kjt.to_dict().items():
            seen["t1" if f == "f2" else "t0"].update(jt.values().tolist())
    return seen


def _assert_same_rows(dyn, twin, batches):
    ids = torch.arange(NUM_IDS)
    expected = _ids_seen(batches)
    for name, ref in twin.weights().items():
        rows, found = dyn.read_rows(name, ids)
        seen = found.nonzero().squeeze(1)
        assert set(seen.tolist()) == expected[name]  # no row lost, none invented
        torch.testing.assert_close(rows[seen], ref[seen], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["hbm_direct", "cache", "default"])
@pytest.mark.parametrize("opt_name", ["sgd", "adagrad", "rowwise_adagrad"])
def test_twin_matches_torchrec(mode, opt_name):
    dyn, twin, batches = _train_both(mode, opt_name)
    _assert_same_rows(dyn, twin, batches)
    stats = dyn.stats()["t0"]
    if mode == "cache":
        assert stats["rows_device"] == CACHE_ROWS
        assert stats["evictions"] >= STEPS * 5 and stats["write_backs"] == stats["evictions"]
        assert stats["loads"] > 0
    if mode == "default":
        assert 0 < stats["rows_device"] <= CACHE_ROWS and stats["rows_backing"] > 0


def test_twin_with_gradient_clipping():
    dyn, twin, batches = _train_both("cache", "sgd_clipped")
    _assert_same_rows(dyn, twin, batches)


@pytest.mark.parametrize("mode", ["hbm_direct", "cache"])
def test_twin_with_two_prefetches_outstanding(mode):
    # three batches pinned at once need more than 8 buckets of 16 rows
    dyn, twin, batches = _train_both(mode, "rowwise_adagrad", prefetch_ahead=2, cache_rows=384)
    _assert_same_rows(dyn, twin, batches)
    assert dyn.pending_prefetches == 0


@pytest.mark.parametrize("mode", ["hbm_direct", "cache", "default"])
def test_adam_matches_sparse_adam(mode):
    config = OptimizerConfig(OptimizerType.ADAM, learning_rate=0.01, eps=1e-8)
    dyn = DynamicEmbCollection(_tables(), table_options=_options(mode, config), optimizer=config)
    initial = _initial_rows(dyn)
    ref = {name: torch.nn.Embedding.from_pretrained(rows.clone(), freeze=False, sparse=True)
           for name, rows in initial.items()}
    ref_opt = torch.optim.SparseAdam([e.weight for e in ref.values()], lr=0.01, eps=1e-8)
    table_of = {"f0": "t0", "f1": "t0", "f2": "t1"}
    targets = _targets()
    for lengths, values in same_batches(STEPS, FEATURES, NUM_IDS, BATCH, seed=5):
        kjt = _kjt(lengths, values)
        out = dyn(kjt)
        ref_out = {f: jt.values() for f, jt in kjt.to_dict().items()}
        ref_out = {f: ref[table_of[f]](ids) for f, ids in ref_out.items()}
        loss = _loss(out, targets)
        ref_loss = sum(((v - targets[f]) ** 2).sum() * 0.5 + v.sum() for f, v in ref_out.items())
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-4)
        loss.backward()
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
    ids = torch.arange(NUM_IDS)
    for name, emb in ref.items():
        rows, found = dyn.read_rows(name, ids)
        # Adam's step m / sqrt(v) is ill-conditioned where a gradient sums to about zero:
        # float32 rounding in another order moves such an element by up to a few 1e-5
        torch.testing.assert_close(rows[found], emb.weight.detach()[found], rtol=1e-4, atol=5e-5)
