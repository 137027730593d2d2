"""Table groups on the CUDA kernels (dynemb.tables.groups; numba's simulator without a
GPU): a grouped module trains as its tables one by one (groups of one) on the same kernels,
its step's launches do not grow with the number of tables, a key without a slot is reported
as a table alone reports it, and the segmented dedup against a plain Python model. Groups
whose records live in host memory: tests/test_table_groups_cuda_host_records.py."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrec import EmbeddingBagConfig, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from conftest import BACKENDS
from failing_store import FailingStore
from group_reference import GroupReference
from dynemb import (DynamicEmbBagCollection, DynamicEmbCollection, DynamicEmbTableOptions,
                    Initializer, InitializerKind, OptimizerConfig, OptimizerType)
from dynemb.backends.numba_backends import CudaBackend
from dynemb.backends.protocol import Segments
from dynemb.types import EMPTY_KEY, ScorePolicy, TableFullError

KERNELS, DEVICE = BACKENDS[1][0], torch.device(BACKENDS[1][1])
DIM = 4


def tables(count, rows=64, pooled=False):
    config = EmbeddingBagConfig if pooled else EmbeddingConfig
    return [config(name=f"t{i}", embedding_dim=DIM, num_embeddings=rows,
                   feature_names=[f"f{i}"]) for i in range(count)]


def twins(count, optimizer=OptimizerType.ADAM, policy=ScorePolicy.LRU, capacity=64,
          pooled=False, dtype=None):
    options = DynamicEmbTableOptions(max_capacity=capacity, bucket_size=16,
                                     score_strategy=policy, embedding_dtype=dtype,
                                     stochastic_rounding=False)
    module = DynamicEmbBagCollection if pooled else DynamicEmbCollection
    config = OptimizerConfig(optimizer, learning_rate=0.05)
    return [module(tables(count, pooled=pooled), table_options=options, optimizer=config,
                   device=DEVICE, backend=KERNELS, group_tables=grouped)
            for grouped in (True, False)]


def batch(gen, count, per_table=6, vocab=40):
    ids = torch.randint(0, vocab, (count * per_table,), generator=gen)
    lengths = torch.full((count * 3,), per_table // 3)  # 3 samples
    return KeyedJaggedTensor.from_lengths_sync([f"f{i}" for i in range(count)], ids,
                                               lengths).to(DEVICE)


def train(module, kjt, used):
    """One step; the loss reads the outputs of the features in ``used`` only."""
    out = module(kjt)
    if isinstance(out, dict):
        loss = sum((out[f].values() ** 2).sum() for f in used)
        values = {f: out[f].values().detach().cpu() for f in out}
    else:
        dense = out.to_dict()
        loss = sum((dense[f] ** 2).sum() for f in used)
        values = {f: dense[f].detach().cpu() for f in dense}
    loss.backward()
    return values


def squares_gradient(used):
    """What :func:`train`'s loss gives each output row (None: left out of the loss), for the
    group model (tests/group_reference.py)."""
    return lambda f, rows: 2 * rows if f in used else None


def assert_same_tables(a, b, keys):
    """Rows (with optimizer state) of ``keys`` and every counter, table by table: the slots
    the two chose may differ (concurrent claims), what they hold may not."""
    assert a.stats() == b.stats()
    assert_same_rows(a, b, keys)


def dense(out, pooled):
    """Each feature's output as one tensor (a pooled module's per bag)."""
    return out.to_dict() if pooled else {f: jt.values() for f, jt in out.items()}


def assert_same_rows(a, b, keys):
    """Rows (with optimizer state) of ``keys``, table by table, cached or stored: which
    rows a cache evicts may differ (concurrent claims choose among equal scores), what each
    key holds may not."""
    for name in a.tables:
        rows_a, found_a = a.read_rows(name, keys, with_state=True)
        rows_b, found_b = b.read_rows(name, keys, with_state=True)
        assert torch.equal(found_a, found_b), name
        assert torch.equal(rows_a[found_a], rows_b[found_b]), name


@pytest.mark.parametrize("pooled", [False, True], ids=["sequence", "pooled"])
@pytest.mark.parametrize("optimizer", [OptimizerType.SGD, OptimizerType.ADAM])
def test_grouped_tables_train_as_alone_on_the_cuda_kernels(optimizer, pooled):
    # 40 ids in 8 buckets of 16 per table: nothing evicted, so concurrent claims (which may
    # pick other slots, or among equal scores other victims, on a GPU) change nothing read
    grouped, alone = twins(3, optimizer, capacity=128, pooled=pooled)
    assert grouped.table_groups() == [("t0", "t1", "t2")]
    assert alone.table_groups() == [("t0",), ("t1",), ("t2",)]
    reference = None if pooled else GroupReference(grouped)  # (the model does not pool)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        kjt = batch(gen, 3)
        used = ["f0", "f2"] if step % 2 else ["f0", "f1", "f2"]  # t1 left out at times
        out_g, out_a = train(grouped, kjt, used), train(alone, kjt, used)
        assert out_g.keys() == out_a.keys()
        for f in out_g:
            assert torch.equal(out_g[f], out_a[f]), f
        if reference is not None:
            reference.step(kjt, out_g, squares_gradient(used))
    assert_same_tables(grouped, alone, torch.arange(40, device=DEVICE))
    assert grouped.steps == alone.steps
    if reference is not None:
        reference.check()


def test_grouped_tables_that_grow_grow_as_alone_on_the_cuda_kernels():
    """t0 grows from 16 to 64 rows, t1 does not; with a batch prefetched ahead of each
    forward, whose slots follow the growth. What a key reads and holds, and the counters,
    equal the tables' alone (the slots may differ: concurrent claims)."""
    options = {"t0": DynamicEmbTableOptions(init_capacity=16, max_capacity=64, bucket_size=16,
                                            stochastic_rounding=False),
               "t1": DynamicEmbTableOptions(max_capacity=64, bucket_size=16,
                                            stochastic_rounding=False)}
    grouped, alone = (DynamicEmbCollection(
        tables(2), table_options=options, device=DEVICE, backend=KERNELS, group_tables=g,
        optimizer=OptimizerConfig(OptimizerType.ADAM, learning_rate=0.05)) for g in (True, False))
    assert grouped.table_groups() == [("t0", "t1")]
    reference = GroupReference(grouped)
    gen = torch.Generator().manual_seed(3)
    kjts = [batch(gen, 2, per_table=9) for _ in range(5)]
    capacities = []
    for module in (grouped, alone):
        module.prefetch(kjts[0])
    reference.prefetch(kjts[0])
    for i in range(4):
        outs = []
        for module in (grouped, alone):
            module.prefetch(kjts[i + 1])  # may grow t0 while batch i waits for its forward
            outs.append(train(module, kjts[i], ["f0", "f1"]))
        for f in outs[0]:
            assert torch.equal(outs[0][f], outs[1][f]), (i, f)
        reference.prefetch(kjts[i + 1])
        reference.step(kjts[i], outs[0], squares_gradient(["f0", "f1"]))
        capacities.append(grouped.tables["t0"].tier.hash.capacity)
    assert capacities[-1] == alone.tables["t0"].tier.hash.capacity == 64 > capacities[0]
    grouped.clear_prefetched(), alone.clear_prefetched(), reference.clear_prefetched()
    assert_same_tables(grouped, alone, torch.arange(40, device=DEVICE))
    reference.check()


