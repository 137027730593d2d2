"""Checkpoint files (dynemb.checkpoint.dump / load): a full dump loaded into a fresh module
gives back every tier exactly and training continues bit for bit, in every storage mode and
optimizer; the format is what files.py documents; dumps are atomic (a dump that raises or is
killed half-way leaves the previous checkpoint loadable and intact) and loads all or nothing
(a missing, truncated or corrupted file, a broken chain or another world size is refused by
name with the module unchanged)."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_files_models import (assert_same_rows, assert_same_state, edit_manifest,
                                     logical_rows, make, module_state)
from checkpoint_models import MODES, OPTIMIZERS, batches, train
from dynemb import ScorePolicy
from dynemb.checkpoint import DumpInfo, dump, load
from dynemb.checkpoint import files
from dynemb.checkpoint.files import CheckpointFileError
from dynemb.module_interface import ShardedDynamicModuleInterface

KJTS = batches(24, seed=11, batch=12)  # small batches: they fit 32 device rows
BEFORE = 14


def trained(make_model=make, steps=BEFORE, **kwargs):
    ec = make_model(**kwargs)
    train(ec, KJTS[:steps])
    return ec


def rank_dir(path):
    return Path(path) / "rank0_of_1"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_full_dump_loads_every_tier_exactly_and_training_continues_bit_for_bit(
        tmp_path, mode, optimizer):
    original = trained(mode=mode, optimizer=optimizer, evicting=True)
    info = dump(original, tmp_path / "ckpt")
    expected = module_state(original)
    resumed = make(mode=mode, optimizer=optimizer, evicting=True)
    load(resumed, tmp_path / "ckpt")
    assert_same_state(module_state(resumed), expected)
    losses_a, outs_a = train(original, KJTS[BEFORE:])
    losses_b, outs_b = train(resumed, KJTS[BEFORE:])
    assert torch.equal(torch.stack(losses_a), torch.stack(losses_b))
    for a, b in zip(outs_a, outs_b):
        assert all(torch.equal(a[f], b[f]) for f in a)
    assert_same_state(module_state(resumed), module_state(original))
    assert info.kind == "full" and info.previous is None and info.rows > 0


@pytest.mark.parametrize("policy", [ScorePolicy.LRU, ScorePolicy.LFU, ScorePolicy.STEP,
                                    ScorePolicy.LFU_LRU, ScorePolicy.CUSTOMIZED])
@pytest.mark.parametrize("mode", MODES)
def test_scores_admission_and_half_rows_round_trip(tmp_path, mode, policy):
    original = trained(mode=mode, optimizer="adam", policy=policy, admission=True,
                       dtype=torch.bfloat16)
    assert original.stats()["t0"]["admission_rejects"] > 0
    dump(original, tmp_path)
    resumed = make(mode=mode, optimizer="adam", policy=policy, admission=True,
                   dtype=torch.bfloat16)
    load(resumed, tmp_path)
    assert_same_state(module_state(resumed), module_state(original))


def test_cache_rows_in_the_store_and_a_store_that_evicts_round_trip(tmp_path):
    original = trained(mode="cache", optimizer="adagrad", evicting=True, store_evicts=True)
    stats = original.stats()["t0"]
    assert stats["rows_backing"] > 0 and stats["store_evictions"] > 0
    dump(original, tmp_path)
    resumed = make(mode="cache", optimizer="adagrad", evicting=True, store_evicts=True)
    load(resumed, tmp_path)
    assert_same_state(module_state(resumed), module_state(original))
    assert_same_rows(logical_rows(resumed), logical_rows(original))


def test_the_directory_is_what_the_format_says(tmp_path):
    ec = trained(mode="default", optimizer="adam", admission=True, evicting=True)
    info = dump(ec, tmp_path, chunk_rows=50)
    manifest = json.loads((rank_dir(tmp_path) / "manifest.json").read_text())
    assert manifest["format"] == "dynemb-checkpoint" and manifest["kind"] == "full"
    assert (manifest["rank"], manifest["world_size"], manifest["id"]) == (0, 1, info.id)
    t0 = manifest["tables"]["t0"]
    assert (t0["dim"], t0["dtype"], t0["optimizer"], t0["storage_mode"]) == (
        8, "float32", "adam", "default")
    table = ec.tables["t0"]
    assert t0["counters"] == table.counters.snapshot()
    for name, h in [("device", table.tier.hash), ("host", table.host_tier.hash),
                    ("admission", table.admission.table)]:
        tier = t0["tiers"][name]
        assert (tier["capacity"], tier["clock"], tier["live_rows"]) == (
            h.capacity, h.clock, h.size())
        assert tier["rows"] == h.size() == sum(f["rows"] for f in tier["files"]
                                               if f["content"] == "entries")
        for record in tier["files"]:
            assert record["rows"] <= 50
            data = load_file(rank_dir(tmp_path) / record["file"])
            assert os.path.getsize(rank_dir(tmp_path) / record["file"]) == record["bytes"]
            if record["content"] == "entries":
                assert torch.equal(h.keys_at(data["slots"]), data["keys"])
                if name != "admission":
                    assert data["rows"].shape[1] == table.width
    on_disk = sorted(p.name for p in rank_dir(tmp_path).iterdir())
    assert len(on_disk) == info.files and info.bytes == sum(
        p.stat().st_size for p in rank_dir(tmp_path).iterdir())
    assert info.seconds > 0


def test_collections_inside_a_model_are_keyed_by_their_path(tmp_path):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.users = make()
            self.tower = torch.nn.ModuleDict({"item": make(mode="cache")})

    model = Model()
    train(model.users, KJTS[:4])
    train(model.tower["item"], KJTS[:6])
    dump(model, tmp_path)
    manifest = json.loads((rank_dir(tmp_path) / "manifest.json").read_text())
    assert sorted(manifest["tables"]) == ["tower.item/t0", "tower.item/t1", "users/t0",
                                          "users/t1"]
    resumed = Model()
    load(resumed, tmp_path)
    assert_same_state(module_state(resumed.tower["item"]), module_state(model.tower["item"]))
    assert_same_state(module_state(resumed.users), module_state(model.users))


@pytest.mark.parametrize("mode", MODES)
def test_a_module_loads_its_own_dump_back_after_growing_and_moving_on(tmp_path, mode):
    def capacity():  # of what grows: the HBM_DIRECT device tier, the CACHE store
        table = ec.tables["t0"]
        return {"hbm_direct": lambda: table.tier.hash.capacity,
                "cache": lambda: table.store.capacity, "default": lambda: 0,
                "host_only": lambda: 0}[mode]()

    ec = trained(mode=mode, steps=1, evicting=True, store_evicts=mode == "cache")
    dump(ec, tmp_path)
    expected, before = module_state(ec), capacity()
    train(ec, KJTS[1:BEFORE])
    assert mode in ("default", "host_only") or capacity() > before
    load(ec, tmp_path)
    assert capacity() == before
    assert_same_state(module_state(ec), expected)
    fresh = make(mode=mode, evicting=True, store_evicts=mode == "cache")
    load(fresh, tmp_path)
    assert_same_state(module_state(fresh), expected)
    assert torch.equal(torch.stack(train(ec, KJTS[1:6])[0]),
                       torch.stack(train(fresh, KJTS[1:6])[0]))


def test_a_table_of_another_layout_loads_by_key(tmp_path):
    original = trained(mode="hbm_direct", optimizer="adam", evicting=True)
    dump(original, tmp_path)
    # other buckets, and room: the saved table is full, its keys fit only where they are
    resumed = make(mode="hbm_direct", optimizer="adam", evicting=True, bucket_size=16,
                   max_capacity=256)
    load(resumed, tmp_path)
    assert_same_rows(logical_rows(resumed), logical_rows(original))


# -- atomicity ----------------------------------------------------------------------------------
def test_a_dump_that_fails_half_way_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    ec = trained(mode="cache", optimizer="adam")
    first = dump(ec, tmp_path)
    expected = module_state(ec)
    train(ec, KJTS[BEFORE:])
    real_write, written = files.DirectoryWriter.write, []

    def failing(self, *args, **kwargs):
        if len(written) == 2:
            raise OSError("disk full")
        written.append(args[0])
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(files.DirectoryWriter, "write", failing)
    with pytest.raises(OSError, match="disk full"):
        dump(ec, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0_of_1"]  # no leftovers
    resumed = make(mode="cache", optimizer="adam")
    assert load(resumed, tmp_path).id == first.id
    assert_same_state(module_state(resumed), expected)


def test_dumping_over_a_checkpoint_replaces_it_with_or_without_an_atomic_exchange(
        tmp_path, monkeypatch):
    ec = trained()
    dump(ec, tmp_path)
    train(ec, KJTS[BEFORE:BEFORE + 2])
    second = dump(ec, tmp_path)
    train(ec, KJTS[BEFORE + 2:BEFORE + 4])
    monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    third = dump(ec, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0_of_1"]
    resumed = make()
    assert load(resumed, tmp_path).id == third.id != second.id
    assert_same_state(module_state(resumed), module_state(ec))


def test_an_interrupted_replacement_puts_the_previous_checkpoint_back(tmp_path):
    ec = trained()
    first = dump(ec, tmp_path)
    # a crash between the two renames of a replacement without atomic exchange
    os.rename(rank_dir(tmp_path), tmp_path / ".rank0_of_1.old-123")
    (tmp_path / ".rank0_of_1.tmp-123").mkdir()
    with pytest.raises(CheckpointFileError, match="left the previous one at .*old-123"):
        load(make(), tmp_path)
    files.remove_stale(rank_dir(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0_of_1"]
    assert load(make(), tmp_path).id == first.id


KILLED_DUMP = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from checkpoint_files_models import make
from checkpoint_models import batches, train
from dynemb.checkpoint import dump, files
kjts = batches({steps}, seed=11, batch=12)
ec = make(mode="default", optimizer="adam")
train(ec, kjts[:{before}])
dump(ec, {path!r})
train(ec, kjts[{before}:])
real_write = files.DirectoryWriter.write
def write(self, *args, **kwargs):
    if self.files == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_write(self, *args, **kwargs)
files.DirectoryWriter.write = write
dump(ec, {path!r})
"""


