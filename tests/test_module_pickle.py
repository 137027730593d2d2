"""``torch.save(module)`` / ``torch.load``: a dynamic module pickles as TorchRec's modules do,
rows, optimizer state, scores, counters and queued work included, at any point of a step."""
import io

import pytest
import torch
from torchrec import EmbeddingBagConfig, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbBagCollection, DynamicEmbCollection, DynamicEmbTableOptions,
                    OptimizerConfig, OptimizerType, ScorePolicy, StashMode, StorageMode)

ADAM = OptimizerConfig(OptimizerType.ADAM, learning_rate=0.05)
OPTIONS = {
    "hbm": DynamicEmbTableOptions(score_strategy=ScorePolicy.LFU),
    # a cache of 4 buckets of 16 rows over a host store: the steps below evict and write back
    "cache": DynamicEmbTableOptions(caching=True, bucket_size=16,
                                    local_hbm_for_values=64 * (8 + 16) * 4),
    # rows wait in host memory between each forward and its backward
    "stash": DynamicEmbTableOptions(stash=StashMode.ALL),
}


def make(kind, options):
    if kind == "sequence":
        return DynamicEmbCollection(
            [EmbeddingConfig(name="t", embedding_dim=8, num_embeddings=4096,
                             feature_names=["f"])], table_options=options, optimizer=ADAM)
    return DynamicEmbBagCollection(
        [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=4096,
                            feature_names=["f"])], table_options=options, optimizer=ADAM)


def batch(step):
    ids = torch.arange(24, dtype=torch.int64) * 7 + step * 5
    return KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.full((8,), 3))


def loss_of(out):
    values = out["f"].values() if isinstance(out, dict) else out.values()
    return values.pow(2).sum()


def step(module, i):
    loss_of(module(batch(i))).backward()


def save_and_load(module):
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def same_tables(a, b):
    keys = torch.arange(0, 24 * 7 + 10 * 5, dtype=torch.int64)
    for got, want in zip(a.read_rows("t", keys, with_state=True),
                         b.read_rows("t", keys, with_state=True)):
        assert torch.equal(got, want)
    assert a.stats() == b.stats()


@pytest.mark.parametrize("mode", ["hbm", "cache", "stash"])
@pytest.mark.parametrize("kind", ["sequence", "pooled"])
@pytest.mark.parametrize("moment", ["between steps", "prefetch queued", "after forward"])
def test_a_pickled_module_continues_training_exactly_like_the_original(kind, mode, moment):
    """Pickle at ``moment`` of step 4, then both go on to step 9 and must agree bit for bit.
    "after forward": a forward whose backward never runs (its loss is ignored), in both."""
    original = make(kind, OPTIONS[mode])
    for i in range(4):
        step(original, i)
    assert original.storage_modes()["t"] == (StorageMode.CACHE if mode == "cache"
                                             else StorageMode.HBM_DIRECT)
    if moment == "prefetch queued":
        original.prefetch(batch(4))
    elif moment == "after forward":
        loss_of(original(batch(4)))

    copy = save_and_load(original)
    assert type(copy) is type(original)
    same_tables(copy, original)
    assert copy.pending_prefetches == original.pending_prefetches
    for module in original, copy:
        for i in range(5 if moment == "after forward" else 4, 10):
            step(module, i)  # in "prefetch queued", step 4 consumes the queued prefetch
        assert module.tables["t"].tier.hash.pinned_count() == 0
        assert module.pending_prefetches == 0
        assert not module.tables["t"].has_batches_in_flight()
    same_tables(copy, original)
    if mode == "cache":
        assert copy.stats()["t"]["write_backs"] > 0


def test_a_pickled_module_keeps_its_learning_rate_and_eval_behaviour():
    original = make("sequence", OPTIONS["hbm"])
    step(original, 0)
    original.fused_optimizer.param_groups[0]["lr"] = 0.125
    original.eval()
    copy = save_and_load(original)
    assert copy.fused_optimizer.param_groups[0]["lr"] == 0.125 and not copy.training
    with torch.no_grad():
        torch.testing.assert_close(copy(batch(0))["f"].values(),
                                   original(batch(0))["f"].values(), rtol=0, atol=0)


@pytest.mark.parametrize("how", ["torch.save", "pickle", "deepcopy"])
@pytest.mark.parametrize("mode", ["cache", "hbm"])
def test_a_grouped_module_saves_after_training_and_trains_on_alike(mode, how):
    """Grouped CACHE tables (the default layout of a module whose tables share a shape) keep
    typed lists of their stores' arrays for the group kernel: a copy must not carry them.
    Plain ``pickle`` copies a group's tables apart from the group's arrays (tensor views do
    not survive it). Either way the copy must train on exactly as the original."""
    import copy as copying
    import pickle

    configs = [EmbeddingConfig(name=n, embedding_dim=8, num_embeddings=4096,
                               feature_names=[f"f_{n}"]) for n in ("a", "b")]
    original = DynamicEmbCollection(configs, table_options=OPTIONS[mode], optimizer=ADAM)
    assert original.table_groups() == [("a", "b")]
    assert set(original.storage_modes().values()) == {
        StorageMode.CACHE if mode == "cache" else StorageMode.HBM_DIRECT}

    def two_features(i):
        ids = torch.arange(48, dtype=torch.int64) * 7 + i * 5
        return KeyedJaggedTensor.from_lengths_sync(["f_a", "f_b"], ids, torch.full((16,), 3))

    def train(module, steps):
        for i in steps:
            out = module(two_features(i))
            sum(jt.values().pow(2).sum() for jt in out.values()).backward()

    train(original, range(4))
    if how == "torch.save":
        copy = save_and_load(original)
    elif how == "pickle":
        copy = pickle.loads(pickle.dumps(original))
    else:
        copy = copying.deepcopy(original)
    for module in (original, copy):
        train(module, range(4, 9))
    keys = torch.arange(0, 48 * 7 + 10 * 5, dtype=torch.int64)
    for name in ("a", "b"):
        for got, want in zip(copy.read_rows(name, keys, with_state=True),
                             original.read_rows(name, keys, with_state=True)):
            assert torch.equal(got, want)
    assert copy.stats() == original.stats()
    if mode == "cache":
        assert all(original.stats()[n]["write_backs"] > 0 for n in ("a", "b"))
