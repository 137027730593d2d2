"""Batches in flight across a growth made outside a training claim: a direct
``DynamicTable.grow`` or a ``fill_to_load_factor`` that grows a table while a prefetch is
queued and / or a lookup waits for its backward. Growth does not change values: the queued
forward, the late backward and every step after read and write the rows a twin that never
grew reads and writes, grouped or not, on both kernels (CUDA under numba's simulator without
a GPU), and nothing is written outside the tables' arrays."""
from __future__ import annotations

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from conftest import BACKENDS
from dynemb import DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig, OptimizerType
from dynemb.tables.fill import fill_to_load_factor

FEATURES = ["f0", "f1"]
VOCAB = 20  # distinct ids per table: no bucket of 16 overflows, nothing is evicted
KEYS = torch.arange(VOCAB)


def module(backend, grouped):
    name, device = backend
    configs = [EmbeddingConfig(name=f"t{i}", embedding_dim=4, num_embeddings=64,
                               feature_names=[f]) for i, f in enumerate(FEATURES)]
    options = DynamicEmbTableOptions(init_capacity=64, max_capacity=128, bucket_size=16,
                                     max_load_factor=0.5)
    return DynamicEmbCollection(configs, table_options=options, group_tables=grouped,
                                optimizer=OptimizerConfig(OptimizerType.ADAGRAD,
                                                          learning_rate=0.1),
                                backend=name, device=torch.device(device))


def batches(device, count=4):
    gen = torch.Generator().manual_seed(3)
    return [KeyedJaggedTensor.from_lengths_sync(
        FEATURES, torch.randint(0, VOCAB, (12,), generator=gen), torch.full((6,), 2)).to(device)
        for _ in range(count)]


def loss(out):
    return sum((out[f].values() ** 2).sum() for f in FEATURES)


def grow(module, how):
    table = module.tables["t0"]
    if how == "grow":
        table.grow(2 * table.tier.hash.capacity)
    else:  # 0.6 of 64 slots passes the load factor of 0.5: the fill grows the table to 128
        fill_to_load_factor(table, 0.6, seed=5)
    assert table.tier.hash.capacity == 128


def run(model, kjts, in_flight, how=None):
    """A step, then a lookup awaiting its backward and / or a queued prefetch, the growth
    (``how``; None: none), the late backward, the queued forward and its backward, one more
    step. Returns the outputs of every forward."""
    outs = [model(kjts[0])]
    loss(outs[0]).backward()
    if "waiting" in in_flight:
        waiting = model(kjts[1])
        outs.append(waiting)
    if "queued" in in_flight:
        model.prefetch(kjts[2])
    if how is not None:
        grow(model, how)
    if "waiting" in in_flight:
        loss(waiting).backward()
    for kjt in kjts[2:]:  # the queued batch (if any) first
        outs.append(model(kjt))
        loss(outs[-1]).backward()
    return outs


BOTH = ("queued", "waiting")
#: (backend, in flight): each kind alone on the host kernels; on the CUDA simulator (slow)
#: both kinds at once
CASES = [pytest.param(BACKENDS[0], kinds, id=f"cpu-{'-'.join(kinds)}")
         for kinds in (("queued",), ("waiting",), BOTH)]
CASES.append(pytest.param(BACKENDS[1], BOTH, id="cuda-queued-waiting"))


@pytest.mark.parametrize("backend,in_flight", CASES)
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "alone"])
@pytest.mark.parametrize("how", ["grow", "fill"])
def test_batches_in_flight_follow_a_growth_made_outside_a_claim(backend, grouped, in_flight,
                                                                 how):
    device = backend[1]
    kjts = batches(device)
    grown, twin = module(backend, grouped), module(backend, grouped)
    outs = run(grown, kjts, in_flight, how)
    expected = run(twin, kjts, in_flight)
    for out, ref in zip(outs, expected):
        for f in FEATURES:
            assert torch.equal(out[f].values(), ref[f].values()), f
    keys = KEYS.to(device)
    for name in ("t0", "t1"):
        rows, found = grown.read_rows(name, keys, with_state=True)
        ref_rows, ref_found = twin.read_rows(name, keys, with_state=True)
        assert torch.equal(found, ref_found) and bool(ref_found.any())
        assert torch.equal(rows[ref_found], ref_rows[ref_found]), name
        table = grown.tables[name]
        assert int(table.tier.hash.pinned_count()) == 0  # every pin ended, in the new arrays
        assert not table.has_batches_in_flight()
    assert all(s["evictions"] == 0 for m in (grown, twin) for s in m.stats().values())
    assert grown.steps == twin.steps == {"t0": 4 if "waiting" in in_flight else 3,
                                         "t1": 4 if "waiting" in in_flight else 3}
    if grouped:  # the group grew in place: no regroup, every batch followed it
        (group,) = grown._core.groups
        assert group.intact(grown.tables)
