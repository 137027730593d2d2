"""The ordering of a stash and a restore on CUDA, checked without a GPU: TableStash's own
sequences run against a model of streams, events and the caching allocator
(tests/stream_model.py), with the copy streams held back or let run first. Each guarantee is
shown twice: it holds, and dropping the record_stream or the wait that gives it breaks it in
the same schedule (the check would catch a regression).

- the released block is not handed to another allocation before the device-to-host copy has
  read it (the NaNs TorchRec's EMS once produced);
- the restored rows are read only once the host-to-device copy has written them;
- a restore right after a stash waits for the stash's copy to fill the host buffer;
- the stash copies the rows only after the lookup and the prefetch stream have finished;
- rows initialized while stashed are written after the rows come back, not overwritten.
"""
import pytest
import torch

from dynemb import DynamicEmbTableOptions, Initializer, InitializerKind
from dynemb.rows.flat_table import RowLayout
from dynemb.options import StashMode, choose_storage_mode
from dynemb.stashing import table_stash
from dynemb.stashing.table_stash import TableStash, stashed_columns
from dynemb.tables.tier import Tier
from tests.stream_model import ModelTransfers

@pytest.fixture(autouse=True)
def _model_references_are_not_holders(monkeypatch):
    """The model keeps Python references to the memory its queued copies will touch (a GPU
    keeps pointers); they are not the views a stash must stay away from."""
    monkeypatch.setattr(table_stash, "_other_holders", lambda weights: 0)


DIM, STATE, ROWS = 4, 8, 128  # Adam-like rows: 4 values, 8 state columns
MODES = (StashMode.ALL, StashMode.VALUES, StashMode.OPTIMIZER_STATE)


def _table(model: ModelTransfers, mode: StashMode):
    options = DynamicEmbTableOptions()
    layout = choose_storage_mode(options, name="t", num_embeddings=ROWS, width=DIM + STATE,
                                 state_dim=STATE, config_dtype=torch.float32)
    tier = Tier(layout, ROWS, DIM, STATE, options, torch.device("cpu"), None)
    tier.flat.weights.copy_(torch.arange(ROWS * (DIM + STATE), dtype=torch.float32).view(
        ROWS, -1))
    model.adopt(tier.flat.weights, "compute")
    stash = TableStash("t", tier, mode, RowLayout(DIM, STATE), model,
                       extra_streams=(model.streams["prefetch"],))
    return tier, stash, tier.flat.weights.clone()


def _stashed_part(mode, rows):
    (start, stop), _ = stashed_columns(mode, RowLayout(DIM, STATE))
    return rows[:, start:stop]


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("record_streams", [True, False], ids=["record_stream", "without"])
def test_released_rows_wait_for_the_copy_before_reuse(mode, record_streams):
    model = ModelTransfers(record_streams=record_streams)
    tier, stash, expected = _table(model, mode)
    nbytes = expected.numel() * expected.element_size()
    assert stash.stash()
    # the dense forward allocates (and writes) right away; the copy stream is slow
    reused = model.allocate(nbytes, "compute")
    model.run("compute")
    model.finish(order=("d2h", "compute"))
    (copied,) = model.host_buffers
    if record_streams:
        assert not reused
        assert torch.equal(copied, _stashed_part(mode, expected))
        assert model.allocate(nbytes, "compute")  # the block returns once the copy is done
    else:  # the block went to the activation first: the copy read its data
        assert reused and torch.isnan(copied).all()


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("wait", [True, False], ids=["waits", "without"])
def test_restored_rows_are_read_after_the_copy(mode, wait):
    model = ModelTransfers(ignored_waits=() if wait else ("h2d",))
    tier, stash, expected = _table(model, mode)
    stash.stash()
    model.finish()
    stash.restore()
    seen = []
    weights = tier.flat.weights
    model.launch("compute", lambda: seen.append(weights.clone()))  # the update kernel
    model.run("compute")
    model.finish(order=("h2d", "d2h", "compute"))
    assert seen[0].shape == expected.shape
    assert torch.equal(seen[0], expected) == wait
    assert torch.equal(tier.flat.weights, expected)


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("wait", [True, False], ids=["waits", "without"])
def test_restore_right_after_stash_waits_for_the_host_buffer(mode, wait):
    """An eval forward right after a training forward: the host-to-device copy must not read
    the host buffer before the device-to-host copy has filled it."""
    model = ModelTransfers(ignored_waits=() if wait else ("d2h",))
    tier, stash, expected = _table(model, mode)
    stash.stash()
    stash.restore()
    model.finish(order=("h2d", "compute", "prefetch", "d2h"))  # the restore copy is eager
    assert torch.equal(tier.flat.weights, expected) == wait


@pytest.mark.parametrize("wait", [True, False], ids=["waits", "without"])
def test_stash_copies_after_the_lookup_and_the_prefetch(wait):
    model = ModelTransfers(ignored_waits=() if wait else ("compute", "prefetch"))
    tier, stash, expected = _table(model, StashMode.ALL)
    weights = tier.flat.weights
    rows = weights.detach()  # a kernel holds the address it was launched with
    model.launch("compute", lambda: rows[0].fill_(-1.0))   # the step before, queued
    model.launch("prefetch", lambda: rows[1].fill_(-2.0))  # a prefetch's new row
    stash.stash()
    model.finish(order=("d2h", "h2d", "compute", "prefetch"))  # the copy stream first
    expected[0], expected[1] = -1.0, -2.0
    (copied,) = model.host_buffers
    assert torch.equal(copied, expected) == wait


def test_rows_initialized_while_stashed_land_after_the_restore_copy():
    model = ModelTransfers()
    tier, stash, expected = _table(model, StashMode.ALL)
    stash.stash()
    init = Initializer(InitializerKind.CONSTANT, value=7.0)
    slots, keys = torch.tensor([3, 9]), torch.tensor([103, 109])
    with model.on(model.streams["prefetch"]):  # the next batch's prefetch
        tier.flat.initialize_where(slots, keys, torch.tensor([True, True]), init, seed=0,
                                   table_id=0)
    assert stash.stashed  # recorded, not applied
    stash.restore()  # the copy stream is held back: the replay still comes after it
    model.finish(order=("compute", "prefetch", "h2d", "d2h"))
    expected[slots, :DIM] = 7.0
    expected[slots, DIM:] = 0.0
    assert torch.equal(tier.flat.weights, expected)
    assert stash.replayed_inits == 1


def test_the_next_stash_waits_for_the_last_restore():
    model = ModelTransfers()
    tier, stash, expected = _table(model, StashMode.VALUES)
    stash.stash()
    model.finish()
    stash.restore()
    stash.stash()  # before the restore copy has run
    model.finish(order=("d2h", "compute", "prefetch", "h2d"))
    (copied,) = model.host_buffers  # the second stash reuses the first one's buffer
    assert torch.equal(copied, _stashed_part(StashMode.VALUES, expected))
    stash.restore()
    model.finish()
    assert torch.equal(tier.flat.weights, expected)
