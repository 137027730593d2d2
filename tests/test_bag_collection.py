"""Twin tests: DynamicEmbBagCollection against TorchRec's EmbeddingBagCollection trained by
fbgemm's fused CPU optimizers (row-wise sharded on one gloo rank: TorchRec's fused CPU TBE),
from the same initial rows, on the same batches, in every storage mode; Adam against torch's
``F.embedding_bag`` with SparseAdam. Plus bad input, a state_dict round trip and read-only
eval lookups.

Table t0 is shared by features f0 and f1, t1 reads f2. Bags hold 0 to 4 ids (some empty),
and at one step f2 has no id at all. CACHE runs with a 128-row cache over a 600-id working
set, so every step evicts, writes back and reloads rows.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from dynemb import (DynamicEmbBagCollection, DynamicEmbCollection, DynamicEmbTableOptions,
                    FrequencyAdmission, Initializer, InitializerKind, OptimizerConfig,
                    OptimizerType, ScorePolicy, StashMode, StorageMode)
from tests.torchrec_twin import TorchRecTwin, same_batches

NUM_IDS = 600
BATCH = 8
STEPS = 22
CACHE_ROWS = 128
FEATURES = ["f0", "f1", "f2"]
TABLE_OF = {"f0": "t0", "f1": "t0", "f2": "t1"}
DIM = 8
INIT = Initializer(InitializerKind.UNIFORM, low=-0.1, high=0.1)
MODES = ["hbm_direct", "cache", "default"]

#: pooling of (t0, t1) and whether the KJT carries weights
POOLINGS = {
    "sum": (PoolingType.SUM, PoolingType.SUM, False),
    "mean": (PoolingType.MEAN, PoolingType.SUM, False),  # a MEAN and a SUM table side by side
    "weighted": (PoolingType.SUM, PoolingType.SUM, True),
}

OPTIMIZERS = {
    "sgd": (OptimizerConfig(OptimizerType.SGD, learning_rate=0.05),
            {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.05}),
    "adagrad": (OptimizerConfig(OptimizerType.ADAGRAD, learning_rate=0.05, eps=1e-6),
                {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.05, "eps": 1e-6}),
    # no weight decay: fbgemm's pooled CPU row-wise AdaGrad ignores it (its sequence path
    # and dynemb apply L2 decay once per row and step; test_collection_twin checks that)
    "rowwise_adagrad": (
        OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD, learning_rate=0.05, eps=1e-6),
        {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-6}),
    "sgd_clipped": (OptimizerConfig(OptimizerType.SGD, learning_rate=0.05, max_gradient=0.5),
                    {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.05,
                     "gradient_clipping": True, "max_gradient": 0.5}),
}


def _tables(pooling="mean"):
    p0, p1, _ = POOLINGS[pooling]
    return [EmbeddingBagConfig(name="t0", embedding_dim=DIM, num_embeddings=NUM_IDS,
                               feature_names=["f0", "f1"], pooling=p0),
            EmbeddingBagConfig(name="t1", embedding_dim=DIM, num_embeddings=NUM_IDS,
                               feature_names=["f2"], pooling=p1)]


def _options(mode, config, cache_rows=CACHE_ROWS):
    width = DIM + config.state_dim(DIM)
    budget = None if mode == "hbm_direct" else cache_rows * width * 4
    return DynamicEmbTableOptions(caching=mode == "cache", local_hbm_for_values=budget,
                                  max_capacity=2048, bucket_size=16, initializer=INIT, seed=3)


def _module(pooling, mode, config, cache_rows=CACHE_ROWS):
    ebc = DynamicEmbBagCollection(_tables(pooling), is_weighted=POOLINGS[pooling][2],
                                  table_options=_options(mode, config, cache_rows),
                                  optimizer=config)
    assert set(ebc.storage_modes().values()) == {StorageMode(mode)}
    return ebc


def _initial_rows(ebc):
    """The rows both models start from (what ``ebc`` gives a new id)."""
    ids = torch.arange(NUM_IDS)
    return {name: t.options.initializer.rows(ids, t.dim, seed=t.options.seed,
                                             table_id=t.table_id)
            for name, t in ebc.tables.items()}


def _batches(weighted, seed=11, steps=STEPS, batch=BATCH):
    """KJTs of ``steps`` steps; at step 3 feature f2 has no id in any sample."""
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for step, (lengths, values) in enumerate(same_batches(steps, FEATURES, NUM_IDS, batch,
                                                          seed=seed)):
        if step == 3:
            keep = int(lengths[:2 * batch].sum())
            lengths, values = lengths.clone(), values[:keep]
            lengths[2 * batch:] = 0
        weights = torch.rand(values.numel(), generator=g) + 0.5 if weighted else None
        out.append(KeyedJaggedTensor.from_lengths_sync(FEATURES, values, lengths, weights))
    return out


def _targets():
    return torch.randn(3 * DIM, generator=torch.Generator().manual_seed(7))


def _loss(out: KeyedTensor, targets):
    values = out.values()
    return ((values - targets) ** 2).sum() * 0.5 + values.sum()


def _train_both(pooling, mode, opt_name, prefetch_ahead=0, cache_rows=CACHE_ROWS):
    config, fused = OPTIMIZERS[opt_name]
    dyn = _module(pooling, mode, config, cache_rows)
    twin = TorchRecTwin(_tables(pooling), _initial_rows(dyn), fused, pooled=True,
                        is_weighted=POOLINGS[pooling][2])
    targets = _targets()
    batches = _batches(POOLINGS[pooling][2])
    for b in batches[:prefetch_ahead]:
        dyn.prefetch(b)
    for step, kjt in enumerate(batches):
        if step == STEPS // 2:  # the learning rate is adjustable between steps
            dyn.fused_optimizer.param_groups[0]["lr"] = config.learning_rate / 2
            twin.set_learning_rate(config.learning_rate / 2)
        if step + prefetch_ahead < STEPS:
            dyn.prefetch(batches[step + prefetch_ahead])
        out, ref = dyn(kjt), twin(kjt)
        assert out.keys() == ref.keys() == FEATURES
        assert out.length_per_key() == [DIM] * 3
        torch.testing.assert_close(out.values(), ref.values(), rtol=1e-5, atol=1e-6)
        empty = (kjt.lengths().view(3, BATCH) == 0).nonzero().tolist()
        assert empty and all(not out[FEATURES[f]][b].any() for f, b in empty)
        loss, ref_loss = _loss(out, targets), _loss(ref, targets)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-4)
        loss.backward()
        ref_loss.backward()
    return dyn, twin, batches


def _ids_seen(batches):
    seen = {"t0": set(), "t1": set()}
    for kjt in batches:
        for f, jt in kjt.to_dict().items():
            seen[TABLE_OF[f]].update(jt.values().tolist())
    return seen


def _assert_same_rows(dyn, twin, batches):
    ids = torch.arange(NUM_IDS)
    expected = _ids_seen(batches)
    for name, ref in twin.weights().items():
        rows, found = dyn.read_rows(name, ids)
        seen = found.nonzero().squeeze(1)
        assert set(seen.tolist()) == expected[name]  # no row lost, none invented
        torch.testing.assert_close(rows[seen], ref[seen], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("opt_name", ["sgd", "adagrad", "rowwise_adagrad"])
def test_twin_matches_torchrec(mode, opt_name):
    dyn, twin, batches = _train_both("mean", mode, opt_name)
    _assert_same_rows(dyn, twin, batches)
    stats = dyn.stats()["t0"]
    if mode == "cache":  # more evictions than steps, every one written back
        assert stats["rows_device"] == CACHE_ROWS
        assert stats["evictions"] >= STEPS * 5 and stats["write_backs"] == stats["evictions"]
        assert stats["loads"] > 0
    if mode == "default":
        assert 0 < stats["rows_device"] <= CACHE_ROWS and stats["rows_backing"] > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pooling", ["sum", "weighted"])
def test_twin_pooling_matches_torchrec(pooling, mode):
    dyn, twin, batches = _train_both(pooling, mode, "adagrad")
    _assert_same_rows(dyn, twin, batches)


@pytest.mark.parametrize("pooling", ["mean", "weighted"])
def test_twin_with_gradient_clipping(pooling):
    # fbgemm clips a bag's gradient after MEAN's division and before the per-id weights
    dyn, twin, batches = _train_both(pooling, "cache", "sgd_clipped")
    _assert_same_rows(dyn, twin, batches)


def test_twin_with_two_prefetches_outstanding():
    # three batches pinned at once need more than 8 buckets of 16 rows
    dyn, twin, batches = _train_both("weighted", "cache", "rowwise_adagrad", prefetch_ahead=2,
                                     cache_rows=384)
    _assert_same_rows(dyn, twin, batches)
    assert dyn.pending_prefetches == 0


@pytest.mark.parametrize("pooling,mode", [("mean", "cache"), ("weighted", "default"),
                                          ("sum", "hbm_direct")])
def test_adam_matches_sparse_adam(pooling, mode):
    config = OptimizerConfig(OptimizerType.ADAM, learning_rate=0.01, eps=1e-8)
    dyn = _module(pooling, mode, config)
    ref = {name: torch.nn.Parameter(rows.clone()) for name, rows in _initial_rows(dyn).items()}
    ref_opt = torch.optim.SparseAdam(list(ref.values()), lr=0.01, eps=1e-8)
    modes = {c.name: c.pooling.name.lower() for c in _tables(pooling)}
    targets = _targets()
    for step, kjt in enumerate(_batches(POOLINGS[pooling][2], seed=5)):
        if step == STEPS // 2:
            dyn.fused_optimizer.param_groups[0]["lr"] = 0.005
            ref_opt.param_groups[0]["lr"] = 0.005
        out = dyn(kjt)
        ref_out = torch.cat([
            F.embedding_bag(jt.values(), ref[TABLE_OF[f]], jt.offsets(), sparse=True,
                            mode=modes[TABLE_OF[f]], per_sample_weights=jt.weights_or_none(),
                            include_last_offset=True)
            for f, jt in kjt.to_dict().items()], dim=1)
        # as for the rows below: Adam amplifies rounding where a gradient sums to about zero
        torch.testing.assert_close(out.values(), ref_out, rtol=1e-4, atol=1e-5)
        loss = _loss(out, targets)
        ref_loss = ((ref_out - targets) ** 2).sum() * 0.5 + ref_out.sum()
        loss.backward()
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
    ids = torch.arange(NUM_IDS)
    for name, weight in ref.items():
        rows, found = dyn.read_rows(name, ids)
        # Adam's step m / sqrt(v) is ill-conditioned where a gradient sums to about zero:
        # float32 rounding in another order moves such an element by up to a few 1e-5
        torch.testing.assert_close(rows[found], weight.detach()[found], rtol=1e-4, atol=5e-5)


# -- bad input -------------------------------------------------------------------------------
def _trained(pooling="sum", mode="cache"):
    dyn = _module(pooling, mode, OPTIMIZERS["adagrad"][0])
    for kjt in _batches(POOLINGS[pooling][2], steps=3):
        _loss(dyn(kjt), _targets()).backward()
    return dyn


#: counters that a read-only lookup moves (it is a lookup) without changing any table
LOOKUP_COUNTERS = ("lookups", "unique_keys", "hits", "misses")


def _snapshot(dyn):
    """Every table's rows with optimizer state, device-tier keys and scores, and counters."""
    ids = torch.arange(NUM_IDS)
    return {name: (dyn.read_rows(name, ids, with_state=True),
                   [t.clone() for t in dyn.tables[name].tier.hash.image()[:2]],
                   dyn.stats()[name])
            for name in dyn.tables}


