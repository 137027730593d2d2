"""Memory stashing of table groups, on CPU: tables that stash and group stash their group's
rows as one (one host copy, one release, one restore), and train exactly as the same tables
one by one (``group_tables=False``, each stashing its own rows) and as tables that do not
stash, bit for bit. Between a training forward and its backward no byte of the group's rows
stays on the device: neither the group's tensor nor any table's view of it. Then the hazards
tests/test_stashing.py runs on single tables, on a group: the next prefetch while stashed
(its new rows wait for the rows to return), a growth, an eval forward, ``read_rows`` and a
``state_dict`` while stashed, a view kept across a step.
"""
import warnings

import pytest
import torch
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, Initializer, InitializerKind,
                    OptimizerConfig, OptimizerType)
from dynemb.options import StashMode

NAMES = ("t0", "t1", "t2")
IDS = 300
INIT = Initializer(InitializerKind.UNIFORM, low=-0.1, high=0.1)


def _configs():
    return [EmbeddingConfig(name=name, embedding_dim=8, num_embeddings=512,
                            feature_names=[f"f{i}"]) for i, name in enumerate(NAMES)]


def _collection(stash=StashMode.NONE, mode="hbm_direct", group_tables=True,
                optimizer=OptimizerType.ADAM, grows=()):
    config = OptimizerConfig(optimizer, learning_rate=0.05, eps=1e-6)
    row_bytes = (8 + config.state_dim(8)) * 4
    options = {name: DynamicEmbTableOptions(
        caching=mode == "cache", max_capacity=512, bucket_size=16, initializer=INIT, seed=1,
        init_capacity=64 if name in grows else None,
        local_hbm_for_values=64 * row_bytes if mode == "cache" else None, stash=stash)
        for name in NAMES}
    return DynamicEmbCollection(_configs(), table_options=options, optimizer=config,
                                group_tables=group_tables)


def _batches(steps, seed=0, ids=IDS):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 6, (3 * 4,), generator=g)
        values = torch.randint(0, ids, (int(lengths.sum()),), generator=g)
        out.append(KeyedJaggedTensor.from_lengths_sync([f"f{i}" for i in range(3)], values,
                                                       lengths))
    return out


def _loss(out):
    return sum((jt.values() ** 2).sum() + jt.values().sum() for jt in out.values())


def _assert_same_rows(a, b):
    keys = torch.arange(IDS)
    for name in NAMES:
        rows, found = a.read_rows(name, keys, with_state=True)
        other_rows, other_found = b.read_rows(name, keys, with_state=True)
        assert torch.equal(found, other_found), name
        assert torch.equal(rows, other_rows), name
    assert a.stats() == b.stats()


def _device_bytes(ec):
    """Bytes the rows hold now, read without bringing them back: the group's tensor and
    each table's view of it."""
    stash = ec.memory_stash.table_stashes()["t0"]
    views = [getattr(t.tier.flat, "stands_in_for", t.tier.flat).weights
             for t in ec.tables.values()]
    return [stash.rows().untyped_storage().nbytes()] + [v.untyped_storage().nbytes()
                                                       for v in views]


def _train(ec, batches, prefetch_ahead=False, between=None):
    if prefetch_ahead:
        ec.prefetch(batches[0])
    for step, kjt in enumerate(batches):
        out = ec(kjt)
        if prefetch_ahead and step + 1 < len(batches):
            ec.prefetch(batches[step + 1])  # as the prefetch pipeline does
        if between is not None:
            between(ec, out)
        _loss(out).backward()


