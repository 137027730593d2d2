"""Table groups (dynemb.tables.groups): a grouped module and the same tables run one by one
(``group_tables=False``) must agree bit for bit: outputs, rows, optimizer state, scores,
counters, steps, errors. Plus the group's own invariants (a table's keys never evict another
table's, which tables group) and its dedup kernel against a plain Python model."""
from __future__ import annotations

import io
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import DynamicEmbCollection, DynamicEmbTableOptions, Initializer, InitializerKind
from dynemb import FrequencyAdmission
from dynemb.stores.backing_store import HostBackingStore
from dynemb.backends.protocol import TableArrays
from dynemb.kernels import groups_cpu
from dynemb.kernels.hashing import bucket_index
from dynemb.rows.optimizers import OptimizerConfig, OptimizerType
from dynemb.tables.groups import GroupBatch
from dynemb.types import EMPTY_KEY, ScorePolicy, TableFullError
from failing_store import FailingStore
from group_reference import GroupReference

FEATURES = [f"f{i}" for i in range(4)]


def configs(dims=(8, 8, 8, 8), rows=(200, 200, 120, 300)):
    return [EmbeddingConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=n,
                            feature_names=[FEATURES[i]])
            for i, (dim, n) in enumerate(zip(dims, rows))]


def twins(optimizer=OptimizerType.ADAM, policy=ScorePolicy.LRU, table_options=None,
          dims=(8, 8, 8, 8)):
    options = table_options or {
        f"t{i}": DynamicEmbTableOptions(max_capacity=cap, bucket_size=32, score_strategy=policy)
        for i, cap in enumerate((256, 256, 128, 512))}
    decay = 0.01 if optimizer is OptimizerType.ADAM else 0.0
    config = OptimizerConfig(optimizer, learning_rate=0.05, weight_decay=decay,
                             max_gradient=0.5)
    return [DynamicEmbCollection(configs(dims), table_options=options, optimizer=config,
                                 group_tables=grouped) for grouped in (True, False)]


