"""Memory stashing (dynemb.stashing) on the unsharded collection, on CPU.

Every run here trains a stashing collection next to an identical one that does not stash, on
the same batches, and asks for the same outputs and the same rows (optimizer state included)
bit for bit; between a training forward and its backward the stashing tables' rows must hold
no memory. Then each hazard: a prefetch, an eval or no_grad forward, read_rows, state_dict,
load_state_dict or growth while stashed, a forward whose backward never comes, an exception
between forward and backward, views of the rows kept across a step, TorchRec's manager.
"""
import warnings

import pytest
import torch
from torchrec import EmbeddingConfig
from torchrec.distributed.memory_stashing import MemoryStashingManager
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, Initializer, InitializerKind,
                    OptimizerConfig, OptimizerType)
from dynemb.options import StashMode
from dynemb.stashing import collection_stashes, restore, restore_on_grad
from tests.torchrec_probes import queued_weight_restores

MODES = ("hbm_direct", "cache", "default")
OPTIMIZERS = tuple(OptimizerType)
STASHES = (StashMode.ALL, StashMode.VALUES, StashMode.OPTIMIZER_STATE)
INIT = Initializer(InitializerKind.UNIFORM, low=-0.1, high=0.1)
IDS = 300


def _configs(**extra):
    return [EmbeddingConfig(name="t0", embedding_dim=8, num_embeddings=512,
                            feature_names=["f0", "f1"], **extra),
            EmbeddingConfig(name="t1", embedding_dim=6, num_embeddings=512,
                            feature_names=["f2"])]


def _optimizer(kind: OptimizerType) -> OptimizerConfig:
    return OptimizerConfig(kind, learning_rate=0.05, eps=1e-6)


def _collection(mode="hbm_direct", optimizer=OptimizerType.ADAM, stash=StashMode.NONE,
                device_rows=64, dtype=None, **options) -> DynamicEmbCollection:
    config = _optimizer(optimizer)
    per_table = {}
    for t in _configs():
        row_bytes = (t.embedding_dim + config.state_dim(t.embedding_dim)) * 4
        per_table[t.name] = DynamicEmbTableOptions(
            caching=mode == "cache", max_capacity=512, bucket_size=16, initializer=INIT,
            local_hbm_for_values=None if mode == "hbm_direct" else device_rows * row_bytes,
            stash=stash, embedding_dtype=dtype, seed=1, **options)
    return DynamicEmbCollection(_configs(), table_options=per_table, optimizer=config)


def _batches(steps, seed=0, ids=IDS):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 5, (3 * 4,), generator=g)
        values = torch.randint(0, ids, (int(lengths.sum()),), generator=g)
        out.append(KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2"], values, lengths))
    return out


def _loss(out):
    return sum((jt.values() ** 2).sum() + jt.values().sum() for jt in out.values())


def _rows_tensors(ec):
    """The tensors of the device rows, read without bringing them back (held only briefly:
    a reference kept across a training forward would keep the table from being stashed)."""
    return {n: s.rows() for n, s in ec.memory_stash.table_stashes().items()}


def _storage_bytes(ec):
    return {n: t.untyped_storage().nbytes() for n, t in _rows_tensors(ec).items()}


def _ids(ec):
    return {n: id(t) for n, t in _rows_tensors(ec).items()}


def _rows(ec):
    keys = torch.arange(IDS)
    return {n: ec.read_rows(n, keys, with_state=True) for n in ec.tables}


def _assert_same_rows(a, b):
    for name, (rows, found) in _rows(a).items():
        other_rows, other_found = _rows(b)[name]
        assert torch.equal(found, other_found), name
        assert torch.equal(rows, other_rows), name


def _stashes(ec):
    return ec.memory_stash.table_stashes()


# -- the same training, with and without stashing --------------------------------------------
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=[o.value for o in OPTIMIZERS])
@pytest.mark.parametrize("mode", MODES)
def test_stashing_trains_exactly_as_without(mode, optimizer):
    stashes = [s for s in STASHES if s is not StashMode.OPTIMIZER_STATE
               or optimizer is not OptimizerType.SGD]
    plain = _collection(mode, optimizer)
    stashing = [_collection(mode, optimizer, stash=s) for s in stashes]
    ids = [_ids(ec) for ec in stashing]
    for step, kjt in enumerate(_batches(6)):
        expected = plain(kjt)
        _loss(expected).backward()
        for ec in stashing:
            out = ec(kjt)
            assert ec.memory_stash.stashed == ["t0", "t1"]
            assert set(_storage_bytes(ec).values()) == {0}  # the rows' memory is released
            for f in expected:
                assert torch.equal(out[f].values(), expected[f].values()), (step, f)
            _loss(out).backward()
            assert ec.memory_stash.stashed == []
            assert 0 not in _storage_bytes(ec).values()
    for ec, before in zip(stashing, ids):
        assert ec.storage_modes() == plain.storage_modes()
        _assert_same_rows(ec, plain)
        for name, stash in _stashes(ec).items():
            assert (stash.stashes, stash.restores, stash.restores_on_access) == (6, 6, 0)
        assert _ids(ec) == before  # the same tensors, emptied and refilled


