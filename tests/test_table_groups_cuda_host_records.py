"""Table groups on the CUDA kernels (numba's simulator without a GPU) whose records live in
host memory: HOST_ONLY groups (their one record on the host, claimed by the host kernels, the
rows read and updated where the module is) and DEFAULT groups (a device record on CUDA and a
host record by the host kernels). Each trains bit for bit as its tables in groups of one
(``group_tables=False``), and refuses keys where and as they do; without admission or
pooling, each also trains as the group model (tests/group_reference.py)."""
from __future__ import annotations

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbBagCollection, DynamicEmbCollection, DynamicEmbTableOptions,
                    Initializer, InitializerKind, OptimizerConfig, OptimizerType)
from dynemb.options import StorageMode
from dynemb.types import ScorePolicy, TableFullError
from group_reference import GroupReference
from test_table_groups_cuda import (DEVICE, DIM, KERNELS, assert_same_tables, batch, dense,
                                    squares_gradient, tables, train)


def train_ahead(grouped, alone, kjts, scores=None, reference=None):
    """Both modules train on ``kjts[:-1]``, each step's batch prefetched one step ahead, an
    output left out of the loss at odd steps (``scores(step)``: a CUSTOMIZED score per table,
    -1 for the first prefetch); the outputs of every step are equal, and ``reference`` (a
    ``GroupReference`` of ``grouped``) follows each step."""
    given = scores or (lambda step: None)
    for module in (grouped, alone):
        if scores is not None:
            module.set_scores(scores(-1))
        module.prefetch(kjts[0])
    if reference is not None:
        reference.prefetch(kjts[0], given(-1))
    for step in range(len(kjts) - 1):
        outs = []
        used = ["f0", "f2"] if step % 2 else ["f0", "f1", "f2"]
        for module in (grouped, alone):
            if scores is not None:
                module.set_scores(scores(step))
            module.prefetch(kjts[step + 1])
            outs.append(train(module, kjts[step], used))
        for f in outs[0]:
            assert torch.equal(outs[0][f], outs[1][f]), (step, f)
        if reference is not None:
            reference.prefetch(kjts[step + 1], given(step))
            reference.step(kjts[step], outs[0], squares_gradient(used))
    grouped.clear_prefetched(), alone.clear_prefetched()
    if reference is not None:
        reference.clear_prefetched()
        reference.check()


def eval_alike(grouped, alone, kjt, pooled):
    """An eval forward of ``kjt`` gives the same outputs, changes the tables alike (counters,
    rows of its ids) and leaves no pins."""
    grouped.eval(), alone.eval()
    with torch.no_grad():
        dense_g, dense_a = dense(grouped(kjt), pooled), dense(alone(kjt), pooled)
    for f in dense_g:
        assert torch.equal(dense_g[f].cpu(), dense_a[f].cpu()), f
    assert_same_tables(grouped, alone, kjt.values().unique())
    assert sum(int(t.tier.hash.pinned_count()) for t in grouped.tables.values()) == 0