def batch(gen: torch.Generator, ids_per_table=(48, 48, 36, 60), vocab=(900, 900, 400, 2000)):
    parts = [torch.randint(0, v, (n,), generator=gen) for n, v in zip(ids_per_table, vocab)]
    lengths = torch.cat([torch.full((12,), n // 12) for n in ids_per_table])  # 12 samples
    return KeyedJaggedTensor.from_lengths_sync(FEATURES, torch.cat(parts), lengths)


def step(module, kjt, weights=(1.0, 2.0, 0.0, 0.5), scores=None):
    """One training step; a weight of 0 leaves that feature's output out of the loss."""
    if scores is not None:
        module.set_scores(scores)
    out = module(kjt)
    loss = sum(w * (out[f].values() ** 2).sum() for f, w in zip(FEATURES, weights) if w)
    loss.backward()
    return out


def assert_same_module(a, b):
    """Same state bit for bit (half-precision rows carry float32 optimizer state as raw bits,
    which may read as NaN), stats and steps."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and sa[key].shape == sb[key].shape, key
        assert torch.equal(sa[key].contiguous().view(torch.uint8),
                           sb[key].contiguous().view(torch.uint8)), key
    assert a.stats() == b.stats()
    assert a.steps == b.steps


def assert_same_outputs(out_a, out_b):
    assert out_a.keys() == out_b.keys()
    for f in out_a:
        assert torch.equal(out_a[f].values(), out_b[f].values()), f
        assert torch.equal(out_a[f].lengths(), out_b[f].lengths()), f


def train_both(grouped, alone, gen: torch.Generator, steps: int, reference=None) -> None:
    """``steps`` steps of both modules; ``reference``, a ``GroupReference`` of ``grouped``,
    follows them."""
    for _ in range(steps):
        kjt = batch(gen)
        out = step(grouped, kjt)
        step(alone, kjt)
        if reference is not None:
            reference.step(kjt, out, loss_gradient())


def loss_gradient(weights=(1.0, 2.0, 0.0, 0.5)):
    """What :func:`step`'s loss gives each output row (None: left out of the loss), for the
    group model (tests/group_reference.py)."""
    by_feature = dict(zip(FEATURES, weights))
    return lambda f, rows: 2 * by_feature[f] * rows if by_feature[f] else None


def refusal_messages(modules, kjt, match):
    """The ``TableFullError`` message each module raises for a training forward of ``kjt``
    (it must raise one matching ``match``)."""
    messages = []
    for module in modules:
        with pytest.raises(TableFullError, match=match) as err:
            module(kjt)
        messages.append(str(err.value))
    return messages


def grouped_names(module):
    return module.table_groups()


@pytest.mark.parametrize("optimizer", list(OptimizerType))
@pytest.mark.parametrize("policy", [ScorePolicy.LRU, ScorePolicy.LFU, ScorePolicy.LFU_LRU,
                                    ScorePolicy.STEP, ScorePolicy.CUSTOMIZED])
def test_a_grouped_module_trains_bit_for_bit_as_its_tables_one_by_one(optimizer, policy):
    """Against the tables one by one, and against the group model."""
    grouped, alone = twins(optimizer, policy)
    assert grouped_names(grouped) == [("t0", "t1", "t2", "t3")]
    assert grouped_names(alone) == [("t0",), ("t1",), ("t2",), ("t3",)]  # groups of one
    reference = GroupReference(grouped)
    gen = torch.Generator().manual_seed(7)
    for i in range(25):
        kjt = batch(gen)
        scores = ({f"t{t}": 1000 + 7 * i + t for t in range(4)}
                  if policy is ScorePolicy.CUSTOMIZED else None)
        out = step(grouped, kjt, scores=scores)
        assert_same_outputs(out, step(alone, kjt, scores=scores))
        reference.step(kjt, out, loss_gradient(), scores=scores)
    assert_same_module(grouped, alone)
    reference.check()
    stats = grouped.stats()
    assert stats["t3"]["evictions"] > 0 and stats["t2"]["evictions"] > 0  # the run evicts
    assert grouped.steps["t2"] == 0  # its output never reached a loss: never updated


@pytest.mark.parametrize("optimizer", list(OptimizerType))
@pytest.mark.parametrize("policy", [ScorePolicy.LRU, ScorePolicy.LFU])
def test_grouped_cache_tables_train_bit_for_bit_as_alone(optimizer, policy):
    # device rows below the ids seen: every step evicts to the stores and loads back
    width = 8 + OptimizerConfig(optimizer).state_dim(8)
    options = {f"t{i}": DynamicEmbTableOptions(caching=True, bucket_size=32,
                                               score_strategy=policy,
                                               local_hbm_for_values=rows * width * 4)
               for i, rows in enumerate((96, 96, 64, 128))}
    grouped, alone = twins(optimizer, policy, table_options=options)
    assert grouped_names(grouped) == [("t0", "t1", "t2", "t3")]
    reference = GroupReference(grouped)
    gen = torch.Generator().manual_seed(8)
    for i in range(20):
        kjt = batch(gen)
        weights = (1.0, 2.0, 0.5, 0.5)
        out = step(grouped, kjt, weights)
        assert_same_outputs(out, step(alone, kjt, weights))
        reference.step(kjt, out, loss_gradient(weights))
    assert_same_module(grouped, alone)
    reference.check()
    stats = grouped.stats()
    assert all(s["write_backs"] > 0 and s["loads"] > 0 for s in stats.values())
    for name in grouped.tables:
        keys = torch.arange(2000)
        got, want = (m.read_rows(name, keys, with_state=True) for m in (grouped, alone))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    flushed = grouped.flush()
    assert flushed == alone.flush() == reference.flush()
    grouped.eval(), alone.eval(), reference.eval()
    for _ in range(3):  # keys cached, keys only in the stores, keys never seen
        kjt = batch(gen, vocab=(2000, 2000, 2000, 4000))
        state = grouped.prefetch(kjt)
        assert state.batches["t0"] is state.batches["t3"]  # one eval lookup for the group
        alone.prefetch(kjt)
        out = grouped(kjt)
        assert_same_outputs(out, alone(kjt))
        reference.lookup(kjt, out)
    assert_same_module(grouped, alone)
    reference.check()


def test_a_store_that_raises_mid_claim_leaves_no_pins_in_either_twin():
    width = 8 + OptimizerConfig(OptimizerType.SGD).state_dim(8)
    options = {f"t{i}": DynamicEmbTableOptions(
        caching=True, bucket_size=32, local_hbm_for_values=rows * width * 4,
        backing_store=lambda w, d, dev: FailingStore(w, d, dev))
        for i, rows in enumerate((96, 96, 64, 128))}
    grouped, alone = twins(OptimizerType.SGD, table_options=options)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):  # the caches fill up: the next batch writes back
        kjt = batch(gen)
        step(grouped, kjt, weights=(1, 1, 1, 1)), step(alone, kjt, weights=(1, 1, 1, 1))
    kjt = batch(gen)
    FailingStore.failing = True
    try:
        for module in (grouped, alone):
            with pytest.raises(OSError, match="disk is full"):
                module(kjt)
            assert not any(t.has_batches_in_flight() for t in module.tables.values())
            assert all(t.tier.hash.pinned_count() == 0 for t in module.tables.values())
    finally:
        FailingStore.failing = False
    step(grouped, batch(gen), weights=(1, 1, 1, 1))  # training goes on


def test_groups_follow_what_the_kernels_share():
    options = {
        "t0": DynamicEmbTableOptions(max_capacity=256),
        "t1": DynamicEmbTableOptions(max_capacity=512),
        "t2": DynamicEmbTableOptions(max_capacity=256, admission=FrequencyAdmission(2)),
        "t3": DynamicEmbTableOptions(init_capacity=128, max_capacity=512),  # grows
    }
    module = DynamicEmbCollection(configs(), table_options=options)
    # a table that grows grows in its group; tables with admission group with each other
    assert grouped_names(module) == [("t0", "t1", "t3"), ("t2",)]
    module = DynamicEmbCollection(configs(dims=(8, 16, 8, 16)))
    assert grouped_names(module) == [("t0", "t2"), ("t1", "t3")]
    module = DynamicEmbCollection(configs(), table_options={
        "t0": DynamicEmbTableOptions(score_strategy=ScorePolicy.LFU)})
    assert grouped_names(module) == [("t0",), ("t1", "t2", "t3")]
    assert grouped_names(DynamicEmbCollection(configs()[:1])) == [("t0",)]  # a group of one


def test_mixed_groups_and_lone_tables_match_their_twin():
    options = {f"t{i}": DynamicEmbTableOptions(max_capacity=256, bucket_size=32)
               for i in range(4)}
    options["t1"] = DynamicEmbTableOptions(max_capacity=256, bucket_size=32,
                                           admission=FrequencyAdmission(2))
    config = OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD, learning_rate=0.1)
    grouped, alone = (DynamicEmbCollection(configs(dims=(8, 8, 16, 8)), table_options=options,
                                           optimizer=config, group_tables=g)
                      for g in (True, False))
    assert grouped_names(grouped) == [("t0", "t3"), ("t1",), ("t2",)]  # t1 admits, t2: dim
    gen = torch.Generator().manual_seed(3)
    for _ in range(12):
        kjt = batch(gen)
        assert_same_outputs(step(grouped, kjt, weights=(1, 1, 1, 1)),
                            step(alone, kjt, weights=(1, 1, 1, 1)))
    assert_same_module(grouped, alone)


def admission_options(policy=ScorePolicy.LRU):
    """Every table admits a key at its 2nd or 3rd occurrence (t3 rejects into its own
    initializer's rows); t0 also grows, t2 evicts."""
    return {f"t{i}": DynamicEmbTableOptions(
        init_capacity=64 if i == 0 else None, max_capacity=cap, bucket_size=32,
        score_strategy=policy, admission=FrequencyAdmission(
            threshold, initializer=Initializer(InitializerKind.CONSTANT, value=0.25)
            if i == 3 else None))
        for i, (cap, threshold) in enumerate(((512, 2), (256, 3), (64, 2), (512, 2)))}


@pytest.mark.parametrize("policy", [ScorePolicy.LRU, ScorePolicy.LFU, ScorePolicy.CUSTOMIZED])
def test_tables_with_admission_group_and_train_bit_for_bit_as_alone(policy):
    grouped, alone = twins(OptimizerType.ROWWISE_ADAGRAD, policy,
                           table_options=admission_options(policy))
    assert grouped_names(grouped) == [("t0", "t1", "t2", "t3")]
    gen = torch.Generator().manual_seed(17)
    for i in range(20):
        kjt = batch(gen, vocab=(300, 300, 400, 600))
        scores = ({f"t{t}": 100 + 5 * i + t for t in range(4)}
                  if policy is ScorePolicy.CUSTOMIZED else None)
        assert_same_outputs(step(grouped, kjt, scores=scores), step(alone, kjt, scores=scores))
    assert_same_module(grouped, alone)
    stats = grouped.stats()
    assert all(s["admission_rejects"] > 0 for s in stats.values())
    assert stats["t2"]["evictions"] > 0 and grouped.tables["t0"].tier.hash.capacity > 64
    for module in (grouped, alone):  # eval lookups of keys never admitted: the eval rows
        module.eval()
    with torch.no_grad():
        kjt = batch(gen, vocab=(300, 300, 400, 600))
        assert_same_outputs(grouped(kjt), alone(kjt))


def store_only_keys(module, name, vocab):
    """Keys of ``vocab`` that table ``name`` holds in its store and not in its cache."""
    table, keys = module.tables[name], torch.arange(vocab)
    in_store = table.store.find(keys)[1]
    cached = table.tier.hash.find(keys) >= 0
    return keys[in_store & ~cached]


@pytest.mark.parametrize("policy", [ScorePolicy.LRU, ScorePolicy.LFU])
def test_cache_tables_with_admission_group_and_train_bit_for_bit_as_alone(policy):
    """A CACHE table counts a key its store holds as stored: a key the cache evicted comes
    back at its next occurrence (admitted keys leave the counter, threshold 3), loaded from
    the store, in its group as alone."""
    width = 8 + OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD).state_dim(8)
    options = {f"t{i}": DynamicEmbTableOptions(
        caching=True, bucket_size=32, score_strategy=policy,
        local_hbm_for_values=rows * width * 4, admission=FrequencyAdmission(3))
        for i, rows in enumerate((64, 64, 32, 96))}
    grouped, alone = twins(OptimizerType.ROWWISE_ADAGRAD, policy, table_options=options)
    assert grouped_names(grouped) == [("t0", "t1", "t2", "t3")]
    assert {m.name for m in grouped.storage_modes().values()} == {"CACHE"}
    gen = torch.Generator().manual_seed(23)
    for _ in range(20):
        kjt = batch(gen, vocab=(300, 300, 200, 600))
        assert_same_outputs(step(grouped, kjt, (1, 1, 1, 1)), step(alone, kjt, (1, 1, 1, 1)))
    assert_same_module(grouped, alone)
    stats = grouped.stats()
    assert all(s["admission_rejects"] > 0 and s["write_backs"] > 0 for s in stats.values())
    # one occurrence of a key only the store holds, per table: admitted, loaded, its row read
    comeback = [store_only_keys(grouped, f"t{t}", 600)[:1] for t in range(4)]
    assert all(k.numel() == 1 for k in comeback)
    assert all(torch.equal(store_only_keys(alone, f"t{t}", 600)[:1], comeback[t])
               for t in range(4))
    stored = [grouped.tables[f"t{t}"].store.find(comeback[t])[0][:, :8] for t in range(4)]
    kjt = KeyedJaggedTensor.from_lengths_sync(FEATURES, torch.cat(comeback),
                                              torch.ones(4, dtype=torch.int64))
    for module in (grouped, alone):
        before = module.stats()
        out = step(module, kjt, (1, 1, 1, 1))
        after = module.stats()
        for t, f in enumerate(FEATURES):
            assert torch.equal(out[f].values(), stored[t])
            name = f"t{t}"
            assert after[name]["loads"] == before[name]["loads"] + 1
            assert after[name]["admission_rejects"] == before[name]["admission_rejects"]
    assert_same_module(grouped, alone)


def test_tables_with_admission_pooled_and_prefetched_ahead_match_their_twin():
    from dynemb import DynamicEmbBagCollection
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    bags = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=300,
                               feature_names=[FEATURES[i]]) for i in range(4)]
    grouped, alone = (DynamicEmbBagCollection(
        bags, table_options=admission_options(), group_tables=g,
        optimizer=OptimizerConfig(OptimizerType.ADAM, learning_rate=0.05)) for g in (True, False))
    assert grouped.table_groups() == [("t0", "t1", "t2", "t3")]
    gen = torch.Generator().manual_seed(8)
    kjts = [batch(gen, vocab=(300, 300, 400, 600)) for _ in range(12)]
    for i in range(0, 12, 2):
        for module in (grouped, alone):
            module.prefetch(kjts[i]), module.prefetch(kjts[i + 1])
        for j in (i, i + 1):
            outs = [m(kjts[j]) for m in (grouped, alone)]
            assert torch.equal(outs[0].values(), outs[1].values())
            for out in outs:
                (out.values() ** 2).sum().backward()
    assert_same_module(grouped, alone)


def test_a_full_table_with_admission_undoes_its_groups_claim_and_raises_its_error():
    """Admission counts cannot be taken back, so a group with admission raises the error of
    the table that refused the batch itself, every table's claim undone (alone, the tables
    before the refusing one keep theirs)."""
    options = admission_options(ScorePolicy.NO_EVICTION)
    options["t1"] = DynamicEmbTableOptions(max_capacity=32, bucket_size=32,
                                           score_strategy=ScorePolicy.NO_EVICTION,
                                           admission=FrequencyAdmission(1))
    grouped, alone = (DynamicEmbCollection(configs(), table_options=options, group_tables=g,
                                           optimizer=OptimizerConfig(OptimizerType.SGD))
                      for g in (True, False))
    assert grouped_names(grouped) == [("t0", "t1", "t2", "t3")]
    kjt = batch(torch.Generator().manual_seed(0))
    rows_before = {n: t.stats()["rows_device"] for n, t in grouped.tables.items()}
    messages = refusal_messages((grouped, alone), kjt, "table 't1'")
    assert messages[0] == messages[1]
    assert {n: t.stats()["rows_device"] for n, t in grouped.tables.items()} == rows_before
    assert alone.stats()["t0"]["rows_device"] > 0  # alone, t0 claimed before t1 refused
    assert not any(t.has_batches_in_flight() for t in grouped.tables.values())
    step(grouped, batch(torch.Generator().manual_seed(1), ids_per_table=(12, 12, 12, 12)))


def test_host_only_tables_of_a_module_on_the_host_group_and_match_their_twin():
    """HOST_ONLY keeps its rows in host memory: on a module on the host, that is where a
    group's arrays are, so its tables group (with each other: they do not grow and allocate
    max_capacity up front); with admission and eviction, pooled or not."""
    options = {f"t{i}": DynamicEmbTableOptions(local_hbm_for_values=0, max_capacity=cap,
                                               bucket_size=32, score_strategy=ScorePolicy.LFU)
               for i, cap in enumerate((256, 128, 128, 512))}
    options["t2"] = DynamicEmbTableOptions(max_capacity=128, bucket_size=32,
                                           score_strategy=ScorePolicy.LFU)  # HBM_DIRECT
    grouped, alone = twins(OptimizerType.ADAM, ScorePolicy.LFU, table_options=options)
    assert {m.name for m in grouped.storage_modes().values()} == {"HOST_ONLY", "HBM_DIRECT"}
    assert grouped_names(grouped) == [("t0", "t1", "t3"), ("t2",)]
    reference = GroupReference(grouped)
    gen = torch.Generator().manual_seed(31)
    for _ in range(15):
        kjt = batch(gen)
        out = step(grouped, kjt)
        assert_same_outputs(out, step(alone, kjt))
        reference.step(kjt, out, loss_gradient())
    assert_same_module(grouped, alone)
    reference.check()
    assert grouped.stats()["t1"]["evictions"] > 0 and grouped.stats()["t1"]["rows_device"] == 0
    for module in (grouped, alone):
        module.eval()
    with torch.no_grad():
        kjt = batch(gen)
        assert_same_outputs(grouped(kjt), alone(kjt))
    # on the CUDA kernels (numba's simulator stands in for the GPU) the HOST_ONLY tables
    # group too: their record on the host by the host kernels, served where the module is
    # (tests/test_table_groups_cuda.py trains them)
    from conftest import BACKENDS
    name, device = BACKENDS[1]
    on_cuda = DynamicEmbCollection(configs(), table_options=options, backend=name,
                                   device=torch.device(device))
    assert grouped_names(on_cuda) == [("t0", "t1", "t3"), ("t2",)]


def test_tables_of_several_features_and_a_shared_feature_match_their_twin():
    # t0 reads f0 and f1, t1 reads f2, t2 reads f3 and f1 (outputs f1@t0, f1@t2); the loss
    # leaves some outputs out (t1's entirely), and some batches have no ids of f3
    tables = [EmbeddingConfig(name="t0", embedding_dim=8, num_embeddings=300,
                              feature_names=["f0", "f1"]),
              EmbeddingConfig(name="t1", embedding_dim=8, num_embeddings=300,
                              feature_names=["f2"]),
              EmbeddingConfig(name="t2", embedding_dim=8, num_embeddings=300,
                              feature_names=["f3", "f1"])]
    options = {t.name: DynamicEmbTableOptions(max_capacity=512, bucket_size=32)
               for t in tables}
    config = OptimizerConfig(OptimizerType.ADAM, learning_rate=0.05)
    grouped, alone = (DynamicEmbCollection(tables, table_options=options, optimizer=config,
                                           group_tables=g) for g in (True, False))
    assert grouped_names(grouped) == [("t0", "t1", "t2")]
    used = ("f0", "f1@t2", "f3")
    reference = GroupReference(grouped)
    gen = torch.Generator().manual_seed(21)
    for i in range(16):
        kjt = batch(gen) if i % 3 else KeyedJaggedTensor.from_lengths_sync(
            FEATURES, torch.randint(0, 900, (132,), generator=gen),
            torch.cat([torch.full((12,), n) for n in (4, 4, 3, 0)]))
        outs = []
        for module in (grouped, alone):
            out = module(kjt)
            loss = sum((out[name].values() ** 2).sum() for name in out if name in used)
            loss.backward()
            outs.append(out)
        assert sorted(outs[0]) == sorted(outs[1])
        assert_same_outputs(*outs)
        reference.step(kjt, outs[0], lambda name, rows: 2 * rows if name in used else None)
    assert_same_module(grouped, alone)
    reference.check()
    assert grouped.stats()["t1"]["lookups"] > 0 and grouped.stats()["t0"]["evictions"] > 0


def test_a_full_table_evicts_only_its_own_keys():
    grouped, _ = twins(OptimizerType.SGD)
    gen = torch.Generator().manual_seed(11)
    quiet = torch.arange(36) * 3 + 1  # t2 sees the same 36 ids every step: they fit
    for _ in range(30):
        kjt = batch(gen)
        values = kjt.values().clone()
        values[96:132] = quiet
        kjt = KeyedJaggedTensor.from_lengths_sync(FEATURES, values, kjt.lengths())
        step(grouped, kjt)
    stats = grouped.stats()
    assert stats["t3"]["evictions"] > 100 and stats["t0"]["evictions"] > 100
    assert stats["t2"]["evictions"] == 0 and stats["t2"]["rows_device"] == 36
    rows, found = grouped.read_rows("t2", quiet)
    assert bool(found.all())
    for name in ("t0", "t1", "t3"):  # nobody else holds t2's keys, nor more than its rows
        assert stats[name]["rows_device"] <= stats[name]["device_capacity"]


def test_eval_and_no_grad_lookups_match_their_twin():
    grouped, alone = twins(OptimizerType.ADAGRAD)
    reference = GroupReference(grouped)
    gen = torch.Generator().manual_seed(5)
    train_both(grouped, alone, gen, 6, reference)
    kjt = batch(gen)
    with torch.no_grad():
        out = grouped(kjt)
        assert_same_outputs(out, alone(kjt))
        reference.lookup(kjt, out)
    grouped.eval(), alone.eval(), reference.eval()
    out = grouped(kjt)
    assert_same_outputs(out, alone(kjt))
    reference.lookup(kjt, out)
    assert_same_module(grouped, alone)
    reference.check()


EVAL_INITIALIZERS = [Initializer(InitializerKind.NORMAL, mean=0.5, std=0.1),
                     Initializer(InitializerKind.UNIFORM, low=-2.0, high=-1.0),
                     Initializer(InitializerKind.CONSTANT, value=3.0),
                     Initializer(InitializerKind.TRUNCATED_NORMAL, mean=0.0, std=1.0)]


def test_a_grouped_eval_lookup_is_one_group_batch_and_matches_its_twin():
    """Eval reads every table's stored rows and, for keys never stored, its own
    eval_initializer's rows (seeded per table), in one lookup for the group: outputs,
    counters, pins and state as the tables alone, with eval batches queued ahead too."""
    options = {f"t{i}": DynamicEmbTableOptions(max_capacity=cap, bucket_size=32, seed=11 + i,
                                               eval_initializer=EVAL_INITIALIZERS[i])
               for i, cap in enumerate((256, 256, 128, 512))}
    config = OptimizerConfig(OptimizerType.ADAM, learning_rate=0.05)
    grouped, alone = [DynamicEmbCollection(configs(), table_options=options, optimizer=config,
                                           group_tables=g) for g in (True, False)]
    assert grouped.table_groups() == [("t0", "t1", "t2", "t3")]
    reference = GroupReference(grouped)
    gen = torch.Generator().manual_seed(7)
    train_both(grouped, alone, gen, 5, reference)
    grouped.eval(), alone.eval(), reference.eval()
    for _ in range(3):  # seen and unseen keys: vocabularies larger than what trained
        kjt = batch(gen, vocab=(3000, 3000, 3000, 3000))
        state = grouped.prefetch(kjt)
        assert isinstance(state.batches["t0"], GroupBatch)
        assert state.batches["t0"] is state.batches["t3"]
        alone.prefetch(kjt)
        assert grouped.tables["t1"].has_batches_in_flight()
        out_g, out_a = grouped(kjt), alone(kjt)
        assert_same_outputs(out_g, out_a)
        reference.lookup(kjt, out_g)
        unseen = out_g["f2"].values()[(out_g["f2"].values() == 3.0).all(1)]
        assert unseen.numel() > 0  # t2's eval_initializer answered for its unseen keys
    assert_same_module(grouped, alone)
    reference.check()
    assert not any(t.has_batches_in_flight() for t in grouped.tables.values())
    assert sum(int(t.tier.hash.pinned_count()) for t in grouped.tables.values()) == 0
    assert grouped.stats()["t0"]["misses"] > 0


def options_of(kind):
    """Tables of fixed capacity (None: twins' default), that grow, or that admit keys."""
    return {"fixed": lambda: None, "growing": growing_options,
            "admission": admission_options}[kind]()


@pytest.mark.parametrize("kind", ["fixed", "growing", "admission"])
def test_state_dicts_load_across_grouped_and_lone_modules_and_training_goes_on_the_same(kind):
    grouped, alone = twins(OptimizerType.ADAM, table_options=options_of(kind))
    gen = torch.Generator().manual_seed(9)
    for _ in range(8):
        step(grouped, batch(gen))
    alone.load_state_dict(grouped.state_dict())
    assert_same_module(grouped, alone)
    fresh, _ = twins(OptimizerType.ADAM, table_options=options_of(kind))
    fresh.load_state_dict(alone.state_dict())  # into a grouped module
    assert grouped_names(fresh) == [("t0", "t1", "t2", "t3")]
    for _ in range(8):
        kjt = batch(gen)
        out = [step(m, kjt) for m in (grouped, alone, fresh)]
        assert_same_outputs(out[0], out[1]), assert_same_outputs(out[0], out[2])
    assert_same_module(grouped, alone), assert_same_module(grouped, fresh)


@pytest.mark.parametrize("kind", ["fixed", "growing", "admission"])
def test_resetting_one_table_regroups_and_matches_the_twin(kind):
    grouped, alone = twins(OptimizerType.SGD, table_options=options_of(kind))
    gen = torch.Generator().manual_seed(2)
    train_both(grouped, alone, gen, 5)
    grouped.reset_parameters(tables=["t1"]), alone.reset_parameters(tables=["t1"])
    assert grouped.stats()["t1"]["rows_device"] == 0
    for _ in range(5):
        kjt = batch(gen)
        assert_same_outputs(step(grouped, kjt), step(alone, kjt))
    assert_same_module(grouped, alone)
    assert grouped_names(grouped) == [("t0", "t1", "t2", "t3")]


def test_a_table_whose_storage_was_replaced_is_regrouped():
    grouped, alone = twins(OptimizerType.SGD)
    gen = torch.Generator().manual_seed(13)
    train_both(grouped, alone, gen, 3)
    for module in (grouped, alone):  # a direct call below the table: its arrays are new
        hash_table = module.tables["t3"].tier.hash
        hash_table.use_storage(TableArrays(*(t.clone() for t in hash_table.arrays[:4]),
                                           hash_table.num_buckets, hash_table.bucket_size))
    assert not grouped._core.groups[0].intact(grouped.tables)
    train_both(grouped, alone, gen, 3)
    assert grouped._core.groups[0].intact(grouped.tables)
    assert_same_module(grouped, alone)


def test_a_late_backward_after_a_direct_grow_counts_its_dropped_updates_as_alone():
    """A lookup whose pins ended (the next training lookup ended them) and whose backward
    comes late, after a direct ``grow`` of one of its tables (grown in its group, which lays
    its tables out again): its update reaches the rows still holding its keys, the others
    count as dropped updates, as a table alone does; nothing goes to arrays no table uses
    any more."""
    grouped, alone = twins(OptimizerType.SGD)
    gen = torch.Generator().manual_seed(21)
    train_both(grouped, alone, gen, 3)
    kjts = [batch(gen) for _ in range(3)]
    late = [m(kjts[0]) for m in (grouped, alone)]  # backward below, after the grow
    for module in (grouped, alone):
        step(module, kjts[1])  # ends the pins of the late lookup
        module.tables["t0"].grow(2 * module.tables["t0"].tier.hash.capacity)
        step(module, kjts[2])
    for out in late:
        loss = sum((out[f].values() ** 2).sum() for f in FEATURES)
        loss.backward()
    assert_same_module(grouped, alone)
    assert grouped.stats()["t0"]["dropped_updates"] > 0  # t0's rows moved with the grow


def test_a_table_replaced_with_a_lookup_in_flight_ends_that_lookup():
    grouped, other = twins(OptimizerType.SGD)
    gen = torch.Generator().manual_seed(14)
    earlier = grouped(batch(gen))  # its backward has not run
    grouped.tables["t1"] = other.tables["t1"]  # an empty table, behind the module's back
    out = grouped(batch(gen))  # regroups: the earlier lookup's group lost a table
    assert grouped.table_groups() == [("t0", "t1", "t2", "t3")]
    assert grouped._core.groups[0].tables[1] is grouped.tables["t1"]
    with pytest.raises(RuntimeError, match="run a new forward|Run a new forward"):
        earlier["f0"].values().sum().backward()
    out["f0"].values().sum().backward()  # the new lookup trains
    assert grouped.steps["t0"] == 1
    grouped.clear_prefetched()  # the other tables' pins of that lookup end here
    assert all(t.tier.hash.pinned_count() == 0 for t in grouped.tables.values())


@pytest.mark.parametrize("kind", ["fixed", "growing", "admission"])
def test_a_pickled_grouped_module_goes_on_bit_for_bit(kind):
    grouped, alone = twins(OptimizerType.ADAM, table_options=options_of(kind))
    gen = torch.Generator().manual_seed(4)
    train_both(grouped, alone, gen, 4)
    buffer = io.BytesIO()
    torch.save(grouped, buffer)
    buffer.seek(0)
    copy = torch.load(buffer, weights_only=False)
    for _ in range(4):
        kjt = batch(gen)
        out = [step(m, kjt) for m in (copy, alone)]
        assert_same_outputs(*out)
    assert_same_module(copy, alone)
    assert pickle.loads(pickle.dumps(grouped.stats())) == grouped.stats()


def test_a_table_with_no_free_row_raises_as_it_does_alone():
    options = {f"t{i}": DynamicEmbTableOptions(max_capacity=256, bucket_size=32,
                                               score_strategy=ScorePolicy.NO_EVICTION)
               for i in range(4)}
    options["t2"] = DynamicEmbTableOptions(max_capacity=32, bucket_size=32,
                                           score_strategy=ScorePolicy.NO_EVICTION)
    grouped, alone = (DynamicEmbCollection(configs(), table_options=options, group_tables=g,
                                           optimizer=OptimizerConfig(OptimizerType.SGD))
                      for g in (True, False))
    kjt = batch(torch.Generator().manual_seed(0))
    messages = refusal_messages((grouped, alone), kjt, "table 't2'")
    # the group undid its claim and handed the batch to its tables one by one: the same
    # error, and the same tables as a module of lone tables leaves them
    assert messages[0] == messages[1]
    assert_same_module(grouped, alone)
    assert grouped.stats()["t2"]["rows_device"] == 0
    assert not any(t.has_batches_in_flight() for t in grouped.tables.values())
    step(grouped, batch(torch.Generator().manual_seed(1), ids_per_table=(12, 12, 12, 12)))


def test_skipped_backwards_and_batches_prefetched_ahead_match_the_twin():
    grouped, alone = twins(OptimizerType.ADAM, ScorePolicy.LFU)
    reference = GroupReference(grouped)
    gen = torch.Generator().manual_seed(12)
    kjts = [batch(gen) for _ in range(12)]
    for i in range(0, 12, 3):
        for kjt in kjts[i:i + 2]:  # two batches queued ahead of their forwards
            grouped.prefetch(kjt), reference.prefetch(kjt), alone.prefetch(kjt)
        for j, backward in ((i, True), (i + 1, False), (i + 2, True)):
            outs = [m(kjts[j]) for m in (grouped, alone)]
            assert_same_outputs(*outs)
            if backward:  # else: as if an exception came between forward and backward
                for out in outs:
                    sum((out[f].values() ** 2).sum() for f in FEATURES).backward()
            reference.step(kjts[j], outs[0], lambda f, rows: 2 * rows if backward else None)
    assert_same_module(grouped, alone)
    reference.check()
    assert grouped.steps == {"t0": 8, "t1": 8, "t2": 8, "t3": 8}


def test_late_backwards_drop_the_updates_of_evicted_rows_as_alone():
    grouped, alone = twins(OptimizerType.ADAM, ScorePolicy.LRU)
    gen = torch.Generator().manual_seed(15)
    for _ in range(8):  # backwards after two more forwards: pins ended, rows evicted
        kjts = [batch(gen) for _ in range(3)]
        for module in (grouped, alone):
            outs = [module(kjt) for kjt in kjts]
            for out in outs:
                sum((out[f].values() ** 2).sum() for f in FEATURES).backward()
    assert_same_module(grouped, alone)
    assert sum(s["dropped_updates"] for s in grouped.stats().values()) > 0


def growing_options(policy=ScorePolicy.LRU, init=64):
    """t0, t2, t3 grow (t2 only to 128: past that it evicts), t1 does not."""
    return {f"t{i}": DynamicEmbTableOptions(
        init_capacity=min(init, cap) if i != 1 else None, max_capacity=cap, bucket_size=32,
        score_strategy=policy) for i, cap in enumerate((512, 256, 128, 1024))}


@pytest.mark.parametrize("policy", [ScorePolicy.LRU, ScorePolicy.LFU, ScorePolicy.STEP,
                                    ScorePolicy.CUSTOMIZED])
def test_tables_that_grow_grow_in_their_group_bit_for_bit_as_alone(policy):
    """Against the tables one by one, and against the group model (which grows each table
    by its own rule, see ``ModelTable.grow_for``)."""
    grouped, alone = twins(OptimizerType.ADAM, policy, table_options=growing_options(policy))
    assert grouped_names(grouped) == [("t0", "t1", "t2", "t3")]
    reference = GroupReference(grouped)
    gen = torch.Generator().manual_seed(21)
    capacities = []
    for i in range(25):
        kjt = batch(gen)
        scores = ({f"t{t}": 500 + 3 * i + t for t in range(4)}
                  if policy is ScorePolicy.CUSTOMIZED else None)
        out = step(grouped, kjt, scores=scores)
        assert_same_outputs(out, step(alone, kjt, scores=scores))
        reference.step(kjt, out, loss_gradient(), scores=scores)
        capacities.append([t.tier.hash.capacity for t in grouped.tables.values()])
        assert capacities[-1] == [t.tiers["device"].capacity
                                  for t in reference.model.tables.values()], i
    assert_same_module(grouped, alone)
    reference.check()
    assert capacities[-1] == [512, 256, 128, 1024]  # from 64: each grew to its max_capacity
    assert len({tuple(c) for c in capacities}) > 3  # over several steps, one doubling or more
    assert [t.tier.hash.capacity for t in alone.tables.values()] == capacities[-1]
    assert grouped.stats()["t2"]["evictions"] > 0  # at its max_capacity it evicts
    (group,) = grouped._core.groups
    assert group.intact(grouped.tables)  # grown in place: no regroup was needed
    assert group.storage.row_offset[-1] == sum(capacities[-1])


def test_batches_held_across_a_growth_follow_their_rows():
    """Batches prefetched ahead and lookups awaiting a late backward hold slots of the
    group's old layout when a table grows: they are renumbered, so their forwards read and
    their backwards update the rows they pinned, as alone."""
    grouped, alone = twins(OptimizerType.ADAGRAD, ScorePolicy.LFU,
                           table_options=growing_options(ScorePolicy.LFU, init=32))
    gen = torch.Generator().manual_seed(5)
    kjts = [batch(gen) for _ in range(18)]
    for i in range(0, 18, 3):
        for module in (grouped, alone):  # two batches queued ahead: the second one grows
            module.prefetch(kjts[i]), module.prefetch(kjts[i + 1])
        outs = {id(m): [] for m in (grouped, alone)}
        for j in range(i, i + 3):
            pair = [m(kjts[j]) for m in (grouped, alone)]
            assert_same_outputs(*pair)
            for m, out in zip((grouped, alone), pair):
                outs[id(m)].append(out)
        for m in (grouped, alone):  # backwards after later forwards
            for out in outs[id(m)][:2]:
                sum((out[f].values() ** 2).sum() for f in FEATURES).backward()
    assert_same_module(grouped, alone)
    assert grouped.tables["t3"].tier.hash.capacity > 32


def test_a_lone_table_that_grows_is_a_group_of_one_on_its_own_arrays():
    options = {"t0": DynamicEmbTableOptions(init_capacity=64, max_capacity=4096,
                                            bucket_size=32)}
    grouped, alone = (DynamicEmbCollection(configs()[:1], table_options=options,
                                           group_tables=g) for g in (True, False))
    assert grouped_names(grouped) == [("t0",)]
    gen = torch.Generator().manual_seed(2)
    for _ in range(10):
        kjt = KeyedJaggedTensor.from_lengths_sync(
            ["f0"], torch.randint(0, 10**6, (96,), generator=gen), torch.full((12,), 8))
        outs = [m(kjt) for m in (grouped, alone)]
        assert_same_outputs(*outs)
        for out in outs:
            (out["f0"].values() ** 2).sum().backward()
    assert_same_module(grouped, alone)
    table = grouped.tables["t0"]
    assert table.tier.hash.capacity > 64
    (group,) = grouped._core.groups
    assert group.storage.arrays.keys.data_ptr() == table.tier.hash.arrays.keys.data_ptr()
    assert group.storage.weights.data_ptr() == table.tier.flat.weights.data_ptr()
    # on the CUDA kernels (numba's simulator stands in for the GPU) too
    from conftest import BACKENDS
    name, device = BACKENDS[1]
    fixed = DynamicEmbTableOptions(max_capacity=512, bucket_size=32)
    on_cuda = DynamicEmbCollection(configs()[:2], backend=name, device=torch.device(device),
                                   table_options={"t0": options["t0"], "t1": fixed})
    assert on_cuda.table_groups() == [("t0", "t1")]


def test_a_full_table_beside_tables_that_grow_raises_as_alone():
    """t0 and t2 grow, t3 does not and fills: the same error, and the same tables, as
    alone. (Alone, the tables after the one that refuses a batch claim nothing; in a group
    they claim too, and a growth stays: so the table that fills is the last one here.)"""
    options = growing_options(ScorePolicy.NO_EVICTION, init=32)
    options["t3"] = DynamicEmbTableOptions(max_capacity=64, bucket_size=32,
                                           score_strategy=ScorePolicy.NO_EVICTION)
    grouped, alone = (DynamicEmbCollection(configs(), table_options=options, group_tables=g,
                                           optimizer=OptimizerConfig(OptimizerType.SGD))
                      for g in (True, False))
    gen = torch.Generator().manual_seed(4)
    messages = []
    for module in (grouped, alone):
        gen.manual_seed(4)
        with pytest.raises(TableFullError) as err:
            for _ in range(30):
                step(module, batch(gen), weights=(1, 1, 1, 1))
        messages.append(str(err.value))
    assert messages[0] == messages[1] and "found no slot" in messages[0]
    assert_same_module(grouped, alone)
    assert grouped.tables["t0"].tier.hash.capacity > 32


def test_a_second_backward_through_one_grouped_forward_raises():
    grouped, _ = twins(OptimizerType.SGD)
    out = grouped(batch(torch.Generator().manual_seed(1)))
    loss = (out["f0"].values() ** 2).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already ran"):
        loss.backward()


def test_prefetch_state_shows_each_grouped_table_as_its_own_batch():
    grouped, alone = twins(OptimizerType.SGD)
    kjt = batch(torch.Generator().manual_seed(6))
    state_g, state_a = grouped.prefetch(kjt), alone.prefetch(kjt)
    assert isinstance(state_g.batches["t0"], GroupBatch)
    for name in ("t0", "t1", "t2", "t3"):
        keys_g, keys_a = state_g.unique_keys[name], state_a.unique_keys[name]
        assert sorted(keys_g.tolist()) == sorted(keys_a.tolist())
        slot_of_g = dict(zip(keys_g.tolist(), state_g.slots[name].tolist()))
        slot_of_a = dict(zip(keys_a.tolist(), state_a.slots[name].tolist()))
        assert slot_of_g == slot_of_a
    assert grouped.tables["t0"].has_batches_in_flight()
    grouped.clear_prefetched()
    assert not any(t.has_batches_in_flight() for t in grouped.tables.values())
    assert int(grouped.tables["t0"].tier.hash.pinned_count()) == 0


def test_memory_is_counted_per_table_as_alone():
    grouped, alone = twins(OptimizerType.ADAM)
    for name in grouped.tables:
        assert grouped.tables[name].memory_breakdown() == alone.tables[name].memory_breakdown()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(-5, 30), max_size=40), min_size=1, max_size=6),
       st.lists(st.sampled_from([0, 1, 3, 16]), min_size=6, max_size=6), st.booleans())