def test_padding_does_not_make_a_table_grow_grouped_or_alone():
    """On the CUDA kernels a table's unique keys are padded to its input count; the padding
    claims nothing, so it does not count towards the load factor: 4 ids repeated 15 times
    each leave a 16-row table at 16 rows (it grew to 64 when the padding counted)."""
    options = DynamicEmbTableOptions(init_capacity=16, max_capacity=64, bucket_size=16)
    ids = torch.arange(4).repeat(15)
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.cat([ids, ids + 10]),
                                              torch.tensor([60, 60])).to(DEVICE)
    for grouped in (True, False):
        module = DynamicEmbCollection(tables(2), table_options=options, device=DEVICE,
                                      backend=KERNELS, group_tables=grouped)
        train(module, kjt, ["f0", "f1"])
        assert [t.tier.hash.capacity for t in module.tables.values()] == [16, 16], grouped
        assert module.stats()["t0"]["rows_device"] == 4


@pytest.mark.parametrize("pooled", [False, True], ids=["sequence", "pooled"])
def test_grouped_tables_with_admission_train_as_alone_on_the_cuda_kernels(pooled):
    """Each table admits its keys through its own counter (t1 at the 2nd occurrence, into
    a constant row before); keys refused read their fallback rows and take no update."""
    from dynemb import FrequencyAdmission
    options = {f"t{i}": DynamicEmbTableOptions(
        max_capacity=64, bucket_size=16, stochastic_rounding=False,
        admission=FrequencyAdmission(threshold, initializer=Initializer(
            InitializerKind.CONSTANT, value=0.5) if i == 1 else None))
        for i, threshold in enumerate((2, 2, 3))}
    module = DynamicEmbBagCollection if pooled else DynamicEmbCollection
    grouped, alone = (module(tables(3, pooled=pooled), table_options=options, device=DEVICE,
                             backend=KERNELS, group_tables=g,
                             optimizer=OptimizerConfig(OptimizerType.SGD, learning_rate=0.1))
                      for g in (True, False))
    assert grouped.table_groups() == [("t0", "t1", "t2")]
    gen = torch.Generator().manual_seed(6)
    for step in range(3):
        kjt = batch(gen, 3, vocab=12)
        out_g, out_a = (train(m, kjt, ["f0", "f1", "f2"]) for m in (grouped, alone))
        for f in out_g:
            assert torch.equal(out_g[f], out_a[f]), (step, f)
    assert_same_tables(grouped, alone, torch.arange(12, device=DEVICE))
    assert all(s["admission_rejects"] > 0 for s in grouped.stats().values())