def test_a_dump_killed_half_way_leaves_the_previous_checkpoint_loadable(tmp_path):
    script = KILLED_DUMP.format(tests=str(Path(__file__).parent), steps=BEFORE + 4,
                                before=BEFORE, path=str(tmp_path))
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM=os.environ.get("NUMBA_ENABLE_CUDASIM", "1"))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          cwd=Path(__file__).parent.parent, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    assert any(p.name.startswith(".rank0_of_1.tmp-") for p in tmp_path.iterdir())
    expected = trained(mode="default", optimizer="adam")  # what the first dump held
    resumed = make(mode="default", optimizer="adam")
    load(resumed, tmp_path)
    assert_same_state(module_state(resumed), module_state(expected))
    dump(resumed, tmp_path)  # the next dump clears what the killed one left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0_of_1"]


# -- refused loads --------------------------------------------------------------------------------
def damaged(tmp_path, how):
    """A checkpoint with one data file damaged, and a trained model it must not change."""
    dump(trained(mode="cache", optimizer="adam"), tmp_path)
    manifest = json.loads((rank_dir(tmp_path) / "manifest.json").read_text())
    victim = rank_dir(tmp_path) / manifest["tables"]["t1"]["tiers"]["host"]["files"][0]["file"]
    data = bytearray(victim.read_bytes())
    if how == "corrupted":
        data[len(data) // 2] ^= 0x40
        victim.write_bytes(bytes(data))
    elif how == "truncated":
        victim.write_bytes(bytes(data[:-10]))
    else:
        victim.unlink()
    target = make(mode="cache", optimizer="adam")
    train(target, batches(5, seed=3))
    return target, victim


@pytest.mark.parametrize("how, message", [("corrupted", "is corrupted"),
                                          ("truncated", "truncated"), ("missing", "is missing")])
def test_a_damaged_file_is_named_and_nothing_changes(tmp_path, how, message):
    target, victim = damaged(tmp_path, how)
    before, rows = module_state(target), logical_rows(target)
    with pytest.raises(CheckpointFileError, match=f"{victim.name}.*{message}|"
                                                   f"{message}.*{victim.name}"):
        load(target, tmp_path)
    assert_same_state(module_state(target), before)
    assert_same_rows(logical_rows(target), rows)


def test_a_corrupted_file_is_found_before_any_table_changes(tmp_path, monkeypatch):
    # t1's file is read last: t0 was rebuilt already, but only aside
    target, victim = damaged(tmp_path, "corrupted")
    before = module_state(target)
    generation = target.generation
    with pytest.raises(CheckpointFileError):
        load(target, tmp_path)
    assert target.generation == generation
    assert_same_state(module_state(target), before)


def test_a_fresh_module_loads_in_place_and_is_left_empty_if_a_file_is_damaged(tmp_path):
    # a module that holds nothing loads into its own tables (no second copy of them); a
    # damaged file half-way puts every table back empty, at its capacity and counters
    dump(trained(mode="cache", optimizer="adam"), tmp_path)
    target = make(mode="cache", optimizer="adam")
    t0_before = target.tables["t0"]
    assert load(target, tmp_path).rows > 0
    assert target.tables["t0"] is t0_before  # loaded in place
    _, victim = damaged(tmp_path, "corrupted")
    empty = make(mode="cache", optimizer="adam")
    before = module_state(empty)
    with pytest.raises(CheckpointFileError, match="is corrupted"):
        load(empty, tmp_path)
    assert_same_state(module_state(empty), before)
    for name, table in empty.tables.items():
        assert table.tier.hash.size() == 0 and table.store.size() == 0, name


def test_a_manifest_lacking_a_field_is_refused_by_name(tmp_path):
    dump(trained(), tmp_path)
    path = rank_dir(tmp_path) / "manifest.json"
    edit_manifest(rank_dir(tmp_path), lambda m: m["tables"]["t1"]["tiers"]["device"].pop("clock"))
    with pytest.raises(CheckpointFileError, match=r"lacks \['tables.t1.tiers.device.clock'\]"):
        load(make(), tmp_path)
    path.write_text("{not json")
    with pytest.raises(CheckpointFileError, match="manifest.json cannot be read"):
        load(make(), tmp_path)


def test_files_of_another_world_size_or_table_set_are_refused(tmp_path, monkeypatch):
    ec = trained()
    dump(ec, tmp_path / "a")
    os.rename(rank_dir(tmp_path / "a"), tmp_path / "a" / "rank1_of_2")
    with pytest.raises(CheckpointFileError, match=r"rank1_of_2.*another world size"):
        load(make(), tmp_path / "a")
    with pytest.raises(CheckpointFileError, match="no checkpoint"):
        load(make(), tmp_path / "nowhere")
    dump(ec, tmp_path / "b")
    with pytest.raises(CheckpointFileError, match=r"table 't0'.*optimizer sgd"):
        load(make(optimizer="adam"), tmp_path / "b")
    with pytest.raises(CheckpointFileError, match="admission on in one"):
        load(make(admission=True), tmp_path / "b")


def test_a_sharded_rank_writes_its_own_directory(tmp_path, monkeypatch):
    class Sharded(ShardedDynamicModuleInterface, torch.nn.Module):  # a sharded module's face
        def __init__(self):
            super().__init__()
            self.local = make()  # nn.Module keeps it in _modules

        @property
        def local(self):
            return self._modules["local"]

    model = Sharded()
    train(model.local, KJTS[:4])
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    info = dump(model, tmp_path)
    assert (info.rank, info.world_size) == (1, 2)
    manifest = json.loads((tmp_path / "rank1_of_2" / "manifest.json").read_text())
    assert sorted(manifest["tables"]) == ["t0", "t1"]  # the sharded module's root fqn
    resumed = Sharded()
    load(resumed, tmp_path)
    assert_same_state(module_state(resumed.local), module_state(model.local))
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 4)
    with pytest.raises(CheckpointFileError, match="another world size"):
        load(resumed, tmp_path)