def test_segment_dedup_matches_a_python_model(segments, buckets, pad):
    """Exact (one table's unique keys after another's) or padded (each table's at the start
    of its keys' part, ``EMPTY_KEY`` with count 0 after them: the tables' form)."""
    keys = np.asarray([k for seg in segments for k in seg], dtype=np.int64)
    bounds = np.cumsum([0] + [len(s) for s in segments]).astype(np.int64)
    num_buckets = np.asarray(buckets[:len(segments)], dtype=np.int64)
    unique, inverse, counts = (np.empty(keys.size, dtype=np.int64) for _ in range(3))
    unique_bounds = np.empty(len(segments) + 1, dtype=np.int64)
    total = groups_cpu.dedup_segments_cpu(keys, bounds, num_buckets, pad, unique, inverse,
                                          counts, unique_bounds)
    expect_unique, expect_counts, expect_inverse, expect_bounds = [], [], [], [0]
    for seg, nb in zip(segments, num_buckets.tolist()):
        first = list(dict.fromkeys(seg))  # first-occurrence order
        if nb:  # stably by bucket: the order a table of nb buckets claims them in
            first.sort(key=lambda k: bucket_index(np.int64(k), nb))
        place = {k: expect_bounds[-1] + i for i, k in enumerate(first)}
        padding = len(seg) - len(first) if pad else 0
        expect_unique += first + [EMPTY_KEY] * padding
        expect_counts += [seg.count(k) for k in first] + [0] * padding
        expect_inverse += [place[k] for k in seg]
        expect_bounds.append(len(expect_unique))
    assert total == len(expect_unique)
    assert unique[:total].tolist() == expect_unique
    assert counts[:total].tolist() == expect_counts
    assert inverse.tolist() == expect_inverse
    assert unique_bounds.tolist() == expect_bounds