@pytest.mark.parametrize("pooled", [False, True], ids=["sequence", "pooled"])
def test_grouped_cache_tables_train_as_alone_on_the_cuda_kernels(pooled):
    """CACHE tables on the CUDA kernels group: one claim for all of them, then each writes
    its evicted rows back to its store and loads its new keys from there, as alone. 32
    cached rows per table under 60 ids: the steps evict and load back. What each key
    reads and holds (cached or stored) equals the tables' alone; eval reads a key missing
    from the cache from its store."""
    width = DIM + OptimizerConfig(OptimizerType.ADAM).state_dim(DIM)
    options = DynamicEmbTableOptions(caching=True, bucket_size=16, max_capacity=1024,
                                     local_hbm_for_values=32 * width * 4,
                                     stochastic_rounding=False)
    module = DynamicEmbBagCollection if pooled else DynamicEmbCollection
    grouped, alone = (module(tables(3, pooled=pooled), table_options=options, device=DEVICE,
                             backend=KERNELS, group_tables=g,
                             optimizer=OptimizerConfig(OptimizerType.ADAM, learning_rate=0.05))
                      for g in (True, False))
    assert grouped.storage_modes()["t0"].name == "CACHE"
    assert grouped.table_groups() == [("t0", "t1", "t2")]
    assert alone.table_groups() == [("t0",), ("t1",), ("t2",)]
    reference = None if pooled else GroupReference(grouped)  # (the model does not pool)
    gen = torch.Generator().manual_seed(5)
    for step in range(8):
        kjt = batch(gen, 3, per_table=9, vocab=60)
        out_g, out_a = (train(m, kjt, ["f0", "f2"]) for m in (grouped, alone))
        for f in out_g:
            assert torch.equal(out_g[f], out_a[f]), (step, f)
        if reference is not None:
            reference.step(kjt, out_g, squares_gradient(["f0", "f2"]))
    keys = torch.arange(100, device=DEVICE)
    assert_same_rows(grouped, alone, keys)
    if reference is not None:
        reference.check()
    stats = grouped.stats()
    assert all(s["write_backs"] > 0 and s["loads"] > 0 for s in stats.values())
    flushed = grouped.flush()
    assert flushed == alone.flush()
    grouped.eval(), alone.eval()
    with torch.no_grad():
        kjt = batch(gen, 3, per_table=9, vocab=100)  # cached, only stored, never seen
        state = grouped.prefetch(kjt)
        assert state.batches["t0"] is state.batches["t2"]
        out_g, out_a = grouped(kjt), alone(kjt)
    dense_g, dense_a = dense(out_g, pooled), dense(out_a, pooled)
    for f in dense_g:
        assert torch.equal(dense_g[f].cpu(), dense_a[f].cpu()), f
    assert_same_rows(grouped, alone, keys)
    if reference is not None:
        assert reference.flush() == flushed
        reference.eval()
        reference.lookup(kjt, out_g)
        reference.check()
    assert sum(int(t.tier.hash.pinned_count()) for t in grouped.tables.values()) == 0


