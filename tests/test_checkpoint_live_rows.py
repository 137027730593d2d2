"""A checkpoint holds a table's live rows only: the bytes of a ``torch.save``'d
``state_dict``, a ``torch.distributed.checkpoint`` directory and a full dump follow the rows
a table holds, not its capacity (against bytes computed by hand); what comes back from
each is every saved row, optimizer state and score; a ``state_dict`` of the earlier layout
(every slot of the capacity) is refused naming its format, the module unchanged."""
import io
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from checkpoint_files_models import assert_same_state, make, module_state
from checkpoint_models import batches, roundtrip, train
from conftest import BACKENDS
from dynemb import DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig, OptimizerType
from dynemb.checkpoint import DynamicEmbLoadPlanner, dump
from dynemb.types import EMPTY_KEY, TOMBSTONE_KEY

BACKEND_IDS = [b for b, _ in BACKENDS]
DIM, CAPACITY = 32, 4096
#: one saved entry, computed by hand: the float32 row (embedding and Adam's two moments),
#: then its int64 key, score and slot
ENTRY_BYTES = DIM * 3 * 4 + 3 * 8


def adam_table(backend, device):
    """One HBM_DIRECT table of ``CAPACITY`` slots (it never grows), trained with Adam."""
    options = DynamicEmbTableOptions(init_capacity=CAPACITY, max_capacity=CAPACITY)
    return DynamicEmbCollection(
        [EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=CAPACITY,
                         feature_names=["f"])],
        table_options=options, optimizer=OptimizerConfig(OptimizerType.ADAM),
        backend=backend, device=torch.device(device))


def _dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def saved_bytes(ec, how, path: Path) -> int:
    if how == "state_dict":
        buffer = io.BytesIO()
        torch.save(ec.state_dict(), buffer)
        return buffer.getbuffer().nbytes
    if how == "dcp":
        dcp_save({"model": ec.state_dict()}, path)
        return _dir_bytes(path)
    dump(ec, path)
    return _dir_bytes(path)


def dcp_save(state, path):
    with warnings.catch_warnings():  # one process: DCP says it assumes so
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))