def _assert_unchanged(dyn, before, ignore=()):
    for name, ((rows, found), image, stats) in before.items():
        now_rows, now_found = dyn.read_rows(name, torch.arange(NUM_IDS), with_state=True)
        assert torch.equal(now_found, found) and torch.equal(now_rows, rows)
        assert all(torch.equal(a, b) for a, b in zip(dyn.tables[name].tier.hash.image(), image))
        now = dyn.stats()[name]
        assert {k: v for k, v in now.items() if k not in ignore} == \
            {k: v for k, v in stats.items() if k not in ignore}
    assert dyn.pending_prefetches == 0


def _kjt(features, ids, lengths, weights=None):
    return KeyedJaggedTensor.from_lengths_sync(features, torch.tensor(ids),
                                               torch.tensor(lengths), weights)


@pytest.mark.parametrize("pooling,kjt,message", [
    ("sum", _kjt(["f0", "f2"], [900, 901], [1, 1]), r"\['f1'\] of this collection are not"),
    ("sum", _kjt(["f0", "f2", "g"], [900, 901, 902], [1, 1, 1]),
     r"\['f1'\] of this collection are not"),
    ("weighted", _kjt(FEATURES, [900, 901, 902], [1, 1, 1]), "has no weights"),
    ("sum", KeyedJaggedTensor(FEATURES, torch.tensor([900, 901, 902]),
                              lengths=torch.tensor([1, 1, 1, 0]),
                              stride_per_key_per_rank=[[2], [1], [1]]),
     "different batch size per feature"),
], ids=["missing_feature", "missing_feature_with_unknown", "no_weights", "variable_batch"])
def test_bad_input_is_refused_and_changes_nothing(pooling, kjt, message):
    dyn = _trained(pooling)
    before = _snapshot(dyn)
    for call in dyn.prefetch, dyn:
        with pytest.raises(ValueError, match=message):
            call(kjt)
    _assert_unchanged(dyn, before)