@pytest.mark.parametrize("pooled", [False, True], ids=["sequence", "pooled"])
@pytest.mark.parametrize("admits", [False, True], ids=["plain", "admission"])
def test_host_only_tables_group_on_the_cuda_kernels_as_alone(admits, pooled):
    """HOST_ONLY tables of a module on the CUDA kernels: one record in host memory, claimed by
    the host kernels, the rows read and updated by the CUDA kernels where the module is (as
    each table alone). 64 rows for 120 ids per table (with admission 32 for 60): evictions;
    an output left out of the loss at times; batches prefetched ahead; then an eval step with
    per-table eval rows.
    Outputs, rows with their optimizer state, counters and steps equal the tables' alone:
    the group claims each table's keys in the order the table alone claims them (so among
    rows of equal scores it evicts the same)."""
    from dynemb import FrequencyAdmission
    options = {f"t{i}": DynamicEmbTableOptions(
        local_hbm_for_values=0, max_capacity=32 if admits else 64, bucket_size=16,
        stochastic_rounding=False, score_strategy=ScorePolicy.LFU,
        eval_initializer=Initializer(InitializerKind.CONSTANT, value=float(i + 2)),
        admission=FrequencyAdmission(2) if admits else None) for i in range(3)}
    module = DynamicEmbBagCollection if pooled else DynamicEmbCollection
    grouped, alone = [module(tables(3, pooled=pooled), table_options=options,
                             optimizer=OptimizerConfig(OptimizerType.ADAM, learning_rate=0.05),
                             device=DEVICE, backend=KERNELS, group_tables=g)
                      for g in (True, False)]
    assert set(grouped.storage_modes().values()) == {StorageMode.HOST_ONLY}
    assert grouped.table_groups() == [("t0", "t1", "t2")]
    assert alone.table_groups() == [("t0",), ("t1",), ("t2",)]
    storage = grouped._core.groups[0].storage
    assert storage.serves_elsewhere and storage.kernels.name == "cpu"
    assert storage.serve_kernels.name == "cuda"
    gen = torch.Generator().manual_seed(8)
    vocab = 60 if admits else 120  # with admission, ids seen twice take rows
    # the group model (tests/group_reference.py) neither pools nor admits
    reference = None if pooled or admits else GroupReference(grouped)
    train_ahead(grouped, alone, [batch(gen, 3, per_table=12, vocab=vocab) for _ in range(9)],
                reference=reference)
    stats = grouped.stats()
    assert all(s["evictions"] > 0 for s in stats.values())
    if admits:
        assert all(s["admission_rejects"] > 0 for s in stats.values())
    assert_same_tables(grouped, alone, torch.arange(vocab, device=DEVICE))
    assert grouped.steps == alone.steps
    eval_alike(grouped, alone, batch(gen, 3, vocab=200), pooled)  # unseen ids too


@pytest.mark.parametrize("policy, admits, pooled", [(ScorePolicy.LRU, False, False),
                                                    (ScorePolicy.CUSTOMIZED, False, True),
                                                    (ScorePolicy.LFU, True, False)],
                         ids=["lru", "customized_pooled", "lfu_admission"])
def test_default_tables_group_on_the_cuda_kernels_as_alone(policy, admits, pooled):
    """DEFAULT tables on the CUDA kernels: the device tiers claim and fill as an HBM_DIRECT
    group there, the host tiers by the host kernels (their keys copied to the host once per
    group), the host rows read and updated where the module is, as each table alone. Device
    tiers of 16-32 rows, 48-64 in all, for 300 ids (admitted at the 2nd sighting of 60):
    evictions in both; an output left out of the loss at times;
    batches prefetched ahead; an eval step with per-table eval rows. Outputs, rows of both
    tiers with their optimizer state, counters and steps equal the tables' alone."""
    from dynemb import FrequencyAdmission
    row_bytes = 4 * (DIM + OptimizerConfig(OptimizerType.ADAM).state_dim(DIM))
    options = {f"t{i}": DynamicEmbTableOptions(
        global_hbm_for_values=rows * row_bytes, max_capacity=48 if admits else 64,
        bucket_size=16, score_strategy=policy,
        stochastic_rounding=False, seed=5 + i,
        eval_initializer=Initializer(InitializerKind.CONSTANT, value=float(i + 2)),
        admission=FrequencyAdmission(2) if admits else None)
        for i, rows in enumerate((16, 16, 32))}
    module = DynamicEmbBagCollection if pooled else DynamicEmbCollection
    configs = tables(3, rows=40, pooled=pooled)
    grouped, alone = [module(configs, table_options=options, device=DEVICE, backend=KERNELS,
                             optimizer=OptimizerConfig(OptimizerType.ADAM, learning_rate=0.05),
                             group_tables=g) for g in (True, False)]
    assert set(grouped.storage_modes().values()) == {StorageMode.DEFAULT}
    assert grouped.table_groups() == [("t0", "t1", "t2")]
    assert alone.table_groups() == [("t0",), ("t1",), ("t2",)]
    gen = torch.Generator().manual_seed(12)
    vocab, per_table = (60, 18) if admits else (300, 12)
    scores = ((lambda step: {f"t{i}": 100 + 3 * step + i for i in range(3)})
              if policy is ScorePolicy.CUSTOMIZED else None)
    # the group model (tests/group_reference.py) neither pools nor admits
    reference = None if pooled or admits else GroupReference(grouped)
    train_ahead(grouped, alone, [batch(gen, 3, per_table=per_table, vocab=vocab)
                                 for _ in range(9)], scores, reference)
    stats = grouped.stats()
    assert all(s["rows_device"] > 0 and s["rows_backing"] > 0 for s in stats.values())
    if admits:
        assert all(s["admission_rejects"] > 0 for s in stats.values())
        assert sum(s["evictions"] for s in stats.values()) > 0
    else:
        assert all(s["evictions"] > 0 for s in stats.values())
    assert_same_tables(grouped, alone, torch.arange(vocab, device=DEVICE))
    assert grouped.steps == alone.steps
    eval_alike(grouped, alone, batch(gen, 3, vocab=500), pooled)  # unseen ids too
    assert all(int(t.host_tier.hash.pinned_count()) == 0 for t in grouped.tables.values())