@pytest.mark.parametrize("stash", [StashMode.ALL, StashMode.VALUES, StashMode.OPTIMIZER_STATE])
@pytest.mark.parametrize("mode", ["hbm_direct", "cache"])
def test_a_stashing_group_trains_as_its_tables_alone_and_as_without_stashing(mode, stash):
    plain = _collection(mode=mode)
    grouped = _collection(stash, mode)
    alone = _collection(stash, mode, group_tables=False)
    assert grouped.table_groups() == [NAMES] and alone.table_groups() == [(n,) for n in NAMES]
    stashes = grouped.memory_stash.table_stashes()
    assert stashes["t0"] is stashes["t1"] is stashes["t2"]  # one stash for the group
    seen = []

    def check_stashed(ec, out):
        if ec is grouped:
            assert ec.memory_stash.stashed == list(NAMES)
            seen.append(_device_bytes(ec))
            whole = ec.memory_stash.table_stashes()["t0"].stashed_bytes
            assert ec.memory_stash.stashed_bytes() == whole > 0

    outs = {}
    for ec in (plain, grouped, alone):
        outs[id(ec)] = []
        for kjt in _batches(6, seed=3):
            out = ec(kjt)
            check_stashed(ec, out)
            outs[id(ec)].append({f: jt.values().detach() for f, jt in out.items()})
            _loss(out).backward()
            assert ec.memory_stash is None or ec.memory_stash.stashed == []
    for got, want in zip(outs[id(grouped)], outs[id(plain)]):
        for f in want:
            assert torch.equal(got[f], want[f]), f
    assert outs[id(alone)] == outs[id(alone)]
    for got, want in zip(outs[id(alone)], outs[id(plain)]):
        for f in want:
            assert torch.equal(got[f], want[f]), f
    if stash is StashMode.ALL:
        assert all(set(b) == {0} for b in seen)  # no byte of the rows stayed
    _assert_same_rows(grouped, plain)
    _assert_same_rows(alone, plain)
    stash_of = grouped.memory_stash.table_stashes()["t0"]
    assert (stash_of.stashes, stash_of.restores) == (6, 6)
    assert 0 not in _device_bytes(grouped)


@pytest.mark.parametrize("mode", ["hbm_direct", "cache"])
def test_the_next_prefetch_while_a_group_is_stashed(mode):
    """Its new rows wait for the group's rows to return (HBM_DIRECT: nothing restored
    early); a CACHE group's write-backs bring them back first."""
    plain, grouped, alone = (_collection(s, mode, group_tables=g) for s, g in (
        (StashMode.NONE, True), (StashMode.ALL, True), (StashMode.ALL, False)))
    for ec in (plain, grouped, alone):
        _train(ec, _batches(8, seed=5), prefetch_ahead=True)
    _assert_same_rows(grouped, plain)
    _assert_same_rows(alone, plain)
    stash = grouped.memory_stash.table_stashes()["t0"]
    if mode == "hbm_direct":
        assert stash.replayed_inits > 0 and stash.restores_on_access == 0
    else:
        assert stash.restores_on_access > 0


def test_a_table_of_a_stashing_group_grows_while_stashed():
    plain, grouped = (_collection(s, grows=("t1",)) for s in (StashMode.NONE, StashMode.ALL))
    capacity = grouped.tables["t1"].tier.hash.capacity
    for ec in (plain, grouped):
        _train(ec, _batches(6, seed=8), prefetch_ahead=True)
    assert grouped.tables["t1"].tier.hash.capacity > capacity
    assert grouped.table_groups() == [NAMES]
    assert grouped.memory_stash.table_stashes()["t0"].restores_on_access > 0
    _assert_same_rows(grouped, plain)
    for ec in (plain, grouped):  # the stash follows the group's new rows
        _train(ec, _batches(2, seed=9))
    assert grouped.memory_stash.table_stashes()["t0"].stashes == 8
    _assert_same_rows(grouped, plain)


def test_reads_of_a_stashed_group_bring_its_rows_back():
    """An eval forward, read_rows, a state_dict between forward and backward: each sees the
    rows, as without stashing, and the backward ends as it does there."""
    plain, grouped = (_collection(s, "cache") for s in (StashMode.NONE, StashMode.ALL))
    train, probe = _batches(2, seed=11)
    seen = {}

    def reads(ec, out):
        with torch.no_grad():
            no_grad = {f: jt.values() for f, jt in ec(probe).items()}
        rows = ec.read_rows("t2", torch.arange(IDS), with_state=True)
        state = {k: v.clone() for k, v in ec.state_dict().items()}
        seen[ec is grouped] = (no_grad, rows, state)

    for ec in (plain, grouped):
        _train(ec, [train], between=reads)
    (got_out, got_rows, got_state), (want_out, want_rows, want_state) = seen[True], seen[False]
    for f in want_out:
        assert torch.equal(got_out[f], want_out[f]), f
    assert torch.equal(got_rows[0], want_rows[0]) and torch.equal(got_rows[1], want_rows[1])
    assert got_state.keys() == want_state.keys()
    assert grouped.memory_stash.table_stashes()["t0"].restores_on_access > 0
    _assert_same_rows(grouped, plain)