class _CustomStore(HostBackingStore):
    """A user's store (a subclass): its table runs alone, beside the group kernel's."""

    def insert(self, keys, rows, scores):
        return super().insert(keys, rows, scores)


@pytest.mark.parametrize("policy", [ScorePolicy.LFU_LRU, ScorePolicy.STEP, ScorePolicy.LRU])
def test_group_stores_that_grow_evict_or_are_a_users_match_their_twin(policy, monkeypatch):
    from dynemb.tables.group_stores import GroupStores
    width = 8 + OptimizerConfig(OptimizerType.ADAM).state_dim(8)
    stores = [lambda w, d, dev: HostBackingStore(w, d, dev, initial_capacity=64),  # grows
              lambda w, d, dev: HostBackingStore(w, d, dev, initial_capacity=64,
                                                 max_capacity=256),  # then forgets rows
              lambda w, d, dev: _CustomStore(w, d, dev),
              None]
    options = {f"t{i}": DynamicEmbTableOptions(caching=True, bucket_size=32,
                                               score_strategy=policy, backing_store=store,
                                               local_hbm_for_values=rows * width * 4)
               for i, (rows, store) in enumerate(zip((96, 96, 64, 128), stores))}
    grouped, alone = twins(OptimizerType.ADAM, policy, table_options=options)
    assert grouped_names(grouped) == [("t0", "t1", "t2", "t3")]
    in_kernel, left = set(), set()
    fill = GroupStores._fill_in_kernel

    def spy(self, claim, segments, run, initialize):
        out = fill(self, claim, segments, run, initialize)
        in_kernel.update(set(np.flatnonzero(run).tolist()) - set(out))
        left.update(out)
        return out
    monkeypatch.setattr(GroupStores, "_fill_in_kernel", spy)
    gen = torch.Generator().manual_seed(9)
    for _ in range(30):
        kjt = batch(gen)
        assert_same_outputs(step(grouped, kjt, (1, 1, 1, 1)), step(alone, kjt, (1, 1, 1, 1)))
    assert_same_module(grouped, alone)
    assert in_kernel == {0, 1, 3} and 2 not in left  # the user's store never reaches it
    assert 0 in left  # a store that had to grow ran alone, that step
    assert grouped.tables["t0"].store.capacity > 64
    assert grouped.stats()["t1"]["store_evictions"] > 0
    for name in grouped.tables:
        keys = torch.arange(2000)
        got, want = (m.read_rows(name, keys, with_state=True) for m in (grouped, alone))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert grouped.tables[name].store.hash_table.clock == \
            alone.tables[name].store.hash_table.clock
    assert grouped.flush() == alone.flush()
    grouped.eval(), alone.eval()  # the stores read in one kernel call, the user's by its find
    for _ in range(2):
        kjt = batch(gen, vocab=(2000, 2000, 2000, 4000))
        assert_same_outputs(grouped(kjt), alone(kjt))
    assert_same_module(grouped, alone)