def test_half_precision_rows_with_their_float32_state():
    plain = _collection(optimizer=OptimizerType.ADAM, dtype=torch.float16)
    stashing = {s: _collection(optimizer=OptimizerType.ADAM, dtype=torch.float16, stash=s)
                for s in STASHES}
    for kjt in _batches(4, seed=3):
        _loss(plain(kjt)).backward()
        for ec in stashing.values():
            _loss(ec(kjt)).backward()
    for ec in stashing.values():
        _assert_same_rows(ec, plain)
    # VALUES stashes the (even-padded) half columns, OPTIMIZER_STATE the float32 state
    row = stashing[StashMode.VALUES].tables["t1"].row_layout
    values = _stashes(stashing[StashMode.VALUES])["t1"].stashed_bytes
    state = _stashes(stashing[StashMode.OPTIMIZER_STATE])["t1"].stashed_bytes
    assert values == 512 * row.embedding_bytes and state == 512 * row.state_bytes


def test_stash_weights_of_the_torchrec_config_stashes_whole_rows():
    ec = DynamicEmbCollection(_configs(stash_weights=True), optimizer=_optimizer(
        OptimizerType.ADAM))
    assert ec.table_options["t0"].stash is StashMode.ALL
    assert ec.table_options["t1"].stash is StashMode.NONE
    ec(_batches(1)[0])
    assert ec.memory_stash.stashed == ["t0"]


def test_options_refuse_what_cannot_be_stashed():
    with pytest.raises(TypeError, match="stash must be a StashMode"):
        DynamicEmbTableOptions(stash="all")
    with pytest.raises(ValueError, match="'t0'.*keeps no state"):
        _collection(optimizer=OptimizerType.SGD, stash=StashMode.OPTIMIZER_STATE)
    assert _collection().memory_stash is None  # nothing to do without a stashing table


def test_eval_and_no_grad_forwards_neither_stash_nor_find_rows_missing():
    ec = _collection(stash=StashMode.ALL)
    kjt = _batches(1)[0]
    with torch.no_grad():
        ec(kjt)
    ec.eval()
    ec(kjt)
    ec.train()
    assert ec.memory_stash.stashed == []
    assert all(s.stashes == 0 for s in _stashes(ec).values())


# -- hazards ---------------------------------------------------------------------------------
def _pair(**kwargs):
    return _collection(**kwargs), _collection(stash=StashMode.ALL, **kwargs)


@pytest.mark.parametrize("mode", MODES)
def test_next_prefetch_while_stashed(mode):
    """The next batch's prefetch finds and inserts keys while this batch's rows are away: the
    new rows are initialized when the rows return, and what it loads or evicts (CACHE) brings
    them back first; training ends where the unstashed run does."""
    plain, stashing = _pair(mode=mode, optimizer=OptimizerType.ROWWISE_ADAGRAD)
    batches = _batches(8, seed=5, ids=IDS)
    for ec in (plain, stashing):
        ec.prefetch(batches[0])
        for step, kjt in enumerate(batches):
            out = ec(kjt)
            if step + 1 < len(batches):
                ec.prefetch(batches[step + 1])  # as the prefetch pipeline does
            _loss(out).backward()
    _assert_same_rows(stashing, plain)
    stats = _stashes(stashing)
    if mode == "hbm_direct":  # new rows waited for the rows to return; nothing restored early
        assert all(s.replayed_inits > 0 and s.restores_on_access == 0 for s in stats.values())
    if mode == "cache":  # the prefetch wrote evicted rows back, so it needed them
        assert sum(s.restores_on_access for s in stats.values()) > 0
    if mode == "default":  # prefetch only dedups: rows untouched
        assert all(s.restores_on_access == 0 for s in stats.values())


