"""Non-blocking dumps (dump(..., blocking=False)): the files are those of a blocking dump of
a twin module taken at the same step, byte for byte, though the module trains on while they
are written (the writer is held back until training steps have run); a delta taken without
blocking records exactly what changed up to its call; a failure surfaces at wait() and
leaves the previous checkpoint; a handle waits once; a path being written is refused."""
import json
import threading

import pytest
import torch

from checkpoint_files_models import assert_same_state, make, module_state
from checkpoint_models import MODES, batches, train
from conftest import BACKENDS
from dynemb.checkpoint import DumpInfo, PendingDump, dump, load
from dynemb.checkpoint import file_dump
from dynemb.checkpoint.files import DirectoryWriter

KJTS = batches(40, seed=5, batch=12)
CHUNK = 16  # several files per tier: their order must match too


@pytest.fixture
def gate(monkeypatch):
    """Holds the background writer before each file until ``gate.set()``."""
    opened = threading.Event()
    write = DirectoryWriter.write

    def held(self, name, tensors, content):
        if threading.current_thread().name.startswith("dynemb-dump-background"):
            assert opened.wait(60), "the test never opened the gate"
        return write(self, name, tensors, content)

    monkeypatch.setattr(DirectoryWriter, "write", held)
    yield opened
    opened.set()


def rank_files(path):
    """{file name: bytes} of a dump's rank directory; the manifest without the fields that
    name the dump itself (id, previous, time, checksum)."""
    rank_dir = path / "rank0_of_1"
    out = {p.name: p.read_bytes() for p in rank_dir.iterdir() if p.name != "manifest.json"}
    manifest = json.loads((rank_dir / "manifest.json").read_text())
    for field in ("id", "previous", "created", "manifest_sha256"):
        manifest.pop(field)
    return out, manifest


def assert_same_files(a, b):
    files_a, manifest_a = rank_files(a)
    files_b, manifest_b = rank_files(b)
    assert manifest_a == manifest_b
    assert sorted(files_a) == sorted(files_b) and len(files_a) > 2
    for name in files_a:
        assert files_a[name] == files_b[name], name


def on(ec, kjts):
    return [kjt.to(ec.device) for kjt in kjts]


@pytest.mark.parametrize("mode,backend", [(m, "cpu") for m in MODES] + [("cache", "cuda")])
def test_files_are_a_blocking_dump_of_the_same_step_while_training_goes_on(
        tmp_path, gate, mode, backend):
    kwargs = dict(mode=mode, optimizer="adam", evicting=True, backend=backend,
                  device=torch.device(dict(BACKENDS)[backend]))
    live, twin = make(**kwargs), make(**kwargs)
    train(live, on(live, KJTS[:6]))
    train(twin, on(twin, KJTS[:6]))
    assert_same_state(module_state(live), module_state(twin))

    pending = dump(live, tmp_path / "live_full", chunk_rows=CHUNK, blocking=False)
    assert isinstance(pending, PendingDump) and pending.snapshot_bytes > 0
    train(live, on(live, KJTS[6:12]))  # the writer is held: these steps run before any file
    assert not pending.done()
    expected_full = dump(twin, tmp_path / "twin_full", chunk_rows=CHUNK)
    gate.set()
    full = pending.wait()
    assert isinstance(full, DumpInfo) and pending.done()
    assert (full.kind, full.rows, full.deleted) == (expected_full.kind, expected_full.rows, 0)
    assert full.bytes == expected_full.bytes and full.files == expected_full.files
    assert_same_files(tmp_path / "live_full", tmp_path / "twin_full")
    with pytest.raises(AssertionError):  # the steps during the writing changed the tables
        assert_same_state(module_state(live), module_state(twin))

    # a delta taken without blocking holds what changed up to its call, not after
    evicted = twin.stats()["t0"]["evictions"]
    train(twin, on(twin, KJTS[6:12]))
    assert twin.stats()["t0"]["evictions"] > evicted  # the delta records keys that left
    assert_same_state(module_state(live), module_state(twin))
    gate.clear()
    pending = dump(live, tmp_path / "live_delta", since=full, chunk_rows=CHUNK, blocking=False)
    train(live, on(live, KJTS[12:18]))
    expected_delta = dump(twin, tmp_path / "twin_delta", since=expected_full, chunk_rows=CHUNK)
    state = module_state(twin)
    gate.set()
    delta = pending.wait()
    assert (delta.kind, delta.rows, delta.deleted, delta.previous) == (
        "delta", expected_delta.rows, expected_delta.deleted, full.id)
    assert_same_files(tmp_path / "live_delta", tmp_path / "twin_delta")
    resumed = make(**kwargs)
    load(resumed, [tmp_path / "live_full", tmp_path / "live_delta"])
    assert_same_state(module_state(resumed), state)

    # and the next delta follows the non-blocking one: the steps run while it was written
    train(twin, on(twin, KJTS[12:18]))
    later = dump(live, tmp_path / "live_delta2", since=delta)
    load(resumed, [tmp_path / "live_full", tmp_path / "live_delta", tmp_path / "live_delta2"])
    assert later.rows > 0
    assert_same_state(module_state(resumed), module_state(twin))