@pytest.mark.parametrize("data_type", ["FP16", "BF16"])
def test_half_precision_tables_rounding_with_noise_are_groups_of_one_as_they_train_alone(data_type):
    """Rounding noise is drawn per table (its seed and id): such tables group only alone,
    and the group's update draws the noise the table alone draws, bit for bit."""
    from torchrec.modules.embedding_configs import DataType
    tables = [EmbeddingConfig(name=f"t{i}", embedding_dim=8, num_embeddings=n,
                              feature_names=[FEATURES[i]], data_type=DataType[data_type])
              for i, n in enumerate((200, 200, 120, 300))]
    rounding = {f"t{i}": DynamicEmbTableOptions(max_capacity=256, bucket_size=32, seed=i,
                                                stochastic_rounding=(i != 3))
                for i in range(4)}
    rounding["t2"] = DynamicEmbTableOptions(max_capacity=256, bucket_size=32, seed=5,
                                            stochastic_rounding=False)
    config = OptimizerConfig(OptimizerType.ADAM, learning_rate=0.05)
    grouped, alone = (DynamicEmbCollection(tables, table_options=rounding, optimizer=config,
                                           group_tables=g) for g in (True, False))
    assert grouped.table_groups() == [("t0",), ("t1",), ("t2", "t3")]
    gen = torch.Generator().manual_seed(8)
    for _ in range(6):
        kjt = batch(gen)
        assert_same_outputs(step(grouped, kjt), step(alone, kjt))
    assert_same_module(grouped, alone)
    # the noise is there: without it, the same training rounds differently
    plain = DynamicEmbCollection(tables, optimizer=config, table_options={
        name: DynamicEmbTableOptions(max_capacity=256, bucket_size=32, seed=o.seed,
                                     stochastic_rounding=False)
        for name, o in rounding.items()})
    gen = torch.Generator().manual_seed(8)
    for _ in range(6):
        step(plain, batch(gen))
    keys = torch.arange(900)
    assert not torch.equal(plain.read_rows("t0", keys)[0], grouped.read_rows("t0", keys)[0])