def test_growth_while_stashed_restores_then_moves_the_rows():
    plain, stashing = _pair(init_capacity=32)  # HBM_DIRECT doubles from 32 rows
    batches = _batches(6, seed=8)
    capacity = stashing.tables["t0"].tier.hash.capacity
    for ec in (plain, stashing):
        for step, kjt in enumerate(batches):
            out = ec(kjt)
            if step + 1 < len(batches):
                ec.prefetch(batches[step + 1])
            _loss(out).backward()
    assert stashing.tables["t0"].tier.hash.capacity > capacity
    assert _stashes(stashing)["t0"].restores_on_access > 0
    _assert_same_rows(stashing, plain)


def test_eval_and_no_grad_forward_between_forward_and_backward():
    plain, stashing = _pair(mode="cache")
    train, probe = _batches(2, seed=11)
    expected = {}
    for ec in (plain, stashing):
        out = ec(train)
        with torch.no_grad():
            no_grad = ec(probe)
        ec.eval()
        evaluated = ec(probe)
        ec.train()
        _loss(out).backward()
        expected[ec is stashing] = (no_grad, evaluated)
    for got, want in zip(expected[True], expected[False]):
        for f in want:
            assert torch.equal(got[f].values(), want[f].values())
    _assert_same_rows(stashing, plain)


def test_read_rows_stats_and_checkpoints_while_stashed():
    plain, stashing = _pair(mode="default", optimizer=OptimizerType.ADAGRAD)
    kjt = _batches(1, seed=2)[0]
    out = {ec is stashing: ec(kjt) for ec in (plain, stashing)}
    stats = stashing.stats()  # counters and sizes: the rows stay away
    assert stashing.memory_stash.stashed == ["t0", "t1"] and stats == plain.stats()
    keys = torch.arange(IDS)
    assert torch.equal(stashing.read_rows("t0", keys)[0], plain.read_rows("t0", keys)[0])
    assert stashing.memory_stash.stashed == ["t1"]  # read_rows brought t0 back
    saved = stashing.state_dict()  # views of the rows: every table comes back
    assert stashing.memory_stash.stashed == []
    expected = plain.state_dict()
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[k], expected[k]) for k in saved)
    # the backward of the forward before the checkpoint still applies to the rows
    for ec in (plain, stashing):
        _loss(out[ec is stashing]).backward()
    _assert_same_rows(stashing, plain)
    # a load while stashed: the rows come back (an exact load copies into them)
    snapshot = {k: v.clone() for k, v in expected.items()}
    del saved, expected  # they hold the rows' tensors, which would keep them in place
    again = {ec is stashing: ec(kjt) for ec in (plain, stashing)}
    assert stashing.memory_stash.stashed == ["t0", "t1"]
    stashing.load_state_dict(snapshot)
    plain.load_state_dict(snapshot)
    assert stashing.memory_stash.stashed == []
    _assert_same_rows(stashing, plain)
    for value in again.values():  # their backward refuses to update loaded rows
        with pytest.raises(RuntimeError, match="a checkpoint was loaded or tables were reset after this forward"):
            _loss(value).backward()


def test_a_forward_whose_backward_never_comes_then_a_new_step():
    """An exception between forward and backward (or an output dropped): the rows stay
    away until the next step touches them, and training goes on as without stashing."""
    plain, stashing = _pair(mode="hbm_direct", optimizer=OptimizerType.ADAM)
    batches = _batches(4, seed=4)
    for ec in (plain, stashing):
        for step, kjt in enumerate(batches):
            out = ec(kjt)
            if step == 1:
                try:
                    raise ValueError("the dense part failed")
                except ValueError:
                    continue  # the backward never comes
            _loss(out).backward()
    _assert_same_rows(stashing, plain)
    assert stashing.memory_stash.stashed == []
    assert all(s.stashes == 4 and s.restores == 4 for s in _stashes(stashing).values())