def test_a_view_of_one_table_kept_across_a_step_keeps_the_group_in_place():
    """A view of one table's rows (a state_dict kept) would read an empty tensor: the group
    stays on the device that step, with a warning, and trains on."""
    plain, grouped = (_collection(s) for s in (StashMode.NONE, StashMode.ALL))
    batches = _batches(3, seed=4)
    for ec in (plain, grouped):
        _train(ec, batches[:1])
    kept = grouped.tables["t1"].tier.flat.weights[:, :8]  # a view of t1's part
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = grouped(batches[1])
        assert grouped.memory_stash.stashed == []
        _loss(out).backward()
    assert any("stay on the device" in str(w.message) for w in caught)
    assert kept.untyped_storage().nbytes() > 0
    _loss(plain(batches[1])).backward()
    del kept
    for ec in (plain, grouped):
        _train(ec, batches[2:])
    assert grouped.memory_stash.stashed == []
    assert grouped.memory_stash.table_stashes()["t0"].stashes == 2
    _assert_same_rows(grouped, plain)


def test_a_backward_that_never_comes_and_a_loss_that_ignores_a_table():
    """An exception between forward and backward: the group's rows stay away until the next
    step's lookup brings them back. A loss that reads one table only: the others take no
    update, as without stashing."""
    plain, grouped = (_collection(s) for s in (StashMode.NONE, StashMode.ALL))
    for ec in (plain, grouped):
        for step, kjt in enumerate(_batches(5, seed=6)):
            out = ec(kjt)
            if step == 1:
                continue  # the dense part raised: no backward
            if step == 3:
                out = {"f1": out["f1"]}
            _loss(out).backward()
    assert grouped.memory_stash.stashed == []
    assert grouped.steps == plain.steps and grouped.steps["t0"] == 3
    stash = grouped.memory_stash.table_stashes()["t0"]
    assert (stash.stashes, stash.restores) == (5, 5)
    _assert_same_rows(grouped, plain)


def test_a_checkpoint_loaded_while_a_group_is_stashed():
    """load_state_dict between forward and backward brings the rows back, replaces the
    rows, and the backward of that forward raises (as without stashing); the next steps
    stash the group again and train as the plain twin."""
    plain, grouped = (_collection(s) for s in (StashMode.NONE, StashMode.ALL))
    for ec in (plain, grouped):
        _train(ec, _batches(2, seed=7))
    saved = {k: v.clone() for k, v in plain.state_dict().items()}
    for ec in (plain, grouped):
        out = ec(_batches(1, seed=8)[0])
        ec.load_state_dict(saved)
        with pytest.raises(RuntimeError, match="a checkpoint was loaded or tables were reset after this forward"):
            _loss(out).backward()
    assert grouped.memory_stash.stashed == []
    for ec in (plain, grouped):
        _train(ec, _batches(3, seed=9))
    assert grouped.table_groups() == [NAMES]
    assert grouped.memory_stash.table_stashes()["t0"].stashes == 3
    _assert_same_rows(grouped, plain)


def test_a_module_saved_whole_while_its_group_is_stashed():
    """torch.save(module) between forward and backward brings the group's rows back first;
    the copy trains on, stashing its group again, as a copy of the plain twin saved at the
    same moment does."""
    import io

    def saved(ec):
        buffer = io.BytesIO()
        torch.save(ec, buffer)
        buffer.seek(0)
        return buffer

    plain, grouped = (_collection(s) for s in (StashMode.NONE, StashMode.ALL))
    for ec in (plain, grouped):
        _train(ec, _batches(2, seed=12))
    buffers, outs = [], []
    for ec in (plain, grouped):
        outs.append(ec(_batches(1, seed=13)[0]))
        buffers.append(saved(ec))
    assert grouped.memory_stash.stashed == []  # the save brought the rows back
    for out in outs:
        _loss(out).backward()
    plain_copy, copy = (torch.load(b, weights_only=False) for b in buffers)
    assert copy.table_groups() == [NAMES]
    before = copy.memory_stash.table_stashes()["t0"].stashes
    # (torch.load makes the tables' views views of the storage, without a base tensor:
    # nothing else holds the rows, and the first step stashes them)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for ec in (plain, grouped, plain_copy, copy):
            _train(ec, _batches(2, seed=14))
    assert copy.memory_stash.table_stashes()["t0"].stashes == before + 2
    _assert_same_rows(grouped, plain)
    _assert_same_rows(copy, plain_copy)