def test_a_group_of_one_works_on_its_tables_arrays_without_a_copy():
    """A lone table's group takes its arrays as they are (no second copy of a table that
    may fill most of the device); a table that was part of a bigger group is copied out of
    it, so that the old group's memory goes."""
    from dynemb.tables.groups import TableGroup
    from dynemb.tables.grouping import group_tables
    module = DynamicEmbCollection(configs()[:1], group_tables=False)
    table = module.tables["t0"]
    pointers = (table.tier.hash.arrays.keys.data_ptr(), table.tier.flat.weights.data_ptr(),
                table.counters.values.data_ptr())
    group = TableGroup([table])
    storage = group.storage
    assert (storage.arrays.keys.data_ptr(), storage.weights.data_ptr(),
            storage.counters.data_ptr()) == pointers
    assert (table.tier.hash.arrays.keys.data_ptr(), table.tier.flat.weights.data_ptr(),
            table.counters.values.data_ptr()) == pointers
    assert group.intact(module.tables)
    pair = DynamicEmbCollection(configs()[:2], group_tables=False)
    (big,) = group_tables(pair.tables)
    alone = TableGroup([pair.tables["t1"]])  # its arrays were views of the pair's
    assert alone.storage.arrays.keys.numel() == pair.tables["t1"].tier.hash.capacity
    keys = alone.storage.arrays.keys
    assert keys.untyped_storage().nbytes() == keys.numel() * 8
    assert big.storage.arrays.keys.untyped_storage().data_ptr() != \
        alone.storage.arrays.keys.untyped_storage().data_ptr()