@pytest.mark.parametrize("full_tier", ["host", "device"])
def test_a_full_tier_of_a_default_group_on_the_cuda_kernels_refuses_as_alone(full_tier):
    """NO_EVICTION DEFAULT tables of 4 device and 4 host rows on the CUDA kernels. Keys the
    host tiers refuse raise in that forward, naming the table, with no table changed (the
    host claim is by the host kernels); keys the device tiers refuse are served zeros and
    reported at the next prefetch. Either way grouped and alone agree, and train on."""
    from dynemb.foundations.key_mixing import routes_to_first
    options = DynamicEmbTableOptions(local_hbm_for_values=4 * DIM * 4, bucket_size=4,
                                     max_capacity=8, score_strategy=ScorePolicy.NO_EVICTION)
    grouped, alone = [DynamicEmbCollection(
        tables(2, rows=8), table_options=options, device=DEVICE, backend=KERNELS,
        optimizer=OptimizerConfig(OptimizerType.SGD, learning_rate=0.1), group_tables=g)
        for g in (True, False)]
    assert set(grouped.storage_modes().values()) == {StorageMode.DEFAULT}
    assert grouped.table_groups() == [("t0", "t1")]
    ids = torch.arange(1, 300)
    on_device = routes_to_first(ids, 4, 8)
    dev, host = ids[on_device].tolist(), ids[~on_device].tolist()

    def kjt(t0, t1):
        return KeyedJaggedTensor.from_lengths_sync(
            ["f0", "f1"], torch.tensor(t0 + t1), torch.tensor([len(t0), len(t1)])).to(DEVICE)

    both = [kjt([dev[0], host[0]], [dev[0], host[0]])]
    overfull = (kjt(dev[1:3] + host[1:5], [dev[1]]) if full_tier == "host"
                else kjt(dev[1:5] + host[1:3], [dev[1]]))
    keys = torch.tensor(dev[:5] + host[:5], device=DEVICE)
    for module in (grouped, alone):
        train(module, both[0], ["f0", "f1"])
    if full_tier == "host":
        for module in (grouped, alone):
            before = {n: module.read_rows(n, keys, with_state=True) for n in module.tables}
            with pytest.raises(TableFullError, match="'t0'.*host tier.*Nothing was inserted"):
                train(module, overfull, ["f0", "f1"])
            for n, (rows, found) in before.items():
                now_rows, now_found = module.read_rows(n, keys, with_state=True)
                assert torch.equal(now_found, found) and torch.equal(now_rows, rows), n
    else:
        outs = [train(module, overfull, ["f0", "f1"]) for module in (grouped, alone)]
        assert torch.equal(outs[0]["f0"], outs[1]["f0"])
        assert bool((outs[0]["f0"] == 0).all(1).any())  # a refused key read zeros
        for module in (grouped, alone):
            with pytest.raises(TableFullError, match="'t0'"):
                module(kjt([dev[0]], [dev[0]]))  # reported at the next prefetch
    assert_same_tables(grouped, alone, keys)
    outs = [train(module, kjt([dev[0]], [host[0]]), ["f0", "f1"]) for module in (grouped, alone)]
    for f in outs[0]:
        assert torch.equal(outs[0][f], outs[1][f]), f
    assert_same_tables(grouped, alone, keys)