def test_grouped_cache_tables_with_admission_train_as_alone_on_the_cuda_kernels():
    """CACHE tables with admission group on the CUDA kernels: each admits its keys through
    its own counter, counting the keys its store holds as stored (a key the cache evicted
    comes back at its next occurrence), then writes back and loads as alone."""
    from dynemb import FrequencyAdmission
    width = DIM + OptimizerConfig(OptimizerType.SGD).state_dim(DIM)
    options = DynamicEmbTableOptions(caching=True, bucket_size=16, max_capacity=1024,
                                     local_hbm_for_values=16 * width * 4,
                                     stochastic_rounding=False,
                                     admission=FrequencyAdmission(2))
    grouped, alone = (DynamicEmbCollection(
        tables(3), table_options=options, device=DEVICE, backend=KERNELS, group_tables=g,
        optimizer=OptimizerConfig(OptimizerType.SGD, learning_rate=0.1)) for g in (True, False))
    assert grouped.table_groups() == [("t0", "t1", "t2")]
    assert alone.table_groups() == [("t0",), ("t1",), ("t2",)]
    gen = torch.Generator().manual_seed(9)
    for step in range(12):
        kjt = batch(gen, 3, per_table=12, vocab=24)
        out_g, out_a = (train(m, kjt, ["f0", "f1", "f2"]) for m in (grouped, alone))
        for f in out_g:
            assert torch.equal(out_g[f], out_a[f]), (step, f)
    keys = torch.arange(24, device=DEVICE)
    assert_same_rows(grouped, alone, keys)
    stats = grouped.stats()
    assert stats == alone.stats()
    assert all(s["admission_rejects"] > 0 and s["write_backs"] > 0 and s["loads"] > 0
               for s in stats.values())


def test_a_cache_store_that_raises_undoes_its_table_and_those_after_it_as_alone():
    """t1's store fails a write-back: t0 keeps its claim (filled, counted), t1's claim and
    t2's are taken back, as alone t1 undoes its claim and t2 never claims; no pins stay,
    and training goes on equal."""
    width = DIM + OptimizerConfig(OptimizerType.SGD).state_dim(DIM)
    cache = dict(caching=True, bucket_size=16, max_capacity=1024, stochastic_rounding=False,
                 local_hbm_for_values=32 * width * 4)
    options = {"t0": DynamicEmbTableOptions(**cache), "t2": DynamicEmbTableOptions(**cache),
               "t1": DynamicEmbTableOptions(**cache, backing_store=FailingStore)}
    grouped, alone = (DynamicEmbCollection(
        tables(3), table_options=options, device=DEVICE, backend=KERNELS, group_tables=g,
        optimizer=OptimizerConfig(OptimizerType.SGD, learning_rate=0.1)) for g in (True, False))
    assert grouped.table_groups() == [("t0", "t1", "t2")]
    gen = torch.Generator().manual_seed(11)
    used = ["f0", "f1", "f2"]
    for _ in range(4):  # the caches fill up: the next batches write back
        kjt = batch(gen, 3, per_table=9, vocab=60)
        train(grouped, kjt, used), train(alone, kjt, used)
    kjt = batch(gen, 3, per_table=12, vocab=1000)  # new keys: every table evicts
    FailingStore.failing = True
    try:
        for module in (grouped, alone):
            with pytest.raises(OSError, match="disk is full"):
                module(kjt)
            assert not any(t.has_batches_in_flight() for t in module.tables.values())
            assert all(t.tier.hash.pinned_count() == 0 for t in module.tables.values())
    finally:
        FailingStore.failing = False
    assert_same_tables(grouped, alone, torch.arange(1000, device=DEVICE))
    for _ in range(2):
        kjt = batch(gen, 3, per_table=9, vocab=60)
        out_g, out_a = train(grouped, kjt, used), train(alone, kjt, used)
        for f in out_g:
            assert torch.equal(out_g[f], out_a[f]), f
    assert_same_tables(grouped, alone, torch.arange(1000, device=DEVICE))


