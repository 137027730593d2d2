"""Expiry (dynemb.tables.expiry) against a pure-Python model of each key's age: the step it
was last looked up at (LRU, LFU_LRU) or inserted at (STEP), and which keys are pinned; on
both kernel backends (CUDA under the simulator), in every storage mode, by age, by predicate
and by the ``ttl_steps`` sweep, with checkpoints taken after an expiry."""
import pytest
import torch
from torchrec import EmbeddingConfig, KeyedJaggedTensor

from conftest import BACKENDS
from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig,
                    OptimizerType, ScorePolicy)
from dynemb.checkpoint import dump, load
from dynemb.stores.backing_store import HostBackingStore

DIM = 4
VOCAB = 60
SGD = OptimizerConfig(OptimizerType.SGD, learning_rate=0.1)
MODES = {  # table options of each storage mode, for VOCAB ids without capacity eviction
    "hbm_direct": dict(),
    "cache": dict(caching=True, local_hbm_for_values=64 * DIM * 4, bucket_size=16),
    "default": dict(local_hbm_for_values=128 * DIM * 4, bucket_size=16),
    "host_only": dict(local_hbm_for_values=0),
}


class AgeModel:
    """Each stored key's step of last lookup (``STEP``: of insertion), the table's step, and
    the keys pinned by the lookup awaiting its backward."""

    def __init__(self, policy: ScorePolicy):
        self.policy, self.step, self.seen, self.pinned = policy, 0, {}, set()

    def train(self, ids):
        self.step += 1
        for key in set(ids):
            if self.policy is not ScorePolicy.STEP or key not in self.seen:
                self.seen[key] = self.step

    def expire(self, rule) -> int:
        gone = [k for k, at in self.seen.items() if rule(k, self.step - at)
                and k not in self.pinned]
        for key in gone:
            del self.seen[key]
        return len(gone)


def module(mode="hbm_direct", backend="cpu", policy=ScorePolicy.LRU, tables=("t",), **extra):
    configs = [EmbeddingConfig(name=n, embedding_dim=DIM, num_embeddings=4 * VOCAB,
                               feature_names=[f"f_{n}"]) for n in tables]
    options = DynamicEmbTableOptions(score_strategy=policy, **{**MODES[mode], **extra})
    return DynamicEmbCollection(configs, table_options=options, optimizer=SGD,
                                backend=backend, device=torch.device("cpu"))


def step(ec, ids, backward=True):
    features = [f for c in ec.embedding_configs() for f in c.feature_names]
    values = torch.tensor(ids * len(features), dtype=torch.int64)
    kjt = KeyedJaggedTensor.from_lengths_sync(features, values,
                                              torch.tensor([len(ids)] * len(features)))
    out = ec(kjt)
    if backward:
        sum(out[f].values().sum() for f in features).backward()


def stored(ec, table="t"):
    return set(torch.arange(VOCAB)[ec.read_rows(table, torch.arange(VOCAB))[1]].tolist())


def batches(seed, n=12):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(3, 15, (1,), generator=gen)),),
                          generator=gen).tolist() for _ in range(n)]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", [b for b, _ in BACKENDS])
@pytest.mark.parametrize("policy", [ScorePolicy.LRU, ScorePolicy.STEP, ScorePolicy.LFU_LRU])
def test_expire_older_than_erases_what_the_model_of_ages_says(mode, name, policy):
    ec = module(mode, name, policy)
    model = AgeModel(policy)
    erased = 0
    for i, ids in enumerate(batches(seed=len(mode) + 7 * policy.code)):
        step(ec, ids)
        model.train(ids)
        if i % 4 == 3:
            want = model.expire(lambda key, age: age >= 3)
            assert ec.expire(older_than=3) == {"t": want}
            erased += want
        assert stored(ec) == set(model.seen)
    assert erased > 0 and ec.stats()["t"]["expired"] == erased


@pytest.mark.parametrize("name", [b for b, _ in BACKENDS])
def test_rows_pinned_by_a_batch_in_flight_are_never_erased(name):
    ec = module("hbm_direct", name)
    model = AgeModel(ScorePolicy.LRU)
    step(ec, [1, 2, 3])
    model.train([1, 2, 3])
    step(ec, [4, 5], backward=False)  # awaits its backward: 4 and 5 stay pinned
    model.train([4, 5])
    model.pinned = {4, 5}
    want = model.expire(lambda key, age: True)
    assert ec.expire(where=lambda keys, scores: torch.ones_like(keys, dtype=torch.bool)) == \
        {"t": want} == {"t": 3}
    assert stored(ec) == {4, 5}


@pytest.mark.parametrize("mode", ["hbm_direct", "cache", "default"])
def test_a_predicate_over_keys_and_scores_erases_on_every_tier(mode):
    """LFU scores hold no step: a predicate over them still expires (here: seen once)."""
    ec = module(mode, policy=ScorePolicy.LFU)
    counts = {}
    for ids in batches(seed=3):
        step(ec, ids)
        for key in ids:
            counts[key] = counts.get(key, 0) + 1
    if mode == "cache":
        assert ec.tables["t"].store.size() > 0  # some rows live in the store only
    want = {k for k, c in counts.items() if c == 1}
    assert ec.expire(where=lambda keys, scores: scores == 1) == {"t": len(want)}
    assert stored(ec) == set(counts) - want


def test_ttl_steps_sweeps_before_the_training_prefetches_that_are_due():
    ec = module("hbm_direct", ttl_steps=4, expire_every=2)
    model, swept_at = AgeModel(ScorePolicy.LRU), 0
    for ids in batches(seed=11, n=16):
        if model.step - swept_at >= 2:  # the sweep runs at the prefetch, before the claim
            swept_at = model.step
            model.expire(lambda key, age: age >= 4)
        step(ec, ids)
        model.train(ids)
        assert stored(ec) == set(model.seen)
    assert ec.stats()["t"]["expired"] > 0