def test_views_kept_across_a_step_keep_the_rows_in_place():
    """A view of the rows kept across a step: stashing would keep the memory and let it go
    stale, so the table is not stashed while it lives (a warning says why). A state_dict
    holds host copies of the live rows, not views: it keeps no table in place and stays as
    it was saved."""
    ec = _collection(stash=StashMode.ALL)
    _loss(ec(_batches(1)[0])).backward()
    saved = ec.state_dict()
    kept = {k: v.clone() for k, v in saved.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = ec(_batches(1)[0])
    assert ec.memory_stash.stashed == ["t0", "t1"]
    _loss(out).backward()
    assert all(torch.equal(v, kept[k]) for k, v in saved.items())
    del saved
    view = ec.tables["t1"].tier.flat.weights[:, :2]  # a view keeps the memory: t1 stays
    with pytest.warns(RuntimeWarning, match="table 't1': .* tensors besides the table"):
        out = ec(_batches(1)[0])
    assert ec.memory_stash.stashed == ["t0"]
    del view
    _loss(out).backward()
    ec(_batches(1)[0])
    assert ec.memory_stash.stashed == ["t0", "t1"]


def test_restore_on_grad_brings_the_rows_back_before_the_embedding_backward():
    ec = _collection(stash=StashMode.ALL)
    seen = []
    out = ec(_batches(1)[0])
    x = torch.stack([jt.values().sum() for jt in out.values()])
    restore_on_grad(x, ec)
    x.register_hook(lambda g: seen.append(list(ec.memory_stash.stashed)))
    x.sum().backward()
    assert seen == [[]]  # the rows were back when the gradient reached x
    assert collection_stashes(torch.nn.Sequential(ec)) == [ec.memory_stash]
    out = ec(_batches(1)[0])
    restore(ec)
    assert ec.memory_stash.stashed == []


def test_torchrec_manager_restores_queued_tables():
    ec = _collection(stash=StashMode.ALL)
    ec.memory_stash.hand_restores_to_torchrec = True
    try:
        for _ in range(2):  # a restore still queued (backward skipped) is not queued twice
            ec(_batches(1)[0])
        assert queued_weight_restores() == 1 and ec.memory_stash.stashed == ["t0", "t1"]
        MemoryStashingManager.restore_embedding_weights()
        assert ec.memory_stash.stashed == [] and queued_weight_restores() == 0
        MemoryStashingManager.set_delay_stash(True)  # stash at execute_pending_stashes()
        out = ec(_batches(1)[0])
        assert ec.memory_stash.stashed == []
        MemoryStashingManager.execute_pending_stashes()
        assert ec.memory_stash.stashed == ["t0", "t1"]
        _loss(out).backward()
        assert ec.memory_stash.stashed == []
    finally:
        MemoryStashingManager.reset()


def test_footprint_reports_the_device_peak_with_and_without_stashing():
    from dynemb.planning import footprint_report
    from dynemb.planning.footprint import footprints
    options = {"t0": DynamicEmbTableOptions(stash=StashMode.VALUES, max_capacity=512),
               "t1": DynamicEmbTableOptions(max_capacity=512)}
    meta = DynamicEmbCollection(_configs(), "meta", table_options=options,
                                optimizer=_optimizer(OptimizerType.ADAM))
    built = DynamicEmbCollection(_configs(), table_options=options,
                                 optimizer=_optimizer(OptimizerType.ADAM))
    prints = {f.table: f for f in footprints(meta, world_size=1, batch_size=8)}
    stash = built.memory_stash.table_stashes()["t0"]
    assert prints["t0"].stash_bytes == stash.stashed_bytes == 512 * 8 * 4  # the values
    assert prints["t1"].stash_bytes == 0
    assert prints["t0"].device_bytes_stashed == prints["t0"].device_bytes - 512 * 8 * 4
    assert prints["t0"].host_bytes == prints["t0"].stash_bytes  # its host buffer
    built(_batches(1)[0])
    assert stash.device_bytes() == 0 and stash.host_buffer_bytes == stash.stashed_bytes
    text = footprint_report(meta, world_size=1, batch_size=8)
    without = sum(f.device_bytes for f in prints.values())
    line = [ln for ln in text.splitlines() if ln.startswith("device peak")][0]
    assert f"{without:,} bytes" in line and f"{without - 512 * 8 * 4:,} bytes" in line