def test_a_failed_write_surfaces_at_wait_and_leaves_the_previous_checkpoint(
        tmp_path, monkeypatch):
    ec = make("hbm_direct")
    train(ec, KJTS[:5])
    first = dump(ec, tmp_path / "ckpt")
    before = rank_files(tmp_path / "ckpt")
    train(ec, KJTS[5:10])
    write = DirectoryWriter.write
    calls = []

    def failing(self, name, tensors, content):
        calls.append(name)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return write(self, name, tensors, content)

    monkeypatch.setattr(DirectoryWriter, "write", failing)
    pending = dump(ec, tmp_path / "ckpt", chunk_rows=CHUNK, blocking=False)
    with pytest.raises(OSError, match="No space left"):
        pending.wait()
    with pytest.raises(RuntimeError, match="already waited on"):
        pending.wait()
    assert rank_files(tmp_path / "ckpt") == before  # untouched, no temporary left
    assert [p.name for p in tmp_path.joinpath("ckpt").iterdir()] == ["rank0_of_1"]
    monkeypatch.setattr(DirectoryWriter, "write", write)
    with pytest.raises(ValueError, match="failed to write its files.*full dump"):
        dump(ec, tmp_path / "delta", since=first)
    assert dump(ec, tmp_path / "again").kind == "full"


def test_a_handle_waits_once_and_a_path_being_written_is_refused(tmp_path, gate):
    ec = make("cache")
    train(ec, KJTS[:5])
    pending = dump(ec, tmp_path / "a", blocking=False)
    with pytest.raises(ValueError, match="still writing it; wait"):
        dump(ec, tmp_path / "a")
    with pytest.raises(ValueError, match="still writing it; wait"):
        dump(ec, tmp_path / "b", since=tmp_path / "a")
    with pytest.raises(TypeError, match="give the DumpInfo its wait"):
        dump(ec, tmp_path / "b", since=pending)
    with pytest.raises(TimeoutError):
        pending.wait(timeout=0.01)
    gate.set()
    info = pending.wait()  # a timed-out wait does not count
    assert "written" in repr(pending)
    with pytest.raises(RuntimeError, match=f"dump {info.id} .* already waited on"):
        pending.wait()
    assert dump(ec, tmp_path / "b", since=info).previous == info.id
    with pytest.raises(TypeError, match="blocking must be a bool"):
        dump(ec, tmp_path / "c", blocking="no")
    assert not (tmp_path / "c").exists()


def test_the_snapshot_memory_is_the_dumped_entries(tmp_path):
    ec = make("hbm_direct")
    train(ec, KJTS[:6])
    pending = dump(ec, tmp_path / "a", blocking=False)
    info = pending.wait()
    rows = {n: t.tier.hash.size() for n, t in ec.tables.items()}
    width = {n: t.width for n, t in ec.tables.items()}
    # keys, scores and slots (int64) and the row of every live entry; no tombstones here
    assert info.rows == sum(rows.values())
    assert pending.snapshot_bytes == sum(rows[n] * (3 * 8 + width[n] * 4) for n in rows)
    assert file_dump._IN_FLIGHT == set()


@pytest.mark.parametrize("stager", ["torch_default", "dynemb"])
def test_dcp_async_save_of_an_unsharded_module_holds_the_step_it_was_called_at(
        tmp_path, stager):
    import warnings

    import torch.distributed.checkpoint as dcp

    from dynemb.checkpoint import DynamicEmbAsyncStager
    ec = make("cache", "adam", evicting=True)
    train(ec, KJTS[:8])
    expected = module_state(ec)
    kwargs = {"async_stager": DynamicEmbAsyncStager()} if stager == "dynemb" else {}
    with warnings.catch_warnings():  # torch: "assuming ... a single process"
        warnings.simplefilter("ignore", UserWarning)
        saving = dcp.async_save({"model": ec.state_dict()}, checkpoint_id=tmp_path, **kwargs)
        train(ec, KJTS[8:16])
        saving.result()
        fresh = make("cache", "adam", evicting=True)
        state = {"model": fresh.state_dict()}
        dcp.load(state, checkpoint_id=tmp_path)  # DCP's default planner: byte items kept
    fresh.load_state_dict(state["model"])
    assert_same_state(module_state(fresh), expected)
    with pytest.raises(AssertionError):
        assert_same_state(module_state(ec), expected)


def test_a_dump_still_being_written_at_exit_is_finished(tmp_path):
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent(f"""
        import time
        import torch
        from torchrec import EmbeddingConfig
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
        from dynemb import DynamicEmbCollection, OptimizerConfig
        from dynemb.checkpoint import dump
        from dynemb.checkpoint.files import DirectoryWriter
        write = DirectoryWriter.write
        def slow(self, *args):  # the interpreter starts exiting before any file is written
            time.sleep(1)
            return write(self, *args)
        DirectoryWriter.write = slow
        ec = DynamicEmbCollection([EmbeddingConfig(name="t", embedding_dim=4,
                                                   num_embeddings=64, feature_names=["f"])],
                                  optimizer=OptimizerConfig())
        kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([1, 2, 3]),
                                                  torch.tensor([3]))
        ec(kjt)["f"].values().sum().backward()
        dump(ec, {str(tmp_path / "ckpt")!r}, chunk_rows=2, blocking=False)
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    from torchrec import EmbeddingConfig

    from dynemb import DynamicEmbCollection, OptimizerConfig
    fresh = DynamicEmbCollection([EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=64,
                                                  feature_names=["f"])],
                                 optimizer=OptimizerConfig())
    assert load(fresh, tmp_path / "ckpt").rows == 3
    assert fresh.read_rows("t", torch.tensor([1, 2, 3]))[1].all()