def test_bad_input_is_refused_and_erases_nothing():
    ec = module("hbm_direct", tables=("a", "b"))
    for ids in batches(seed=5, n=6):
        step(ec, ids)
    before = {t: stored(ec, t) for t in ("a", "b")}
    with pytest.raises(KeyError, match="no table 'c'"):
        ec.expire(["a", "c"], older_than=1)
    with pytest.raises(ValueError, match="one of older_than"):
        ec.expire()
    with pytest.raises(ValueError, match="older_than must be a positive int"):
        ec.expire(older_than=0)
    calls = []

    def wrong_on_b(keys, scores):  # right for the first table, wrong for the second
        calls.append(keys)
        return torch.ones_like(keys, dtype=torch.bool) if len(calls) == 1 else keys
    with pytest.raises(TypeError, match="where must answer a bool tensor"):
        ec.expire(where=wrong_on_b)
    assert {t: stored(ec, t) for t in ("a", "b")} == before  # table a kept its rows too
    with pytest.raises(ValueError, match="score_strategy LFU, whose scores hold no step"):
        module("hbm_direct", policy=ScorePolicy.LFU).expire(older_than=2)
    for bad, error in ((dict(ttl_steps=0), ValueError), (dict(ttl_steps=1.5), TypeError),
                       (dict(expire_every=3), ValueError),
                       (dict(ttl_steps=5, score_strategy=ScorePolicy.CUSTOMIZED), ValueError)):
        with pytest.raises(error):
            DynamicEmbTableOptions(**bad)


class StoreWithoutErase(HostBackingStore):
    erase = None


def test_a_cache_whose_store_cannot_erase_is_refused_whole():
    options = dict(backing_store=lambda w, d, dev: StoreWithoutErase(w, d, dev))
    ec = module("cache", **options)
    for ids in batches(seed=2, n=4):
        step(ec, ids)
    before = stored(ec)
    with pytest.raises(TypeError, match="has no erase"):
        ec.expire(older_than=1)
    assert stored(ec) == before


@pytest.mark.parametrize("mode", ["hbm_direct", "cache", "default"])
def test_checkpoints_after_an_expiry_hold_the_expired_keys_erased(mode, tmp_path):
    """state_dict, and a full dump then an incremental one after the expiry, load into fresh
    modules without the expired keys."""
    ec = module(mode)
    model = AgeModel(ScorePolicy.LRU)
    for ids in batches(seed=9, n=5):
        step(ec, ids)
        model.train(ids)
    full = dump(ec, tmp_path / "full")
    for ids in batches(seed=10, n=5):
        step(ec, ids)
        model.train(ids)
    assert ec.expire(older_than=2)["t"] == model.expire(lambda key, age: age >= 2) > 0
    dump(ec, tmp_path / "delta", since=full)
    fresh = module(mode)
    fresh.load_state_dict(ec.state_dict())
    assert stored(fresh) == set(model.seen)
    from_files = module(mode)
    load(from_files, [tmp_path / "full", tmp_path / "delta"])
    assert stored(from_files) == set(model.seen)
    keys = torch.tensor(sorted(model.seen))
    assert torch.equal(from_files.read_rows("t", keys, with_state=True)[0],
                       ec.read_rows("t", keys, with_state=True)[0])


@pytest.mark.parametrize("host_level", [False, True])
def test_rows_expire_from_a_disk_store_and_its_host_level(host_level, tmp_path):
    from dynemb.stores.disk_levels import disk_store
    factory = disk_store(tmp_path, host_cache_bytes=4608 if host_level else 0)  # 128 rows
    ec = module("cache", backing_store=factory, local_hbm_for_values=32 * DIM * 4)
    model, store = AgeModel(ScorePolicy.LRU), ec.tables["t"].store
    for i, ids in enumerate(batches(seed=21, n=10)):
        step(ec, ids)
        model.train(ids)
        if i in (5, 9):
            assert store.size() > 0  # rows the cache evicted are on disk
            assert ec.expire(older_than=3) == {"t": model.expire(lambda key, age: age >= 3)}
        assert stored(ec) == set(model.seen)
    assert store.size() == int(store.find(torch.arange(VOCAB))[1].sum())  # kept counting
    assert ec.stats()["t"]["expired"] > 0


def test_a_sharded_module_expires_each_ranks_share_with_no_collective():
    """2 gloo ranks against the model of ages over the global batches, keys placed by the
    pure-Python owner hash; rank 0 expires once more, alone."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from examples.spawn import run_on_ranks
    from expiry_sharded_worker import run
    from key_reference import owner
    from tests import sharded_twin as twin
    ranks = run_on_ranks(2, run, timeout=300)
    scenario = twin.Scenario(steps=6, torchrec_twin=False, lonely_step=None)
    models = {name: AgeModel(ScorePolicy.LRU) for name in ("t0", "t1")}
    for per_rank in twin.make_batches(scenario, 2):
        for name, model in models.items():
            model.train([int(k) for part in per_rank for f in twin.FEATURES
                         if twin.TABLE_OF[f] == name for k in part[f][1]])
    for model in models.values():
        model.expire(lambda key, age: age >= 3)
    for rank, got in enumerate(ranks):
        owned = {name: {k for k in model.seen if owner(k, 2, "hash") == rank}
                 for name, model in models.items()}
        if rank == 0:
            owned["t1"] = {k for k in owned["t1"] if k % 2}
        assert {n: set(keys) for n, keys in got["held"].items()} == owned
        assert got["erased"][0]["t0"] > 0