def test_bad_configs_are_refused():
    mean = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=64,
                              feature_names=["f"], pooling=PoolingType.MEAN)
    with pytest.raises(ValueError, match="weighted collection pools by SUM only"):
        DynamicEmbBagCollection([mean], is_weighted=True)
    none = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=64,
                              feature_names=["f"], pooling=PoolingType.NONE)
    with pytest.raises(ValueError, match="pooling must be PoolingType.SUM or PoolingType.MEAN"):
        DynamicEmbBagCollection([none])
    with pytest.raises(TypeError, match="tables must hold EmbeddingBagConfig"):
        DynamicEmbBagCollection([EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=64)])


# -- checkpoints and read-only lookups --------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_state_dict_round_trip_continues_the_same_run(mode):
    config = OPTIMIZERS["rowwise_adagrad"][0]
    kjts = _batches(True, seed=9, steps=10)
    original = _module("weighted", mode, config)
    for kjt in kjts[:6]:
        _loss(original(kjt), _targets()).backward()
    resumed = _module("weighted", mode, config)
    resumed.load_state_dict(original.state_dict())
    for kjt in kjts[6:]:
        out_a, out_b = original(kjt), resumed(kjt)
        assert torch.equal(out_a.values(), out_b.values())
        _loss(out_a, _targets()).backward()
        _loss(out_b, _targets()).backward()
    _assert_unchanged(resumed, _snapshot(original))  # the same rows, scores and counters