@pytest.mark.parametrize("pooled", [False, True], ids=["sequence", "pooled"])
def test_grouped_eval_lookups_match_alone_on_the_cuda_kernels(pooled):
    """A group's eval lookup on the CUDA kernels: one find kernel, pins until the rows are
    read, unseen keys from each table's eval initializer; the same outputs and counters."""
    options = {f"t{i}": DynamicEmbTableOptions(  # a different eval row per table
        max_capacity=128, bucket_size=16,
        eval_initializer=Initializer(InitializerKind.CONSTANT, value=float(i + 2)))
        for i in range(3)}
    module = DynamicEmbBagCollection if pooled else DynamicEmbCollection
    grouped, alone = [module(tables(3, pooled=pooled), table_options=options,
                             optimizer=OptimizerConfig(OptimizerType.SGD, learning_rate=0.05),
                             device=DEVICE, backend=KERNELS, group_tables=g)
                      for g in (True, False)]
    assert grouped.table_groups() == [("t0", "t1", "t2")]
    reference = None if pooled else GroupReference(grouped)  # (the model does not pool)
    used = ["f0", "f1", "f2"]
    gen = torch.Generator().manual_seed(4)
    for _ in range(2):
        kjt = batch(gen, 3)
        out_g = train(grouped, kjt, used)
        train(alone, kjt, used)
        if reference is not None:
            reference.step(kjt, out_g, squares_gradient(used))
    grouped.eval(), alone.eval()
    with torch.no_grad():
        kjt = batch(gen, 3, vocab=200)  # ids never trained, too
        state = grouped.prefetch(kjt)
        assert state.batches["t0"] is state.batches["t2"]
        out_g, out_a = grouped(kjt), alone(kjt)
    dense_g, dense_a = dense(out_g, pooled), dense(out_a, pooled)
    for f in dense_g:
        assert torch.equal(dense_g[f].cpu(), dense_a[f].cpu()), f
    if reference is not None:
        reference.eval()
        reference.lookup(kjt, out_g)
        reference.check()
    if not pooled:
        assert bool((dense_g["f2"] == 4.0).all(1).any())  # t2's eval row, for an unseen id
    assert_same_tables(grouped, alone, torch.arange(200, device=DEVICE))
    assert sum(int(t.tier.hash.pinned_count()) for t in grouped.tables.values()) == 0


@pytest.mark.parametrize("policy, dtype", [(ScorePolicy.CUSTOMIZED, None),
                                           (ScorePolicy.LFU, torch.float16)],
                         ids=["customized", "lfu-float16"])
def test_customized_scores_and_half_rows_train_as_alone(policy, dtype):
    grouped, alone = twins(3, OptimizerType.ROWWISE_ADAGRAD, policy, capacity=128, dtype=dtype)
    assert grouped.table_groups() == [("t0", "t1", "t2")]
    # (the model keeps float32 rows)
    reference = GroupReference(grouped) if dtype is None else None
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        kjt = batch(gen, 3)
        scores = ({"t0": 10 * step, "t1": 7 - step, "t2": 3}
                  if policy is ScorePolicy.CUSTOMIZED else None)
        for module in (grouped, alone):
            if scores is not None:
                module.set_scores(scores)
        out_g, out_a = (train(m, kjt, ["f0", "f1", "f2"]) for m in (grouped, alone))
        for f in out_g:
            assert torch.equal(out_g[f], out_a[f]), f
        if reference is not None:
            reference.step(kjt, out_g, squares_gradient(["f0", "f1", "f2"]), scores=scores)
    assert_same_tables(grouped, alone, torch.arange(40, device=DEVICE))
    if reference is not None:
        reference.check()
    if policy is ScorePolicy.CUSTOMIZED:  # each table's keys took its own score
        for table, given, last in (("t0", {0, 10, 20}, 20), ("t1", {7, 6, 5}, 5),
                                   ("t2", {3}, 3)):
            scores = set(grouped.tables[table].tier.hash.export().scores.tolist())
            assert scores <= given and last in scores, table