def test_a_cache_table_without_a_partner_is_a_group_of_one_and_a_cuda_one_too():
    """A CACHE table with no partner is a group of one, as every table that can group; on
    the CUDA kernels (numba's simulator stands in for the GPU) a lone HBM_DIRECT table is a
    group of one, as on the host: it launches fewer kernels so."""
    cache = DynamicEmbTableOptions(caching=True, bucket_size=32, max_capacity=1024,
                                   local_hbm_for_values=64 * 24 * 4)
    one = DynamicEmbCollection(configs()[:1], table_options={"t0": cache},
                               optimizer=OptimizerConfig(OptimizerType.ADAM))
    assert one.storage_modes()["t0"].name == "CACHE" and one.table_groups() == [("t0",)]
    twin = DynamicEmbCollection(configs()[:1], table_options={"t0": cache}, group_tables=False,
                                optimizer=OptimizerConfig(OptimizerType.ADAM))
    gen = torch.Generator().manual_seed(3)
    for _ in range(6):  # 48 ids a step over 900 into 64 rows: evictions and loads
        kjt = KeyedJaggedTensor.from_lengths_sync(
            ["f0"], torch.randint(0, 900, (48,), generator=gen), torch.full((12,), 4))
        outs = [m(kjt) for m in (one, twin)]
        assert_same_outputs(*outs)
        for out in outs:
            (out["f0"].values() ** 2).sum().backward()
    assert_same_module(one, twin)
    assert one.stats()["t0"]["loads"] > 0
    pair = DynamicEmbCollection(configs()[:2], table_options={"t0": cache, "t1": cache},
                                optimizer=OptimizerConfig(OptimizerType.ADAM))
    assert pair.table_groups() == [("t0", "t1")]
    from conftest import BACKENDS
    name, device = BACKENDS[1]
    module = DynamicEmbCollection(configs(dims=(8, 8, 16, 8)), backend=name,
                                  device=torch.device(device))
    assert module.table_groups() == [("t0", "t1", "t3"), ("t2",)]
    host = DynamicEmbCollection(configs(dims=(8, 8, 16, 8)))
    assert host.table_groups() == [("t0", "t1", "t3"), ("t2",)]


@pytest.mark.parametrize("change", ["reset", "load"])
def test_a_late_backward_refused_after_a_reset_or_a_load_says_the_same_grouped_or_not(change):
    """Grouped, the forward's tables are one batch; alone, four, and the first backward to
    run would name only its own table: both name the forward's tables, word for word."""
    messages = []
    for module in twins(OptimizerType.SGD):
        gen = torch.Generator().manual_seed(21)
        step(module, batch(gen))
        state = module.state_dict()
        out = module(batch(gen))
        if change == "reset":
            module.reset_parameters(tables=["t2"])
        else:
            module.load_state_dict(state)
        with pytest.raises(RuntimeError) as refused:
            sum((out[f].values() ** 2).sum() for f in FEATURES).backward()
        messages.append(str(refused.value))
    assert messages[0] == messages[1] == (
        "a checkpoint was loaded or tables were reset after this forward (of tables ['t0', "
        "'t1', 't2', 't3']); its backward would update rows that are no longer there. Run a "
        "new forward")
