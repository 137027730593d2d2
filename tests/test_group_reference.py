"""A group of tables against a model that shares nothing with the group engine
(tests/group_model.py, over the hash-table rules of tests/reference_model.py): four tables of
different capacities in one group of a ``DynamicEmbCollection``, trained step by step on
random batches (keys shared across tables, duplicates in a batch, buckets of 4 so that
evictions happen, tables left out of the loss at times so that their pins last into the next
step), in every storage mode, under every score policy, on both backends.

After each step, per table: the keys each tier holds and their scores, the clock, the pinned
keys, the counters, every stored row with its optimizer state (``read_rows``), the step
count; and the forward's outputs. Initial rows come from tests/key_reference.py (the
documented initializer rules), never read back from a table; updates are SGD or AdaGrad on
gradients that are multiples of 1/8, so that their sums are exact in any order and rows
compare bit for bit.

What the model cannot know, the test adopts after checking it: which of the keys of equal
lowest score a full bucket evicts (the model checks that exactly as many of them went as the
rules say, see ``ModelTable.settle``). CACHE is modelled whole, store included: write-backs
(row and score), loads (row, and the score ``ScoredHashTable.restore_scores`` documents),
the store's own copy (compared through ``store.find``); so is DEFAULT (each key in the tier
its hash routes it to, both tiers' keys, scores and clocks compared). Batches leave out
the new keys of a bucket that could not take them all (the model says which), so that no
step is refused.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from conftest import BACKENDS, ON_GPU
from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, Initializer, InitializerKind,
                    OptimizerConfig, OptimizerType, ScorePolicy, StorageMode)
from group_model import ModelEmbeddingTable, ModelGroup
from group_reference import GroupReference, initial_row_of

DIM = 4
BUCKET = 4
LR = 0.5
INIT = Initializer(InitializerKind.UNIFORM, low=-0.5, high=0.5)
#: per table: (max_capacity, the device rows of a CACHE or DEFAULT table)
SPECS = {"t0": (16, 8), "t1": (24, 12), "t2": (8, 4), "t3": (32, 12)}
FEATURES = {name: f"f{name[1:]}" for name in SPECS}
#: ids every table draws from (so tables share keys), a few far from 0
POOL = list(range(28)) + [2**62 + 5, -(2**40) - 3, -1, 2**63 - 1]
SAMPLES = 3  # per feature and batch, each of 0 to 3 ids
MODES = [StorageMode.HBM_DIRECT, StorageMode.CACHE, StorageMode.HOST_ONLY,
         StorageMode.DEFAULT]
SIMULATED = not ON_GPU


def optimizer_for(mode: StorageMode, policy: ScorePolicy) -> OptimizerType:
    """SGD or AdaGrad, so that each meets every mode and every policy."""
    return (OptimizerType.ADAGRAD if (MODES.index(mode) + list(ScorePolicy).index(policy)) % 2
            else OptimizerType.SGD)


def table_options(mode: StorageMode, policy: ScorePolicy, optimizer: OptimizerType,
                  init_capacity=None):
    row_bytes = 4 * DIM * (2 if optimizer is OptimizerType.ADAGRAD else 1)
    out = {}
    for name, (capacity, device_rows) in SPECS.items():
        budget = {StorageMode.HBM_DIRECT: None, StorageMode.HOST_ONLY: 0}.get(
            mode, device_rows * row_bytes)
        out[name] = DynamicEmbTableOptions(
            max_capacity=capacity, bucket_size=BUCKET, score_strategy=policy,
            initializer=INIT, local_hbm_for_values=budget, init_capacity=init_capacity,
            caching=mode is StorageMode.CACHE)
    return out


def build(mode, policy, optimizer, backend, device, init_capacity=None):
    """The module and its model; ``init_capacity``: HBM_DIRECT tables start there and grow
    (at the options' default ``max_load_factor``, 0.75)."""
    configs = [EmbeddingConfig(name=name, embedding_dim=DIM, num_embeddings=capacity,
                               feature_names=[FEATURES[name]])
               for name, (capacity, _) in SPECS.items()]
    ec = DynamicEmbCollection(configs, table_options=table_options(mode, policy, optimizer,
                                                                   init_capacity),
                              optimizer=OptimizerConfig(optimizer, learning_rate=LR),
                              device=torch.device(device), backend=backend)
    assert ec.table_groups() == [tuple(SPECS)]  # one group of four
    assert set(ec.storage_modes().values()) == {mode}
    model = ModelGroup({
        name: ModelEmbeddingTable(
            mode.value, capacity=capacity, device_rows=device_rows, bucket_size=BUCKET,
            policy=policy.value, dim=DIM, optimizer=optimizer.value,
            initial_row=initial_row_of(ec.tables[name]), init_capacity=init_capacity,
            grow_at=None if init_capacity is None else 0.75)
        for name, (capacity, device_rows) in SPECS.items()})
    return ec, model


def draw_batch(rng: np.random.Generator, model: ModelGroup):
    """Per table, ``SAMPLES`` lists of ids (some empty; duplicates, hot ids), without the new
    keys of any bucket that could not take them all."""
    hot = rng.choice(POOL, 4, replace=False)
    samples = {}
    for name in SPECS:
        most = 0 if rng.random() < 0.15 else 3  # at times a table without ids
        samples[name] = [[int(hot[rng.integers(4)]) if rng.random() < 0.3
                          else int(POOL[rng.integers(len(POOL))])
                          for _ in range(rng.integers(0, most + 1))] for _ in range(SAMPLES)]
    refused = model.refused({name: sum(s, []) for name, s in samples.items()})
    return {name: [[k for k in sample if k not in refused[name]] for sample in s]
            for name, s in samples.items()}


def kjt_of(samples, device):
    lengths, values = [], []
    for name in SPECS:
        for sample in samples[name]:
            lengths.append(len(sample))
            values += sample
    return KeyedJaggedTensor.from_lengths_sync(
        [FEATURES[n] for n in SPECS], torch.tensor(values, dtype=torch.int64),
        torch.tensor(lengths, dtype=torch.int64)).to(device)


def train(mode, policy, backend, device, steps, seed, init_capacity=None):
    optimizer = optimizer_for(mode, policy)
    ec, model = build(mode, policy, optimizer, backend, device, init_capacity)
    ref = GroupReference(ec, model, exact=True)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        samples = draw_batch(rng, model)
        given = ({name: int(rng.integers(0, 5)) for name in SPECS}
                 if policy is ScorePolicy.CUSTOMIZED else None)
        taking = [name for name in SPECS if rng.random() < 0.75] or ["t0"]
        grads = {FEATURES[name]: rng.integers(-4, 5, (sum(map(len, samples[name])), DIM))
                 .astype(np.float32) / 8 for name in taking}
        if given is not None:
            ec.set_scores(given)
        kjt = kjt_of(samples, device)
        out = ec(kjt)
        sum((out[f].values() * torch.from_numpy(g).to(device)).sum()
            for f, g in grads.items()).backward()
        ref.step(kjt, out, lambda f, rows: grads.get(f), scores=given, lr=LR)
        ref.check(probe=POOL)
    return ec, model


def _cases():
    cases = []
    for backend, device in BACKENDS:
        for mode in MODES:
            for policy in ScorePolicy:
                if mode is StorageMode.CACHE and policy is ScorePolicy.NO_EVICTION:
                    continue  # refused by the options: a cache must evict
                cases.append(pytest.param(backend, device, mode, policy,
                                          id=f"{backend}-{mode.value}-{policy.value}"))
    return cases


@pytest.mark.parametrize("backend,device,mode,policy", _cases())
def test_a_group_trains_as_the_model_of_its_tables(backend, device, mode, policy):
    slow = backend == "cuda" and SIMULATED
    ec, model = train(mode, policy, backend, device, steps=8 if slow else 12,
                      seed=list(ScorePolicy).index(policy) + 10 * MODES.index(mode))
    stats = ec.stats()
    if policy is not ScorePolicy.NO_EVICTION:  # the run exercised eviction
        assert sum(s["evictions"] for s in stats.values()) > 0


@pytest.mark.parametrize("backend,device", BACKENDS, ids=[b for b, _ in BACKENDS])
@pytest.mark.parametrize("policy", [ScorePolicy.LRU, ScorePolicy.LFU], ids=lambda p: p.value)
def test_tables_that_grow_grow_as_the_model_of_its_tables(backend, device, policy):
    """HBM_DIRECT tables from one bucket each: each grows, in the group, where the model
    says a table grows (past its load factor, or where a claim would evict), and holds,
    scores and counts as the model."""
    slow = backend == "cuda" and SIMULATED
    ec, model = train(StorageMode.HBM_DIRECT, policy, backend, device,
                      steps=8 if slow else 12, seed=3, init_capacity=BUCKET)
    grown = [t.tier.hash.capacity for t in ec.tables.values()]
    assert grown == [t.tiers["device"].capacity for t in model.tables.values()]
    assert grown != [BUCKET] * len(SPECS)