@pytest.mark.parametrize("how", ["eval", "no_grad"])
def test_eval_and_no_grad_lookups_are_read_only(how):
    dyn = _trained("mean", "default")
    before = _snapshot(dyn)
    rows, seen = {}, {}
    for name in dyn.tables:
        rows[name], found = dyn.read_rows(name, torch.arange(NUM_IDS))
        seen[name] = found.nonzero().squeeze(1).tolist()
    a, b, c = seen["t0"][:3]
    d, e = seen["t1"][:2]
    unseen = 10**12
    # batch of 2: f0 bags [a, b] and []; f1 [c] and []; f2 [unseen, d] and [e]
    kjt = _kjt(FEATURES, [a, b, c, unseen, d, e], [2, 0, 1, 0, 2, 1])
    if how == "eval":
        dyn.eval()
        out = dyn(kjt)
    else:
        with torch.no_grad():
            out = dyn(kjt)
    assert not out.values().requires_grad
    _assert_unchanged(dyn, before, ignore=LOOKUP_COUNTERS)
    assert not dyn.read_rows("t1", torch.tensor([unseen]))[1].any()  # not inserted
    # seen ids pool their stored rows (t0 by MEAN, t1 by SUM); empty bags are zeros
    torch.testing.assert_close(out["f0"][0], rows["t0"][[a, b]].mean(0))
    torch.testing.assert_close(out["f1"][0], rows["t0"][c])
    torch.testing.assert_close(out["f2"][1], rows["t1"][e])
    assert not out["f0"][1].any() and not out["f1"][1].any()