def dcp_load(state, path, planner="dynemb"):
    """DCP load with dynemb's planner, or (``planner="default"``) DCP's own, in place."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = {"planner": DynamicEmbLoadPlanner()} if planner == "dynemb" else {}
        dcp.load(state, checkpoint_id=str(path), **kwargs)


HOWS = ("state_dict", "dcp", "dump")


@pytest.fixture(scope="module", params=BACKENDS, ids=BACKEND_IDS)
def sizes(request, tmp_path_factory):
    """``{(how, live rows): bytes}`` of one table holding 100 rows, then 400 (300 more
    trained into the same table)."""
    backend, device = request.param
    ec = adam_table(backend, device)
    out = {}
    for first, rows in ((0, 100), (100, 400)):
        ids = torch.arange(first, rows, device=device) * 7919 + 11
        ec(KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.ones_like(ids)))[
            "f"].values().sum().backward()
        assert ec.tables["t"].tier.hash.size() == rows
        for how in HOWS:
            out[(how, rows)] = saved_bytes(ec, how, tmp_path_factory.mktemp(f"{how}{rows}"))
    return out


@pytest.mark.parametrize("how", HOWS)
def test_checkpoint_bytes_follow_the_live_rows_not_the_capacity(sizes, how):
    small, large = sizes[(how, 100)], sizes[(how, 400)]
    # 100 live rows of 4096 slots: their entries and names and headers (DCP's metadata:
    # about 16 KiB here), far from the 1.6 MB of the whole capacity
    assert small <= 100 * ENTRY_BYTES + 32 * 1024, small
    # 300 rows more: 300 entries' bytes more
    assert large - small == pytest.approx(300 * ENTRY_BYTES, rel=0.02)


@pytest.mark.parametrize("mode", ["hbm_direct", "cache", "default", "host_only"])
@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_every_saved_row_state_and_score_comes_back(tmp_path, backend, mode):
    # small tables: rows are evicted (CACHE: to its store, which keeps stale copies; the
    # admission counter's images are checked in test_checkpoint_state_dict.py)
    kwargs = dict(mode=mode, optimizer="adam", evicting=True,
                  backend=backend[0], device=torch.device(backend[1]))
    ec = make(**kwargs)
    train(ec, batches(6))
    assert ec.stats()["t0"]["evictions"] > 0
    expected = module_state(ec)
    state = ec.state_dict()
    saved = roundtrip(state)
    for name, table in ec.tables.items():  # every tier's entries are its live ones only
        for tier, part in table.checkpoint_tiers().items():
            entries = saved[f"dynamic_tables.{name}.rank0_of_1.{tier}.keys"]
            assert entries.numel() == part.size(), (name, tier)
    resumed = make(**kwargs)
    resumed.load_state_dict(saved)
    assert_same_state(module_state(resumed), expected)
    assert resumed.steps == ec.steps

    dcp_save({"model": ec.state_dict()}, tmp_path / "dcp")
    fresh = make(**kwargs)
    loaded = {"model": fresh.state_dict()}
    dcp_load(loaded, tmp_path / "dcp")
    fresh.load_state_dict(loaded["model"])
    assert_same_state(module_state(fresh), expected)
    # DCP's own planner loads in place too (the entries are byte items: no size to match;
    # HBM_DIRECT tables grew, the fresh ones did not)
    fresh = make(**kwargs)
    grew = any(ec.tables[n].tier.hash.capacity > t.tier.hash.capacity
               for n, t in fresh.tables.items())
    assert grew or mode != "hbm_direct"
    loaded = {"model": fresh.state_dict()}
    dcp_load(loaded, tmp_path / "dcp", planner="default")
    fresh.load_state_dict(loaded["model"])
    assert_same_state(module_state(fresh), expected)


# -- the earlier layout ------------------------------------------------------------------------
def earlier_layout(state):
    """``state`` as dynemb wrote it before checkpoints held live rows only (format 1, as
    docs/checkpoint.md described it): no ``format`` entry, a layout of (capacity, bucket
    size, clock), and per slot of the capacity a key (``EMPTY_KEY`` / ``TOMBSTONE_KEY`` when
    free), a score and a row."""
    out = {}
    for key, value in state.items():
        if key.endswith(".format") or key.endswith(".slots") or key.endswith(".tombstones"):
            continue
        if not key.endswith(".layout"):
            out.setdefault(key, value)
            continue
        tier = key[:-len(".layout")]
        capacity = int(value[0])
        slots, erased = state[f"{tier}.slots"], state[f"{tier}.tombstones"]
        keys = torch.full((capacity,), EMPTY_KEY)
        keys[slots] = state[f"{tier}.keys"]
        keys[erased] = TOMBSTONE_KEY
        scores = torch.zeros(capacity, dtype=torch.int64)
        scores[slots] = state[f"{tier}.scores"]
        out.update({key: value[:3].clone(), f"{tier}.keys": keys, f"{tier}.scores": scores})
        if f"{tier}.rows" in state:
            rows = state[f"{tier}.rows"]
            out[f"{tier}.rows"] = torch.zeros((capacity, rows.shape[1]), dtype=rows.dtype)
            out[f"{tier}.rows"][slots] = rows
    return out


@pytest.mark.parametrize("mode", ["hbm_direct", "default"])
def test_a_checkpoint_of_the_earlier_layout_is_refused_naming_its_format(tmp_path, mode):
    source = make(mode, "sgd")
    train(source, batches(4))
    old = earlier_layout(roundtrip(source.state_dict()))
    assert old["dynamic_tables.t0.rank0_of_1.device.keys"].numel() == \
        source.tables["t0"].tier.hash.capacity
    target = make(mode, "sgd")
    train(target, batches(2, seed=5))
    before = module_state(target)
    message = r"table 't0' \(rank0_of_1\): the checkpoint is of format 1 \(every slot"
    with pytest.raises(RuntimeError, match=message):
        target.load_state_dict(old)
    assert_same_state(module_state(target), before)
    # through DCP with dynemb's planner: read as saved, then refused the same way
    dcp_save({"model": old}, tmp_path / "old")
    state = {"model": target.state_dict()}
    dcp_load(state, tmp_path / "old")
    with pytest.raises(RuntimeError, match=message):
        target.load_state_dict(state["model"])
    assert_same_state(module_state(target), before)


def test_an_unknown_format_is_refused_by_its_number():
    source = make("hbm_direct", "sgd")
    train(source, batches(2))
    state = roundtrip(source.state_dict())
    state["dynamic_tables.t1.rank0_of_1.format"] = torch.tensor([3])
    target = make("hbm_direct", "sgd")
    before = module_state(target)
    with pytest.raises(RuntimeError, match=r"table 't1' \(rank0_of_1\): the checkpoint is of "
                                           r"an unknown format 3; this dynemb reads format 2"):
        target.load_state_dict(state)
    assert_same_state(module_state(target), before)
