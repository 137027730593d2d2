"""Checkpoint files edited by hand or by someone else: data paths that leave the checkpoint
directory, manifests whose values were changed, keys moved to slots where lookups cannot
find them. Each is refused with an error naming what is wrong, and the module it was
loaded into is left exactly as it was."""
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint_files_models import (assert_same_rows, assert_same_state, edit_manifest,
                                     logical_rows, make, module_state, signed)
from checkpoint_models import batches, train
from dynemb import ScorePolicy
from dynemb.types import EMPTY_KEY, TOMBSTONE_KEY
from dynemb.checkpoint import dump, load
from dynemb.checkpoint.files import CheckpointFileError
from dynemb.foundations.key_mixing import mix_keys, reduce_to_range


def rank_dir(path):
    return Path(path) / "rank0_of_1"


def trained(steps=14, seed=11, **kwargs):
    ec = make(**kwargs)
    train(ec, batches(steps, seed=seed, batch=12))
    return ec


def target(**kwargs):
    """A trained module (other rows than the dumped one) a refused load must not change."""
    return trained(steps=5, seed=3, **kwargs)


def assert_refused(module, path, match, error=CheckpointFileError):
    """Loading ``path`` raises ``error`` matching ``match`` and ``module`` is unchanged."""
    before, rows, generation = module_state(module), logical_rows(module), module.generation
    with pytest.raises(error, match=match) as info:
        load(module, path)
    assert module.generation == generation
    assert_same_state(module_state(module), before)
    assert_same_rows(logical_rows(module), rows)
    return str(info.value)


def manifest_of(path):
    return json.loads((rank_dir(path) / "manifest.json").read_text())


def first_file(path, table="t0", tier="device", content="entries"):
    records = manifest_of(path)["tables"][table]["tiers"][tier]["files"]
    return next(r for r in records if r["content"] == content)


# -- data paths ---------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_a_data_file_outside_the_directory_is_refused_alike_whether_it_exists_or_not(
        tmp_path, where):
    ckpt = tmp_path / "ckpt"
    dump(trained(), ckpt)
    (tmp_path / "outside.safetensors").write_bytes(b"12345")
    messages = []
    for name in ["outside.safetensors", "absent.safetensors"]:
        bad = f"../../{name}" if where == "relative" else str(tmp_path / name)
        edit_manifest(rank_dir(ckpt), lambda m: first_file_of(m).update(file=bad))
        message = assert_refused(target(), ckpt, "not a file of")
        assert "bytes" not in message and "missing" not in message
        messages.append(message.replace(bad, "<name>"))
    assert messages[0] == messages[1]  # nothing tells whether the outside file exists


def first_file_of(manifest):
    return manifest["tables"]["t0"]["tiers"]["device"]["files"][0]


def test_a_data_file_linked_out_of_the_directory_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    dump(trained(), ckpt)
    record = first_file(ckpt)
    inside = rank_dir(ckpt) / record["file"]
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(inside, outside)
    os.symlink(outside, inside)  # the very bytes the manifest records, but outside
    assert_refused(target(), ckpt, "not a file of")
    # a link to a file inside the directory stays inside: it loads
    os.unlink(inside)
    shutil.move(outside, rank_dir(ckpt) / "moved.safetensors")
    os.symlink("moved.safetensors", inside)
    assert load(make(), ckpt).rows > 0


def test_a_manifest_linked_out_of_the_directory_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    dump(trained(), ckpt)
    manifest = rank_dir(ckpt) / "manifest.json"
    shutil.move(manifest, tmp_path / "manifest.json")
    os.symlink(tmp_path / "manifest.json", manifest)
    assert_refused(target(), ckpt, "links out of")


def test_a_deleted_manifest_is_named_as_missing(tmp_path):
    dump(trained(), tmp_path)
    (rank_dir(tmp_path) / "manifest.json").unlink()
    message = assert_refused(target(), tmp_path, r"manifest\.json is missing")
    assert "world size" not in message


# -- the manifest's checksum ------------------------------------------------------------------
def test_the_manifest_carries_the_sha256_of_its_canonical_json(tmp_path):
    dump(trained(), tmp_path)
    manifest = manifest_of(tmp_path)
    assert manifest["format_version"] == 2
    assert manifest["manifest_sha256"] == signed(manifest)["manifest_sha256"]
    rest = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    canonical = json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()
    assert manifest["manifest_sha256"] == hashlib.sha256(canonical).hexdigest()


@pytest.mark.parametrize("edit", ["step", "counter", "clock", "no checksum"])
def test_a_manifest_edited_without_its_checksum_is_refused_first(tmp_path, edit):
    dump(trained(), tmp_path)

    def change(m):
        t0 = m["tables"]["t0"]
        if edit == "step":
            t0["step"] += 3
        elif edit == "counter":
            t0["counters"]["lookups"] = -5  # also out of range: the checksum is looked at first
        elif edit == "clock":
            t0["tiers"]["device"]["clock"] += 1
        else:
            del m["manifest_sha256"]
    edit_manifest(rank_dir(tmp_path), change, sign=False)
    assert_refused(target(), tmp_path, r"manifest\.json: the manifest does not match its checksum")


