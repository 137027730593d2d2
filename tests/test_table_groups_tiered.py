"""DEFAULT tables in a group (dynemb.tables.group_tiers): on the host kernels a module's
DEFAULT tables train as one group over two records (their device tiers and their host
tiers), and must agree bit for bit with the same tables run one by one
(``group_tables=False``): outputs, rows of both tiers, optimizer state, scores, counters,
steps, errors, pins."""
from __future__ import annotations

import pickle

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from dynemb import (DynamicEmbBagCollection, DynamicEmbCollection, DynamicEmbTableOptions,
                    Initializer, InitializerKind)
from dynemb.options import StorageMode
from dynemb import FrequencyAdmission
from dynemb.rows.optimizers import OptimizerConfig, OptimizerType
from dynemb.tables.group_tiers import TieredBatch
from dynemb.types import ScorePolicy
from group_reference import GroupReference
from test_table_groups import (FEATURES, assert_same_module, assert_same_outputs, batch,
                               configs, loss_gradient, refusal_messages, step)

#: each table's device rows (its budget, in rows of the widest optimizer state: fewer
#: device rows than ids, so its host tier holds the rest)
DEVICE_ROWS = (64, 64, 32, 128)
ROW_BYTES = 4 * (8 + OptimizerConfig(OptimizerType.ADAM).state_dim(8))


def tiered_options(policy=ScorePolicy.LRU, admission=None, **more):
    return {f"t{i}": DynamicEmbTableOptions(global_hbm_for_values=rows * ROW_BYTES,
                                            bucket_size=32, score_strategy=policy, seed=3 + i,
                                            admission=admission, **more)
            for i, rows in enumerate(DEVICE_ROWS)}


def tiered_twins(optimizer=OptimizerType.ADAM, policy=ScorePolicy.LRU, options=None,
                 rows=(200, 200, 120, 300)):
    options = options or tiered_options(policy)
    decay = 0.01 if optimizer is OptimizerType.ADAM else 0.0
    config = OptimizerConfig(optimizer, learning_rate=0.05, weight_decay=decay,
                             max_gradient=0.5)
    modules = [DynamicEmbCollection(configs(rows=rows), table_options=options,
                                    optimizer=config, group_tables=grouped)
               for grouped in (True, False)]
    assert set(modules[0].storage_modes().values()) == {StorageMode.DEFAULT}
    return modules


def tiered_rows(module):
    """Every table's live rows per tier, as the tier holds them."""
    return {name: (t.stats()["rows_device"], t.stats()["rows_backing"])
            for name, t in module.tables.items()}


def scores_at(i, policy):
    return ({f"t{t}": 1000 + 7 * i + t for t in range(4)}
            if policy is ScorePolicy.CUSTOMIZED else None)


@pytest.mark.parametrize("optimizer", list(OptimizerType))
@pytest.mark.parametrize("policy", [ScorePolicy.LRU, ScorePolicy.LFU, ScorePolicy.CUSTOMIZED])
def test_default_tables_group_and_train_bit_for_bit_as_alone(optimizer, policy):
    """Against the tables one by one, and against the group model."""
    grouped, alone = tiered_twins(optimizer, policy)
    assert grouped.table_groups() == [("t0", "t1", "t2", "t3")]
    assert alone.table_groups() == [("t0",), ("t1",), ("t2",), ("t3",)]  # groups of one
    reference = GroupReference(grouped)
    gen = torch.Generator().manual_seed(7)
    for i in range(20):
        kjt = batch(gen)
        scores = scores_at(i, policy)
        out = step(grouped, kjt, scores=scores)
        assert_same_outputs(out, step(alone, kjt, scores=scores))
        reference.step(kjt, out, loss_gradient(), scores=scores)
    assert_same_module(grouped, alone)
    reference.check()
    stats = grouped.stats()
    for name in ("t0", "t3"):  # both tiers hold rows, and both evicted
        assert stats[name]["rows_device"] > 0 and stats[name]["rows_backing"] > 0
    assert stats["t3"]["evictions"] > 0
    assert grouped.steps["t2"] == 0  # its output never reached a loss: never updated
    state = grouped.prefetch(batch(gen))
    assert isinstance(state.batches["t0"], TieredBatch)
    assert state.batches["t0"] is state.batches["t3"]


def test_default_tables_with_admission_group_and_train_bit_for_bit_as_alone():
    admission = FrequencyAdmission(2, initializer=Initializer(InitializerKind.CONSTANT,
                                                              value=0.25))
    grouped, alone = tiered_twins(OptimizerType.ROWWISE_ADAGRAD,
                                  options=tiered_options(ScorePolicy.LFU, admission))
    assert grouped.table_groups() == [("t0", "t1", "t2", "t3")]
    gen = torch.Generator().manual_seed(17)
    for _ in range(15):
        kjt = batch(gen, vocab=(300, 300, 400, 600))
        assert_same_outputs(step(grouped, kjt), step(alone, kjt))
    assert_same_module(grouped, alone)
    assert all(s["admission_rejects"] > 0 for s in grouped.stats().values())