def test_a_steps_launches_do_not_grow_with_the_tables(monkeypatch):
    launches = []
    launch = CudaBackend._launch

    def counted(self, kernel, n, *args):
        launches.append(kernel.py_func.__name__)
        launch(self, kernel, n, *args)

    monkeypatch.setattr(CudaBackend, "_launch", counted)
    per_step = {}
    for count in (2, 5):
        grouped, alone = twins(count, OptimizerType.SGD)
        gen = torch.Generator().manual_seed(count)
        for module, name in ((grouped, "grouped"), (alone, "alone")):
            kjt = batch(gen, count, per_table=3)
            train(module, kjt, [f"f{i}" for i in range(count)])  # kernels compiled, tables warm
            launches.clear()
            train(module, batch(gen, count, per_table=3), [f"f{i}" for i in range(count)])
            per_step[name, count] = sorted(launches)
    assert per_step["grouped", 2] == per_step["grouped", 5]
    assert "insert_missing_group_kernel" in per_step["grouped", 2]
    assert len(per_step["alone", 5]) > len(per_step["alone", 2])


def test_a_key_without_a_slot_is_reported_at_the_next_prefetch_as_alone():
    # NO_EVICTION, one bucket of 16 per table: t1's 24 new ids cannot all fit
    grouped, alone = twins(2, OptimizerType.SGD, ScorePolicy.NO_EVICTION, capacity=16)
    full = KeyedJaggedTensor.from_lengths_sync(
        ["f0", "f1"], torch.cat([torch.arange(3), 100 + torch.arange(24)]),
        torch.tensor([3, 24])).to(DEVICE)
    for module in (grouped, alone):
        out = train(module, full, ["f0", "f1"])
        assert torch.count_nonzero(out["f1"].abs().sum(1) == 0) >= 8  # served zeros
        assert module.stats()["t1"]["rows_device"] == 16
        with pytest.raises(TableFullError, match="'t1'"):
            module(full)
        module(full)  # reported once: the next prefetch goes on


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(-4, 9), max_size=7), min_size=1, max_size=5))
def test_the_segmented_dedup_matches_a_python_model(segments):
    """One segment (one sort) and many (two sorts), each with its runs placed by kernels."""
    keys = torch.tensor([k for part in segments for k in part], dtype=torch.int64)
    bounds = [0]
    for part in segments:
        bounds.append(bounds[-1] + len(part))
    unique, inverse, counts, _ = CudaBackend().dedup_segments(keys.to(DEVICE),
                                                              Segments(bounds, DEVICE))
    unique, inverse, counts = unique.cpu(), inverse.cpu(), counts.cpu()
    for t, part in enumerate(segments):
        lo, hi = bounds[t], bounds[t + 1]
        want = sorted(set(part))
        assert unique[lo:lo + len(want)].tolist() == want
        assert unique[lo + len(want):hi].tolist() == [EMPTY_KEY] * (hi - lo - len(want))
        assert counts[lo:lo + len(want)].tolist() == [part.count(k) for k in want]
        assert counts[lo + len(want):hi].tolist() == [0] * (hi - lo - len(want))
    assert torch.equal(unique[inverse], keys)


def test_a_failure_after_the_claim_leaves_no_pins(monkeypatch):
    grouped, _ = twins(2, OptimizerType.SGD)
    gen = torch.Generator().manual_seed(9)
    train(grouped, batch(gen, 2), ["f0", "f1"])

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    kernels = grouped.tables["t0"].kernels
    monkeypatch.setattr(type(kernels), "init_rows_at_group", broken)
    with pytest.raises(RuntimeError, match="injected"):
        grouped(batch(gen, 2, vocab=1000))  # new keys: their rows need the initializer
    monkeypatch.undo()
    grouped.clear_prefetched()  # the earlier step's lookup held its pins until now
    assert all(t.tier.hash.pinned_count() == 0 for t in grouped.tables.values())
    train(grouped, batch(gen, 2), ["f0", "f1"])  # the next step goes on
    assert grouped.steps == {"t0": 2, "t1": 2}