def test_a_manifest_of_format_version_1_is_refused(tmp_path):
    # version 1 manifests carry no checksum: nothing in them could be trusted
    dump(trained(), tmp_path)

    def to_version_1(m):
        m["format_version"] = 1
        del m["manifest_sha256"]
    edit_manifest(rank_dir(tmp_path), to_version_1, sign=False)
    assert_refused(target(), tmp_path, r"format version 1 \(written before manifests carried a "
                                       r"checksum\), this dynemb reads version 2")


# -- typed fields -------------------------------------------------------------------------------
def _tier(m):
    return m["tables"]["t0"]["tiers"]["device"]


BAD_FIELDS = {
    "capacity is a string": (lambda m: _tier(m).update(capacity="abc"),
                             "tables.t0.tiers.device.capacity"),
    "negative counter": (lambda m: m["tables"]["t0"]["counters"].update(lookups=-5),
                         "tables.t0.counters.lookups"),
    "unknown counter": (lambda m: m["tables"]["t0"]["counters"].update(bogus=1),
                        "tables.t0.counters"),
    "negative step": (lambda m: m["tables"]["t0"].update(step=-1), "tables.t0.step"),
    "boolean step": (lambda m: m["tables"]["t0"].update(step=True), "tables.t0.step"),
    "float step": (lambda m: m["tables"]["t0"].update(step=2.0), "tables.t0.step"),
    "huge step": (lambda m: m["tables"]["t0"].update(step=2 ** 64), "tables.t0.step"),
    "negative clock": (lambda m: _tier(m).update(clock=-3), "tables.t0.tiers.device.clock"),
    "zero dim": (lambda m: m["tables"]["t0"].update(dim=0), "tables.t0.dim"),
    "dim not the signature's": (lambda m: m["tables"]["t0"].update(dim=9), "tables.t0.dim"),
    "rank is a string": (lambda m: m.update(rank="0"), "rank"),
    "bucket not a power of two": (lambda m: _tier(m).update(bucket_size=24),
                                  "tables.t0.tiers.device.bucket_size"),
    "negative live rows": (lambda m: _tier(m).update(live_rows=-1),
                           "tables.t0.tiers.device.live_rows"),
    "unknown write": (lambda m: _tier(m).update(write="sideways"),
                      "tables.t0.tiers.device.write"),
    "bytes is a string": (lambda m: _tier(m)["files"][0].update(bytes="12"),
                          r"tables.t0.tiers.device.files\[0\].bytes"),
    "sha256 not hex": (lambda m: _tier(m)["files"][0].update(sha256="xyz"),
                       r"tables.t0.tiers.device.files\[0\].sha256"),
    "rows not the files'": (lambda m: _tier(m).update(rows=_tier(m)["rows"] + 1),
                            "tables.t0.tiers.device.rows"),
    "signature not a list": (lambda m: m["tables"]["t0"].update(signature="abc"),
                             "tables.t0.signature"),
    "signature beyond int64": (lambda m: m["tables"]["t0"]["signature"].append(2 ** 64),
                               "tables.t0.signature"),
    "a full dump following another": (lambda m: m.update(previous="abc"), "previous"),
}


@pytest.mark.parametrize("case", sorted(BAD_FIELDS))
def test_a_field_of_the_wrong_type_or_range_is_refused_by_name(tmp_path, case):
    edit, field = BAD_FIELDS[case]
    dump(trained(), tmp_path)
    edit_manifest(rank_dir(tmp_path), edit)  # signed again: the values are what is checked
    message = assert_refused(target(), tmp_path, rf"manifest\.json: {field} must be")
    assert str(rank_dir(tmp_path)) in message


# -- keys where lookups cannot find them ---------------------------------------------------------
def rewrite_entries(path, table, tier, change):
    """Apply ``change`` to the tensors of the first entries file of ``table``'s ``tier``
    and write it back with its manifest record (size, sha256, counts) and checksum."""
    record = first_file(path, table, tier)
    file = rank_dir(path) / record["file"]
    data = {k: v.clone() for k, v in load_file(file).items()}
    data = change(data)
    save_file(data, file, {"content": "entries"})
    added = data["keys"].numel() - record["rows"]

    def update(m):
        t = m["tables"][table]["tiers"][tier]
        r = next(f for f in t["files"] if f["file"] == record["file"])
        r.update(rows=r["rows"] + added, bytes=file.stat().st_size,
                 sha256=hashlib.sha256(file.read_bytes()).hexdigest())
        t["rows"] += added
        t["live_rows"] += added
    edit_manifest(rank_dir(path), update)