def test_dump_info_is_a_record(tmp_path):
    info = dump(make(), tmp_path)
    assert isinstance(info, DumpInfo) and info.rows == 0 and info.files == 1


def test_data_files_are_plain_safetensors_both_ways(tmp_path):
    # written by our streaming writer, read by the safetensors library, and the other way
    import safetensors.torch

    from dynemb.checkpoint.safetensors_io import read_file, write_file
    tensors = {"keys": torch.arange(5), "rows": torch.randn(5, 3).to(torch.bfloat16),
               "flags": torch.tensor([True, False, True, True, False])}
    size, digest = write_file(tmp_path / "ours.safetensors", tensors, {"content": "entries"})
    theirs = safetensors.torch.load_file(tmp_path / "ours.safetensors")
    for name, tensor in tensors.items():
        assert torch.equal(theirs[name], tensor)
    safetensors.torch.save_file(tensors, tmp_path / "theirs.safetensors")
    path = tmp_path / "theirs.safetensors"
    import hashlib
    back = read_file(path, path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest())
    for name, tensor in tensors.items():
        assert torch.equal(back[name], tensor)


def test_a_dump_between_forward_and_backward_of_a_stashing_table(tmp_path):
    # the rows are in host memory then: the dump brings them back first, and the
    # backward that follows trains as it would have without the dump
    import dataclasses

    from checkpoint_models import loss_of
    from checkpoint_models import model as plain_model
    from dynemb import DynamicEmbCollection, StashMode

    def stashing():
        ec = plain_model("hbm_direct", "adam")
        options = {n: dataclasses.replace(o, stash=StashMode.ALL)
                   for n, o in ec.table_options.items()}
        return DynamicEmbCollection(ec.embedding_configs(), table_options=options,
                                    optimizer=ec.optimizer_config)
    kjts = batches(6, seed=11, batch=12)
    dumped, reference = stashing(), stashing()
    for ec in (dumped, reference):
        train(ec, kjts[:3])
    out = dumped(kjts[3])
    assert dumped.memory_stash.stashed == ["t0", "t1"]
    info = dump(dumped, tmp_path)
    assert dumped.memory_stash.stashed == [] and info.rows > 0
    loss_of(out).backward()
    train(reference, kjts[3:4])
    for ec in (dumped, reference):
        train(ec, kjts[4:])
    assert_same_rows(logical_rows(dumped), logical_rows(reference))
    loaded = stashing()
    load(loaded, tmp_path)
    train(loaded, kjts[4:])  # trains on from the dump
