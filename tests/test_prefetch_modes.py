"""Training and eval prefetches in one queue: a training loop that prefetches one batch ahead,
with evaluation passes between its steps that prefetch their own batches, trains exactly as
a twin that never evaluates (rows, optimizer state, outputs), and every eval forward reads
the batch prefetched for it, on both kernels (CUDA under numba's simulator without a GPU)."""
from __future__ import annotations

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from conftest import BACKENDS
from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, Initializer,
                    InitializerKind, OptimizerConfig, OptimizerType)

FEATURES = ["f0", "f1"]
VOCAB = 24
UNSEEN = 2.5  # the eval initializer's value, for keys no training batch stored yet


def module(backend):
    name, device = backend
    configs = [EmbeddingConfig(name=f"t{i}", embedding_dim=4, num_embeddings=64,
                               feature_names=[f]) for i, f in enumerate(FEATURES)]
    # 32 rows per table: a prefetch or two ahead fits; batches left queued for ever do not
    options = DynamicEmbTableOptions(
        max_capacity=32, bucket_size=16,
        eval_initializer=Initializer(InitializerKind.CONSTANT, value=UNSEEN))
    return DynamicEmbCollection(configs, table_options=options,
                                optimizer=OptimizerConfig(OptimizerType.ADAM, learning_rate=0.05),
                                backend=name, device=torch.device(device))


def batches(device, count, seed):
    gen = torch.Generator().manual_seed(seed)
    return [KeyedJaggedTensor.from_lengths_sync(
        FEATURES, torch.randint(0, VOCAB, (16,), generator=gen), torch.full((8,), 2)).to(device)
        for _ in range(count)]


def loss(out):
    return sum((out[f].values() ** 2).sum() for f in FEATURES)


def step(model, train, i):
    """Training step ``i``, prefetching the next batch ahead of the backward; its outputs."""
    out = model(train[i])
    if i + 1 < len(train):
        model.prefetch(train[i + 1])
    loss(out).backward()
    return {f: out[f].values().detach() for f in FEATURES}


def expected_eval(rows_of, kjt):
    """What an eval forward of ``kjt`` reads (a pure model): each id's stored row (``rows_of``:
    by table, ``(rows [VOCAB, dim], found [VOCAB])`` of every id), or the eval initializer's
    value for an id not stored."""
    per_feature = kjt.to_dict()
    out = {}
    for i, f in enumerate(FEATURES):
        ids = per_feature[f].values()
        rows, found = rows_of[f"t{i}"]
        out[f] = torch.where(found[ids][:, None], rows[ids], torch.full_like(rows[ids], UNSEEN))
    return out


@pytest.mark.parametrize("backend", BACKENDS, ids=[b for b, _ in BACKENDS])
def test_eval_prefetches_between_training_steps_prefetched_ahead_match_their_forwards(backend):
    """After every other step (the next training batch queued), an eval pass: each eval batch
    prefetched then read, then two prefetched ahead of their reads."""
    device = backend[1]
    train, evals = batches(device, 10, seed=1), batches(device, 3, seed=2)
    keys = torch.arange(VOCAB, device=device)
    model, twin = module(backend), module(backend)  # the twin never evaluates
    model.prefetch(train[0]), twin.prefetch(train[0])
    evaluated = 0
    for i in range(len(train)):
        got, want = step(model, train, i), step(twin, train, i)
        for f in FEATURES:
            assert torch.equal(got[f], want[f]), (i, f)
        if i % 2 == 0:
            continue
        now = {name: twin.read_rows(name, keys) for name in ("t0", "t1")}
        model.eval()
        for ahead in ([e] for e in evals), [evals[:2]]:
            for prefetched in ahead:
                for kjt in prefetched:
                    model.prefetch(kjt)
                for kjt in prefetched:
                    out, expected = model(kjt), expected_eval(now, kjt)
                    for f in FEATURES:
                        assert torch.equal(out[f].values(), expected[f]), (i, f)
                    evaluated += 1
        model.train()
    assert evaluated == 5 * 5
    assert model.pending_prefetches == twin.pending_prefetches == 0  # each consumed once
    for name in ("t0", "t1"):
        rows, found = model.read_rows(name, keys, with_state=True)
        ref_rows, ref_found = twin.read_rows(name, keys, with_state=True)
        assert torch.equal(found, ref_found) and torch.equal(rows, ref_rows), name
        assert int(model.tables[name].tier.hash.pinned_count()) == 0
    assert model.steps == twin.steps == {"t0": 10, "t1": 10}