def slot_image(data, capacity):
    keys = torch.full((capacity,), EMPTY_KEY, dtype=torch.int64)
    keys[data["slots"]] = data["keys"]
    return keys


def bucketed(path, table="t0", tier="device"):
    layout = manifest_of(path)["tables"][table]["tiers"][tier]
    return layout["capacity"], layout["bucket_size"]


def move_key(path, pick_slot):
    """Move the first entry of t0's device tier to the empty slot ``pick_slot`` gives."""
    capacity, bucket = bucketed(path)

    def change(data):
        image = slot_image(data, capacity)
        data["slots"][0] = pick_slot(image, int(data["slots"][0]), bucket)
        return data
    rewrite_entries(path, "t0", "device", change)


def empty_slot(image, bucket, own, same_bucket):
    """An empty slot in (or outside) bucket ``own``."""
    slots = torch.arange(image.numel())
    ok = (image == EMPTY_KEY) & ((slots // bucket == own) == same_bucket)
    return int(slots[ok][0])


def test_a_key_moved_to_another_bucket_is_refused(tmp_path):
    dump(trained(), tmp_path)
    move_key(tmp_path, lambda image, slot, b: empty_slot(image, b, slot // b, False))
    assert_refused(target(), tmp_path, r"table 't0', tier 'device'.*outside their bucket")


def test_a_key_moved_past_an_empty_slot_of_its_bucket_is_refused(tmp_path):
    # its old slot becomes empty: every other empty slot of the bucket is past it
    dump(trained(), tmp_path)
    move_key(tmp_path, lambda image, slot, b: empty_slot(image, b, slot // b, True))
    assert_refused(target(), tmp_path, r"table 't0', tier 'device'.*past an empty slot")


def test_a_key_stored_twice_in_a_tier_is_refused(tmp_path):
    dump(trained(), tmp_path)
    capacity, bucket = bucketed(tmp_path)

    def duplicate_first(data):
        image = slot_image(data, capacity)
        slot = int(data["slots"][0])
        # walk its probe on from its slot to the next empty one: the copy there is reachable
        base, pos = slot - slot % bucket, slot % bucket
        while int(image[base + pos]) != EMPTY_KEY:
            pos = (pos + 1) % bucket
        copy = {k: v[:1] for k, v in data.items()}
        copy["slots"] = torch.tensor([base + pos])
        return {k: torch.cat([v, copy[k]]) for k, v in data.items()}
    rewrite_entries(tmp_path, "t0", "device", duplicate_first)
    assert_refused(target(), tmp_path, r"table 't0', tier 'device'.*stored twice")


def test_a_delta_holding_a_key_twice_is_refused_by_table_and_tier(tmp_path):
    ec = trained()
    base = dump(ec, tmp_path / "base")
    train(ec, batches(4, seed=5, batch=12))
    dump(ec, tmp_path / "delta", since=base)
    rewrite_entries(tmp_path / "delta", "t0", "device",
                    lambda d: {k: torch.cat([v, v[:1]]) for k, v in d.items()})
    module = target()
    before = module_state(module)
    with pytest.raises(CheckpointFileError, match=r"table 't0', tier 'device'.*stored twice"):
        load(module, [tmp_path / "base", tmp_path / "delta"])
    assert_same_state(module_state(module), before)


def test_a_key_copied_to_the_other_tier_of_a_default_table_is_refused(tmp_path):
    dump(trained(mode="default"), tmp_path)
    device_capacity, _ = bucketed(tmp_path, "t0", "device")
    capacity, bucket = bucketed(tmp_path, "t0", "host")
    moved = {}

    def copy_first(data):
        moved.update({k: v[:1].clone() for k, v in data.items()})
        return data

    def put_in_host(data):
        # the slot the host table would give it: its bucket, first empty slot of its probe
        key = moved["keys"]
        mixed = mix_keys(key)
        base = int(reduce_to_range(mixed, capacity // bucket)) * bucket
        image, pos = slot_image(data, capacity), int(mixed & (bucket - 1))
        while int(image[base + pos]) not in (EMPTY_KEY, TOMBSTONE_KEY):
            pos = (pos + 1) % bucket
        moved["slots"] = torch.tensor([base + pos])
        return {k: torch.cat([v, moved[k]]) for k, v in data.items()}
    rewrite_entries(tmp_path, "t0", "device", copy_first)  # unchanged: only read
    rewrite_entries(tmp_path, "t0", "host", put_in_host)
    assert device_capacity > 0
    assert_refused(target(mode="default"), tmp_path,
                   r"table 't0', tier 'host'.*belong to the device tier")


# -- mismatches in words ----------------------------------------------------------------------
def test_a_score_policy_mismatch_names_the_policies(tmp_path):
    dump(trained(policy=ScorePolicy.LFU), tmp_path)
    assert_refused(target(), tmp_path, "score policy LFU in the checkpoint, LRU here")
