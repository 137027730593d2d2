"""A ScoredHashTable in a file (dynemb.checkpoint.hash_table_files): dump -> load gives the
same slot image, clock and finds; bad files raise naming the file and the field; reset
empties a table in place."""
import hashlib
import json
import struct

import pytest
import torch

from dynemb.checkpoint.hash_table_files import (TENSORS, HashTableFileError, dump_hash_table,
                                                load_hash_table)
from dynemb.checkpoint.safetensors_io import read_whole_file, write_file
from dynemb.types import EMPTY_KEY, TOMBSTONE_KEY, ScorePolicy

KEYS = torch.arange(1, 301, dtype=torch.int64) * 7919


def used_table(make_table, policy=ScorePolicy.LFU, **kwargs):
    """A table with hits (scores above 1), erased keys (tombstones) and a clock past 0."""
    table = make_table(512, policy=policy, bucket_size=32, **kwargs)
    table.find_or_insert(KEYS[:200].to(table.device))
    table.find_or_insert(KEYS[100:300].to(table.device))
    table.erase(KEYS[:40].to(table.device))
    return table


def assert_same_table(got, expected, exact=True):
    """Same layout, clock, size and finds; ``exact``: the same slot image too (CUDA kernels
    may place keys of one call in another order)."""
    for name, g, e in zip(("keys", "scores"), got.image(), expected.image()):
        assert torch.equal(g.cpu(), e.cpu()) or not exact, name
    assert (got.capacity, got.bucket_size, got.policy, got.clock, got.size()) == (
        expected.capacity, expected.bucket_size, expected.policy, expected.clock,
        expected.size())
    probe = torch.cat([KEYS, torch.tensor([5, 6])]).to(got.device)
    found, expected_found = got.find(probe).cpu(), expected.find(probe).cpu()
    assert torch.equal(found >= 0, expected_found >= 0)
    assert torch.equal(found, expected_found) or not exact


@pytest.mark.parametrize("policy", [ScorePolicy.LFU, ScorePolicy.LRU, ScorePolicy.STEP])
def test_dump_then_load_gives_the_same_table(make_table, backend, tmp_path, policy):
    table = used_table(make_table, policy, grow_at_load_factor=0.9, max_capacity=2048)
    assert bool((table.image()[0] == TOMBSTONE_KEY).any())
    path = tmp_path / "t.safetensors"
    assert dump_hash_table(table, path) == 260
    loaded = load_hash_table(path, device=backend[1], backend=backend[0])
    assert_same_table(loaded, table)
    assert (loaded.grow_at_load_factor, loaded.max_capacity) == (0.9, 2048)
    assert loaded.pinned_count() == 0 and loaded.kernels.name == backend[0]
    # the next calls go as they would have in the original
    more = KEYS[:60].to(table.device)
    loaded.find_or_insert(more)
    table.find_or_insert(more)
    assert_same_table(loaded, table, exact=backend[0] == "cpu")


def test_load_into_a_table_of_the_same_layout_replaces_its_content(make_table, tmp_path):
    table = used_table(make_table)
    path = tmp_path / "t.safetensors"
    dump_hash_table(table, path)
    other = make_table(512, policy=ScorePolicy.LFU, bucket_size=32)
    other.find_or_insert(torch.tensor([1, 2, 3], device=other.device), pin=True)
    assert load_hash_table(path, other) is other
    assert_same_table(other, table)
    assert other.pinned_count() == 0


def test_the_file_is_safetensors_with_the_layout_in_its_metadata(make_table, tmp_path):
    table = used_table(make_table)
    path = tmp_path / "t.safetensors"
    dump_hash_table(table, path)
    tensors, metadata = read_whole_file(path)
    assert sorted(tensors) == ["keys", "scores", "slots", "tombstones"]
    assert {k: metadata[k] for k in ("format", "capacity", "bucket_size", "policy", "size")} == {
        "format": "dynemb-hash-table", "capacity": "512", "bucket_size": "32",
        "policy": "lfu", "size": "260"}
    assert int(metadata["clock"]) == table.clock == 2
    keys, scores = table.image()
    assert torch.equal(keys.cpu()[tensors["slots"]], tensors["keys"])
    assert torch.equal(scores.cpu()[tensors["slots"]], tensors["scores"])
    # keys hit by both calls count 2 (LFU), the others 1
    both = torch.isin(tensors["keys"], KEYS[100:200])
    assert set(tensors["scores"][both].tolist()) == {2}
    assert set(tensors["scores"][~both].tolist()) == {1}
    assert tensors["tombstones"].numel() == 40


@pytest.mark.parametrize("field, value", [("capacity", 1024), ("bucket_size", 64),
                                          ("policy", ScorePolicy.LRU)])
def test_a_table_of_another_layout_refuses_and_stays(make_table, tmp_path, field, value):
    path = tmp_path / "t.safetensors"
    dump_hash_table(used_table(make_table), path)
    layout = dict(capacity=512, bucket_size=32, policy=ScorePolicy.LFU)
    layout[field] = value
    capacity = layout.pop("capacity")
    other = make_table(capacity, **layout)
    other.find_or_insert(torch.tensor([1, 2, 3], device=other.device))
    before = [t.clone() for t in other.image()]
    with pytest.raises(HashTableFileError, match=f"t.safetensors: {field} is .* but the "
                                                  f"table's is"):
        load_hash_table(path, other)
    assert all(torch.equal(b, a) for b, a in zip(before, other.image()))


