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


@pytest.mark.parametrize("backend", BACKENDS, ids=[b for b, _ in BACKENDS])
def test_kernels_given_slots_past_their_arrays_touch_nothing_beyond_them(backend):
    """Slots a batch holds index the arrays the kernels are given; one past them (a batch
    that did not follow its rows) is skipped, never written or read out of bounds. The
    arrays here are the first rows of larger buffers, so that a write past them shows."""
    from dynemb.backends.numba_backends import backend_for_device
    from dynemb.backends.protocol import TableArrays
    from dynemb.rows.occurrence_grads import OccurrenceGrads
    name, device = backend
    kernels = backend_for_device(torch.device(device), name)
    rows, past = 64, torch.tensor([3, 70, 64, -1], device=device)  # 3 is in, 70 and 64 not

    refcnt = torch.zeros(96, dtype=torch.int32, device=device)
    arrays = TableArrays(torch.zeros(rows, dtype=torch.int64, device=device),
                         torch.zeros(rows, dtype=torch.int64, device=device), refcnt[:rows],
                         torch.zeros(1, dtype=torch.int64, device=device), rows // 16, 16)
    kernels.add_refcounts(arrays, past, 1)
    assert refcnt.tolist() == [0, 0, 0, 1] + [0] * 92  # pins: slot 3 only

    weights = torch.arange(96 * 4, dtype=torch.float32, device=device).reshape(96, 4)
    before = weights.clone()
    out = torch.full((4, 4), 7.0, device=device)
    kernels.gather_rows(weights[:rows], past, torch.arange(4, device=device), 4, out)
    assert torch.equal(out[0], before[3]) and not out[1:].any()  # zeros past the rows

    grads = OccurrenceGrads.of_rows(torch.ones(4, 4, device=device))
    kernels.fused_update(weights[:rows], past, *grads.kernel_args(), 0, 4, 0.5,  # SGD
                         1e-8, 0.9, 0.999, 0.0, 1.0, 1.0, 0.0)
    assert torch.equal(weights[3], before[3] - 0.5)  # the row in bounds is updated
    weights[3] = before[3]
    assert torch.equal(weights, before)  # nothing past the rows