def test_eval_and_no_grad_lookups_of_default_groups_match_their_twin():
    """Eval finds keys in both tiers; a key in neither reads its table's eval_initializer
    row (seeded per table); no pins are left."""
    initializers = [Initializer(InitializerKind.CONSTANT, value=3.0),
                    Initializer(InitializerKind.NORMAL, mean=0.5, std=0.1),
                    Initializer(InitializerKind.UNIFORM, low=-2.0, high=-1.0),
                    Initializer(InitializerKind.CONSTANT, value=-4.0)]
    options = tiered_options()
    for i, name in enumerate(sorted(options)):
        options[name] = DynamicEmbTableOptions(global_hbm_for_values=DEVICE_ROWS[i] * ROW_BYTES,
                                               bucket_size=32, seed=3 + i,
                                               eval_initializer=initializers[i])
    grouped, alone = tiered_twins(OptimizerType.ADAGRAD, options=options)
    reference = GroupReference(grouped)
    gen = torch.Generator().manual_seed(5)
    for _ in range(6):
        kjt = batch(gen)
        out = step(grouped, kjt)
        step(alone, kjt)
        reference.step(kjt, out, loss_gradient())
    kjt = batch(gen, vocab=(3000, 3000, 3000, 3000))
    with torch.no_grad():
        out = grouped(kjt)
        assert_same_outputs(out, alone(kjt))
        reference.lookup(kjt, out)
    grouped.eval(), alone.eval(), reference.eval()
    for _ in range(2):
        kjt = batch(gen, vocab=(3000, 3000, 3000, 3000))
        grouped.prefetch(kjt), alone.prefetch(kjt)  # eval batches queued ahead
        out = grouped(kjt)
        assert_same_outputs(out, alone(kjt))
        reference.lookup(kjt, out)
        assert (out["f0"].values() == 3.0).all(1).any()  # t0's unseen keys: its eval rows
    assert_same_module(grouped, alone)
    reference.check()
    for table in grouped.tables.values():
        assert not table.has_batches_in_flight()
        assert int(table.tier.hash.pinned_count()) == 0
        assert int(table.host_tier.hash.pinned_count()) == 0
    assert grouped.stats()["t0"]["misses"] > 0


def test_a_full_default_table_raises_its_error_and_its_group_changes_nothing():
    """NO_EVICTION tiers that fill: the group undoes both claims of every table and raises
    the error of the table (and tier) that refused the batch, the message the table alone
    raises."""
    options = {f"t{i}": DynamicEmbTableOptions(global_hbm_for_values=32 * 32, bucket_size=32,
                                               score_strategy=ScorePolicy.NO_EVICTION)
               for i in range(4)}  # 32 device rows of 8 floats; the host tier the rest
    grouped, alone = tiered_twins(OptimizerType.SGD, options=options, rows=(100,) * 4)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        kjt = batch(gen, vocab=(40, 40, 40, 40))
        assert_same_outputs(step(grouped, kjt), step(alone, kjt))
    kjt = batch(gen, ids_per_table=(24, 24, 24, 480), vocab=(40, 40, 40, 100_000))
    rows_before = tiered_rows(grouped)
    messages = refusal_messages((grouped, alone), kjt, "table 't3'.* tier")
    assert messages[0] == messages[1]
    assert tiered_rows(grouped) == rows_before
    for table in grouped.tables.values():
        assert int(table.tier.hash.pinned_count()) == 0
        assert int(table.host_tier.hash.pinned_count()) == 0
    kjt = batch(gen, vocab=(40, 40, 40, 40))
    out = step(grouped, kjt)  # the group trains on
    assert out["f0"].values().shape[0] == 48


def test_pooled_default_tables_group_and_match_their_twin():
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=n,
                                 feature_names=[FEATURES[i]])
              for i, n in enumerate((200, 200, 120, 300))]
    config = OptimizerConfig(OptimizerType.ADAM, learning_rate=0.05)
    grouped, alone = (DynamicEmbBagCollection(tables, table_options=tiered_options(),
                                              optimizer=config, group_tables=g)
                      for g in (True, False))
    assert grouped.table_groups() == [("t0", "t1", "t2", "t3")]
    reference = GroupReference(grouped)
    gen = torch.Generator().manual_seed(23)
    for _ in range(10):
        kjt = batch(gen)
        outs = []
        for module in (grouped, alone):
            out = module(kjt)
            (out.values() ** 2).sum().backward()
            outs.append(out)
        assert torch.equal(outs[0].values(), outs[1].values())
        reference.step(kjt, outs[0], lambda f, pooled: 2 * pooled)
    assert_same_module(grouped, alone)
    reference.check()