# -- the sequence module's machinery --------------------------------------------------------
@pytest.mark.parametrize("pooling", ["mean", "weighted"])
@pytest.mark.parametrize("extra", [
    {"admission": FrequencyAdmission(threshold=2), "score_strategy": ScorePolicy.LFU},
    {"stash": StashMode.ALL},
], ids=["admission_lfu", "stash"])
def test_pooling_equals_the_sequence_module_pooled_by_hand(pooling, extra):
    """The same tables, admission, scores, stashing and optimizer as DynamicEmbCollection:
    its rows pooled with torch ops train the same tables to the same rows and scores."""
    config = OPTIMIZERS["rowwise_adagrad"][0]
    options = dataclasses.replace(_options("cache", config), **extra)
    weighted = POOLINGS[pooling][2]
    bags = DynamicEmbBagCollection(_tables(pooling), is_weighted=weighted,
                                   table_options=options, optimizer=config)
    rows = DynamicEmbCollection(
        [EmbeddingConfig(name=c.name, embedding_dim=c.embedding_dim,
                         num_embeddings=c.num_embeddings, feature_names=c.feature_names)
         for c in _tables(pooling)], table_options=options, optimizer=config)
    modes = {c.name: c.pooling.name.lower() for c in _tables(pooling)}
    targets = _targets()
    for kjt in _batches(weighted, seed=13, steps=12):
        out = bags(kjt)
        seq, jts = rows(kjt), kjt.to_dict()
        by_hand = torch.cat([
            F.embedding_bag(torch.arange(jts[f].values().numel()), seq[f].values(),
                            jts[f].offsets(), mode=modes[TABLE_OF[f]],
                            per_sample_weights=jts[f].weights_or_none(),
                            include_last_offset=True)
            for f in FEATURES], dim=1)
        torch.testing.assert_close(out.values(), by_hand, rtol=1e-5, atol=1e-6)
        _loss(out, targets).backward()
        ((by_hand - targets) ** 2 * 0.5 + by_hand).sum().backward()
    for name in bags.tables:
        assert bags.stats()[name] == rows.stats()[name]
        keys, scores = bags.tables[name].tier.hash.image()
        assert torch.equal(keys, rows.tables[name].tier.hash.image()[0])
        assert torch.equal(scores, rows.tables[name].tier.hash.image()[1])
        got, found = bags.read_rows(name, torch.arange(NUM_IDS), with_state=True)
        expected, expected_found = rows.read_rows(name, torch.arange(NUM_IDS), with_state=True)
        assert torch.equal(found, expected_found)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    if "admission" in extra:
        assert bags.stats()["t0"]["admission_rejects"] > 0
    else:
        assert bags.memory_stash is not None


@pytest.mark.parametrize("pooling", ["mean", "weighted"])
def test_cuda_backend_trains_like_the_cpu_backend(pooling):
    """The CUDA kernels (under numba's simulator without a GPU) and the pooling on the
    module's device give the CPU backend's training."""
    from tests.conftest import BACKENDS
    config = OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD, learning_rate=0.05,
                             max_gradient=0.5)
    results = []
    for backend, device in BACKENDS:
        ebc = DynamicEmbBagCollection(_tables(pooling), is_weighted=POOLINGS[pooling][2],
                                      device=device, backend=backend,
                                      table_options=DynamicEmbTableOptions(
                                          max_capacity=256, bucket_size=16, initializer=INIT,
                                          seed=3),
                                      optimizer=config)
        outs = []
        for kjt in _batches(POOLINGS[pooling][2], seed=17, steps=2, batch=2):
            out = ebc(kjt.to(torch.device(device)))
            _loss(out, _targets().to(device)).backward()
            outs.append(out.values().detach().cpu())
        results.append((outs, ebc.read_rows("t0", torch.arange(NUM_IDS, device=device))))
    (cpu_outs, (cpu_rows, cpu_found)), (outs, (rows, found)) = results
    for a, b in zip(cpu_outs, outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(cpu_found, found.cpu())
    torch.testing.assert_close(cpu_rows, rows.cpu(), rtol=1e-5, atol=1e-6)


def test_output_follows_the_config_order_whatever_the_kjt_order():
    ebc = _module("mean", "hbm_direct", OPTIMIZERS["sgd"][0]).eval()
    ordered = KeyedJaggedTensor.from_lengths_sync(FEATURES, torch.tensor([1, 2, 3, 4]),
                                                  torch.tensor([1, 1, 1, 0, 1, 0]))
    shuffled = KeyedJaggedTensor.from_lengths_sync(["f2", "f0", "f1"], torch.tensor([4, 1, 2, 3]),
                                                   torch.tensor([1, 0, 1, 1, 1, 0]))
    a, b = ebc(ordered), ebc(shuffled)
    assert a.keys() == b.keys() == FEATURES
    assert torch.equal(a.values(), b.values())