def rewrite(path, edit_tensors=None, edit_metadata=None):
    """Write the file again with edited tensors / metadata (content_sha256 recomputed unless
    the edit sets it)."""
    tensors, metadata = read_whole_file(path)
    tensors = {k: v.clone() for k, v in tensors.items()}
    if edit_tensors:
        edit_tensors(tensors)
    digest = hashlib.sha256()
    for name in TENSORS:
        if name in tensors:
            digest.update(tensors[name].numpy().tobytes())
    metadata["content_sha256"] = digest.hexdigest()
    if edit_metadata:
        edit_metadata(metadata)
    write_file(path, tensors, metadata)


def _moved_key(tensors):
    """The first entry's key written into a free slot of another bucket (of 32 slots)."""
    taken = set(tensors["slots"].tolist()) | set(tensors["tombstones"].tolist())
    bucket = int(tensors["slots"][0]) // 32
    tensors["slots"][0] = next(s for s in range(512) if s not in taken and s // 32 != bucket)


def _twice(tensors):
    tensors["slots"][1] = tensors["slots"][0]


@pytest.mark.parametrize("edit_tensors, edit_metadata, message", [
    (None, lambda m: m.pop("clock"), "metadata field 'clock' is missing"),
    (None, lambda m: m.update(format="other"), "metadata field 'format' is 'other'"),
    (None, lambda m: m.update(format_version="9"), "metadata field 'format_version' is '9'"),
    (None, lambda m: m.update(policy="most_recent"), "metadata field 'policy' is"),
    (None, lambda m: m.update(capacity="-4"), "metadata field 'capacity' must be an integer"),
    (None, lambda m: m.update(size="3"), "tensor 'keys' has 260 entries but metadata field "
                                         "'size' says 3"),
    (None, lambda m: m.update(max_capacity="lots"), "'max_capacity' must be 'none' or a int"),
    (None, lambda m: m.update(content_sha256="0" * 64), "do not match metadata field "
                                                        "'content_sha256'"),
    (lambda t: t.pop("tombstones"), None, "tensor 'tombstones' is missing"),
    (lambda t: t.update(scores=t["scores"].int()), None, "tensor 'scores' must be 1-D int64"),
    (lambda t: t["slots"].__setitem__(0, 512), None, r"'slots' holds a slot outside \[0, 512\)"),
    (_twice, None, "name a slot twice"),
    (lambda t: t["keys"].__setitem__(0, EMPTY_KEY), None, "holds a reserved key"),
    (_moved_key, None, "outside their bucket"),
])
def test_a_bad_file_raises_naming_the_file_and_field(make_table, tmp_path, edit_tensors,
                                                     edit_metadata, message):
    path = tmp_path / "t.safetensors"
    dump_hash_table(used_table(make_table), path)
    rewrite(path, edit_tensors, edit_metadata)
    with pytest.raises(HashTableFileError, match=f"t.safetensors.*{message}"):
        load_hash_table(path)
    target = make_table(512, policy=ScorePolicy.LFU, bucket_size=32)
    target.find_or_insert(torch.tensor([1, 2], device=target.device))
    before = [t.clone() for t in target.image()]
    with pytest.raises(HashTableFileError):
        load_hash_table(path, target)
    assert all(torch.equal(b, a) for b, a in zip(before, target.image()))


def test_a_file_that_is_not_one(make_table, tmp_path):
    path = tmp_path / "t.safetensors"
    path.write_bytes(b"\x00" * 4)
    with pytest.raises(HashTableFileError, match="t.safetensors is not a safetensors file"):
        load_hash_table(path)
    path.write_bytes(struct.pack("<Q", 2) + json.dumps([]).encode())
    with pytest.raises(HashTableFileError, match="the header is not a map"):
        load_hash_table(path)
    with pytest.raises(FileNotFoundError):
        load_hash_table(tmp_path / "missing.safetensors")


# -- reset -----------------------------------------------------------------------------------
def test_reset_empties_the_table_in_place(make_table, backend):
    table = used_table(make_table, ScorePolicy.LRU)
    table.find_or_insert(KEYS[250:260].to(table.device), pin=True)
    keys_array, scores_array = table.image()
    table.reset()
    assert (table.size(), table.clock, table.pinned_count(), table.capacity) == (0, 0, 0, 512)
    assert bool((keys_array == EMPTY_KEY).all()) and bool((scores_array == 0).all())
    assert table.image()[0] is keys_array
    assert bool((table.find(KEYS.to(table.device)) == -1).all())
    # from now on it is a fresh table
    fresh = make_table(512, policy=ScorePolicy.LRU, bucket_size=32)
    for t in (table, fresh):
        t.find_or_insert(KEYS[:100].to(t.device))
    assert_same_table(table, fresh, exact=backend[0] == "cpu")