def test_late_backwards_state_dicts_and_pickles_of_default_groups_match_their_twin():
    """Batches prefetched ahead, a backward after the next step (its rows may be evicted
    by then: dropped updates), a state dict loaded into the other kind of module, a pickled
    grouped module: all as the tables alone."""
    grouped, alone = tiered_twins(OptimizerType.ADAM, ScorePolicy.LFU, rows=(150, 150, 100, 200))
    gen = torch.Generator().manual_seed(41)
    for _ in range(8):  # backwards after two more forwards: pins ended, rows evicted
        kjts = [batch(gen) for _ in range(3)]
        for module in (grouped, alone):
            module.prefetch(kjts[0]), module.prefetch(kjts[1])  # queued ahead
            outs = [module(kjt) for kjt in kjts]
            for out in outs:
                sum((out[f].values() ** 2).sum() for f in FEATURES).backward()
    assert_same_module(grouped, alone)
    assert sum(s["dropped_updates"] for s in grouped.stats().values()) > 0
    fresh, _ = tiered_twins(OptimizerType.ADAM, ScorePolicy.LFU, rows=(150, 150, 100, 200))
    fresh.load_state_dict(alone.state_dict())
    copy = pickle.loads(pickle.dumps(grouped))
    assert copy.table_groups() == [("t0", "t1", "t2", "t3")]
    for _ in range(5):
        kjt = batch(gen)
        outs = [step(m, kjt) for m in (grouped, alone, fresh, copy)]
        for out in outs[1:]:
            assert_same_outputs(outs[0], out)
    for module in (alone, fresh, copy):
        assert_same_module(grouped, module)


def test_default_tables_on_the_cuda_kernels_group_too():
    """On the CUDA kernels (numba's simulator stands in for the GPU) the DEFAULT tables group
    as on the host kernels: the device record on CUDA, the host record by the host kernels
    (tests/test_table_groups_cuda.py trains them)."""
    from conftest import BACKENDS
    name, device = BACKENDS[1]
    module = DynamicEmbCollection(configs(), table_options=tiered_options(), backend=name,
                                  device=torch.device(device))
    assert set(module.storage_modes().values()) == {StorageMode.DEFAULT}
    assert module.table_groups() == [("t0", "t1", "t2", "t3")]


@pytest.mark.parametrize("data_type", ["FP16", "BF16"])
def test_half_precision_default_tables_group_as_alone(data_type):
    """Rows of float16 / bfloat16 in both tiers: tables rounding with noise (drawn per table)
    are groups of one, the others group; all train as alone, bit for bit."""
    from torchrec.modules.embedding_configs import DataType, EmbeddingConfig
    tables = [EmbeddingConfig(name=f"t{i}", embedding_dim=8, num_embeddings=n,
                              feature_names=[FEATURES[i]], data_type=DataType[data_type])
              for i, n in enumerate((200, 200, 120, 300))]
    options = {f"t{i}": DynamicEmbTableOptions(global_hbm_for_values=rows * ROW_BYTES,
                                               bucket_size=32, seed=i,
                                               stochastic_rounding=(i == 0))
               for i, rows in enumerate(DEVICE_ROWS)}
    config = OptimizerConfig(OptimizerType.ADAM, learning_rate=0.05)
    grouped, alone = (DynamicEmbCollection(tables, table_options=options, optimizer=config,
                                           group_tables=g) for g in (True, False))
    assert set(grouped.storage_modes().values()) == {StorageMode.DEFAULT}
    assert grouped.table_groups() == [("t0",), ("t1", "t2", "t3")]
    gen = torch.Generator().manual_seed(8)
    for _ in range(8):
        kjt = batch(gen)
        assert_same_outputs(step(grouped, kjt), step(alone, kjt))
    assert_same_module(grouped, alone)
    assert grouped.stats()["t3"]["rows_backing"] > 0


def test_resetting_one_default_table_regroups_and_matches_the_twin():
    """A reset table is a new table: the group is built again around it (both records), a
    batch in flight when it happened ends its pins, and training goes on as alone."""
    grouped, alone = tiered_twins(OptimizerType.SGD)
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        kjt = batch(gen)
        step(grouped, kjt), step(alone, kjt)
    kjt = batch(gen)
    for module in (grouped, alone):
        module(kjt)  # a forward whose backward never comes
        module.reset_parameters(tables=["t1"])
    assert grouped.stats()["t1"]["rows_device"] == grouped.stats()["t1"]["rows_backing"] == 0
    for _ in range(4):
        kjt = batch(gen)
        assert_same_outputs(step(grouped, kjt), step(alone, kjt))
    assert_same_module(grouped, alone)
    assert grouped.table_groups() == [("t0", "t1", "t2", "t3")]
