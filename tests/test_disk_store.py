"""The disk store (dynemb.stores.disk_store) and its host level (dynemb.stores.disk_levels): the
BackingStore protocol against a Python model, reopening, bad directories, and failing writes
that change nothing."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dynemb.stores.backing_store import HostBackingStore
from dynemb.stores.disk_levels import (HostCachedStore, directory_prefix, disk_store,
                                 host_level_slots)
from dynemb.stores.disk_store import DiskBackingStore, DiskOptions, StoreMismatchError

CPU = torch.device("cpu")
WIDTH = 3


def new_disk(path=None, **kwargs) -> DiskBackingStore:
    return DiskBackingStore(path or tempfile.mkdtemp(), WIDTH, torch.float32, CPU, **kwargs)


def new_levels(host_rows=128) -> HostCachedStore:
    host = HostBackingStore(WIDTH, torch.float32, CPU, initial_capacity=128,
                            max_capacity=host_rows)
    return HostCachedStore(host, new_disk())


def export_all(store, batch):
    keys, rows, scores, start, chunks = [], [], [], 0, 0
    while start is not None:
        k, r, s, start = store.export(start, batch)
        assert k.numel() <= batch
        keys.append(k), rows.append(r), scores.append(s)
        chunks += 1
    return torch.cat(keys), torch.cat(rows), torch.cat(scores), chunks


def check_against(store, model) -> None:
    """The store holds exactly ``model`` ({key: (row, score)})."""
    assert store.size() == len(model)
    keys, rows, scores, _ = export_all(store, batch=7)
    assert sorted(keys.tolist()) == sorted(model) and len(set(keys.tolist())) == len(model)
    for k, r, s in zip(keys.tolist(), rows, scores.tolist()):
        assert torch.equal(r, model[k][0]) and s == model[k][1]
    probe = torch.tensor(sorted(model) + [12345678901], dtype=torch.int64)
    found_rows, found, found_scores = store.find(probe)
    assert found.tolist() == [True] * len(model) + [False]
    for i, k in enumerate(sorted(model)):
        assert torch.equal(found_rows[i], model[k][0]) and found_scores[i] == model[k][1]


key_values = st.integers(min_value=-(2**63) + 2, max_value=2**63 - 1)
batches = st.lists(st.lists(key_values, min_size=1, max_size=40, unique=True), min_size=1,
                   max_size=8)


@settings(max_examples=25, deadline=None)
@given(batches=batches, seed=st.integers(0, 2**31), levels=st.booleans())
def test_a_store_holds_what_a_python_model_of_it_holds(batches, seed, levels):
    # negative keys and the extremes of int64 included; every key inserted once or again
    store = new_levels(host_rows=128) if levels else new_disk()
    gen = torch.Generator().manual_seed(seed)
    model = {}
    for keys in batches:
        rows = torch.randn(len(keys), WIDTH, generator=gen)
        scores = torch.randint(0, 1000, (len(keys),), generator=gen)
        assert store.insert(torch.tensor(keys), rows, scores) == 0
        model.update({k: (rows[i], int(scores[i])) for i, k in enumerate(keys)})
    check_against(store, model)
    if levels:  # a flush writes the host level through: the disk alone holds every row
        store.flush()
        check_against(store.disk, model)
        check_against(store, model)
    store.close()


def test_the_host_level_spills_its_lowest_scores_to_disk_and_counts_each_key_once():
    store = new_levels(host_rows=128)
    keys = torch.arange(1000) * 7919 - 3000
    scores = torch.arange(1000)  # later keys score higher: the host keeps the last ones
    rows = torch.randn(1000, WIDTH)
    for lo in range(0, 1000, 100):  # a call's keys do not evict each other: 10 calls
        store.insert(keys[lo:lo + 100], rows[lo:lo + 100], scores[lo:lo + 100])
    assert store.host.size() == 128 and store.disk.size() == 1000 - 128
    on_host = store.host.find(keys)[1]
    assert not bool((store.disk.find(keys)[1] & on_host).any())  # none came back up yet
    assert scores[on_host].min() >= 800  # the last call's and the best of the one before
    assert torch.equal(store.find(keys)[0], rows)
    # a key coming back to the host keeps its disk copy (a crash then loses no key); the
    # host level's newer row is the one found, and the key is counted once
    back = keys[:5]
    store.insert(back, torch.zeros(5, WIDTH), torch.full((5,), 10**6))
    assert bool(store.host.find(back)[1].all()) and bool(store.disk.find(back)[1].all())
    assert torch.equal(store.disk.find(back)[0], rows[:5])
    assert torch.equal(store.find(back)[0], torch.zeros(5, WIDTH))
    assert store.size() == 1000 and export_all(store, batch=64)[0].numel() == 1000
    store.flush()  # written through: the disk's copies are the latest
    assert torch.equal(store.disk.find(back)[0], torch.zeros(5, WIDTH))
    assert store.disk.size() == store.size() == 1000 and store.host.size() == 128


def test_export_is_a_range_scan_in_key_order_whatever_the_insert_order():
    store = new_disk()
    keys = torch.tensor([5, -7, 2**63 - 1, -(2**63) + 2, 0, 1 << 40])
    store.insert(keys, torch.randn(6, WIDTH), torch.arange(6))
    got, _, _, chunks = export_all(store, batch=2)
    assert got.tolist() == sorted(keys.tolist()) and chunks >= 3


def test_a_store_opens_again_with_its_rows_and_refuses_another_tables():
    path = tempfile.mkdtemp()
    facts = {"name": "t", "dim": 2, "optimizer": "ADAM"}
    store = new_disk(path, table=facts)
    rows = torch.randn(4, WIDTH)
    store.insert(torch.tensor([1, 2, 3, 4]), rows, torch.tensor([9, 8, 7, 6]))
    store.close()
    again = new_disk(path, table=facts)
    assert again.size() == 4 and torch.equal(again.find(torch.tensor([3]))[0][0], rows[2])
    again.close()
    for table, width, dtype, what in (
            ({**facts, "optimizer": "SGD"}, WIDTH, torch.float32, "optimizer"),
            (facts, WIDTH + 1, torch.float32, "width"),
            (facts, WIDTH, torch.float16, "dtype")):
        with pytest.raises(StoreMismatchError, match=what):
            DiskBackingStore(path, width, dtype, CPU, table=table)
    reopened = new_disk(path, table=facts)  # refused opens changed nothing
    assert reopened.size() == 4
    assert torch.equal(reopened.find(torch.tensor([1, 2, 3, 4]))[0], rows)


def test_a_path_under_a_file_is_refused_before_anything_is_made():
    base = tempfile.mkdtemp()
    blocker = os.path.join(base, "a_file")
    open(blocker, "w").close()
    with pytest.raises(NotADirectoryError, match="not a directory"):
        new_disk(os.path.join(blocker, "store"))
    with pytest.raises(NotADirectoryError, match="not a directory"):
        disk_store(os.path.join(blocker, "stores"))(WIDTH, torch.float32, CPU)
    assert os.listdir(base) == ["a_file"]


def test_a_home_relative_directory_is_expanded(tmp_path, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    factory = disk_store("~/stores")
    store = factory(WIDTH, torch.float32, CPU)
    alone = new_disk("~/alone")
    assert factory.directory == home / "stores" and alone.path == home / "alone"
    assert len(os.listdir(home / "stores")) == 1 and os.listdir(cwd) == []
    alone.insert(torch.tensor([1]), torch.ones(1, WIDTH), torch.tensor([1]))
    alone.close()
    assert new_disk(str(home / "alone")).size() == 1


def test_a_host_budget_below_one_bucket_is_refused_with_the_bytes_it_needs():
    with pytest.raises(ValueError, match="at least 8704 bytes"):
        disk_store(tempfile.mkdtemp(), host_cache_bytes=1000)(WIDTH * 4, torch.float32, CPU)
    assert host_level_slots(8704, WIDTH * 4, torch.float32) == 128


class _DiskFull(Exception):
    pass


def _fail_writes(store: DiskBackingStore, monkeypatch) -> None:
    """Every later write batch of ``store`` fails as RocksDB's do on a full disk."""
    class FailingDb:
        def __init__(self, db):
            self._db = db

        def write(self, batch, options=None):
            raise _DiskFull("IO error: No space left on device")

        def __getattr__(self, name):
            return getattr(self._db, name)
    monkeypatch.setattr(store, "_db", FailingDb(store._db))


def test_a_failed_disk_write_raises_and_changes_neither_level(monkeypatch):
    store = new_levels(host_rows=128)
    keys = torch.arange(128)
    rows = torch.randn(128, WIDTH)
    store.insert(keys, rows, torch.arange(128))  # the host level is full
    before = export_all(store, batch=64)
    _fail_writes(store.disk, monkeypatch)
    with pytest.raises(OSError, match="No space left on device.*|nothing was written"):
        store.insert(torch.arange(1000, 1100), torch.ones(100, WIDTH),
                     torch.full((100,), 10**6))  # would push 100 host rows to disk
    after = export_all(store, batch=64)
    assert all(torch.equal(a, b) for a, b in zip(before[:3], after[:3]))
    assert store.size() == 128 and store.host.hash_table.pinned_count() == 0
    assert torch.equal(store.find(keys)[0], rows)


def test_failed_reads_and_flushes_raise_oserror_naming_the_store(monkeypatch):
    # rocksdict raises plain Exceptions: reads, scans and flushes say OSError, as writes do
    store = new_disk()
    store.insert(torch.arange(4), torch.ones(4, WIDTH), torch.arange(4))

    class Corrupt:
        def __init__(self, db):
            self._db = db

        def _fail(self, *args, **kwargs):
            raise Exception("Corruption: block checksum mismatch")
        get = items = flush = _fail

        def __getattr__(self, name):
            return getattr(self._db, name)
    monkeypatch.setattr(store, "_db", Corrupt(store._db))
    path = repr(str(store.path))
    for doing, call in (("reading", lambda: store.find(torch.arange(4))),
                        ("reading", lambda: store.export(0, 10)),
                        ("reading", lambda: store.contains(torch.arange(4))),
                        ("flushing", store.flush)):
        with pytest.raises(OSError, match=f"{doing} the disk store at {path} failed: "
                                          f"Corruption"):
            call()


@pytest.mark.parametrize("wal", [True, False])
def test_after_a_failed_write_a_store_reopens_with_the_log_or_says_how_to_keep_its_rows(
        wal, monkeypatch):
    store = new_disk(options=DiskOptions(wal=wal))
    rows = torch.randn(8, WIDTH)
    store.insert(torch.arange(8), rows, torch.arange(8))
    _fail_writes(store, monkeypatch)
    with pytest.raises(OSError, match="writing the disk store .* nothing was written"):
        store.insert(torch.arange(8, 12), torch.ones(4, WIDTH), torch.arange(4))
    monkeypatch.undo()  # the disk has room again; RocksDB still refuses (its error sticks)
    more = (torch.arange(8, 12), torch.ones(4, WIDTH), torch.arange(4))
    if wal:  # opened again: the log kept every row
        store.insert(*more)
        assert store.size() == 12 and torch.equal(store.find(torch.arange(8))[0], rows)
    else:
        with pytest.raises(OSError, match="refuses writes .* dynemb.checkpoint.dump"):
            store.insert(*more)
        assert store.size() == 8 and torch.equal(store.find(torch.arange(8))[0], rows)


def test_disk_options_are_checked():
    with pytest.raises(ValueError, match="compression"):
        DiskOptions(compression="gzip")
    with pytest.raises(ValueError, match="block_cache_bytes"):
        DiskOptions(block_cache_bytes=-1)
    store = new_disk(options=DiskOptions(compression="lz4", wal=True, block_cache_bytes=0))
    store.insert(torch.tensor([1]), torch.ones(1, WIDTH), torch.tensor([1]))
    assert store.find(torch.tensor([1]))[1].item()


def test_a_store_built_by_the_factory_goes_with_its_table():
    directory = tempfile.mkdtemp()
    factory = disk_store(directory).for_table(name="clicks", dim=2)
    store = factory(WIDTH, torch.float32, CPU)
    (made,) = os.listdir(directory)
    assert made.startswith("clicks-")
    store.insert(torch.tensor([1]), torch.ones(1, WIDTH), torch.tensor([1]))
    del store
    import gc
    gc.collect()
    assert os.listdir(directory) == []
    with pytest.raises(TypeError, match="dump"):
        import pickle
        pickle.dumps(factory(WIDTH, torch.float32, CPU))


def test_a_store_directory_of_any_table_name_fits_a_file_name():
    assert directory_prefix("user/clicks") == "user_clicks"  # short names as they are
    assert directory_prefix("é" * 50) == "é" * 50  # 100 bytes
    cut = [directory_prefix(n) for n in ("t" * 299 + "x", "t" * 299 + "y", "é" * 300)]
    assert len(set(cut)) == 3 and all(len(p.encode()) <= 120 for p in cut)
    assert cut[0].startswith("t" * 100) and cut[2].startswith("é" * 50)
    directory = tempfile.mkdtemp()
    stores = [disk_store(directory).for_table(name=name)(WIDTH, torch.float32, CPU)
              for name in ("t" * 299 + "x", "t" * 299 + "y")]
    assert len(os.listdir(directory)) == len(stores) == 2


def test_rows_keep_their_bits_in_every_dtype():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        store = DiskBackingStore(tempfile.mkdtemp(), 5, dtype, CPU)
        rows = (torch.randn(50, 5) * 1e3).to(dtype)
        store.insert(torch.arange(50), rows, torch.arange(50))
        got = store.find(torch.arange(50))[0]
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert got.dtype == dtype and torch.equal(got.view(bits), rows.view(bits))


def test_a_directory_this_process_cannot_write_is_refused_before_anything_is_made(monkeypatch):
    # (as root every directory is writable: the check is made to say no)
    base = tempfile.mkdtemp()
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(PermissionError, match="not writable"):
        new_disk(os.path.join(base, "store"))
    with pytest.raises(PermissionError, match="not writable"):
        disk_store(os.path.join(base, "stores"))(WIDTH, torch.float32, CPU)
    assert os.listdir(base) == []


def test_a_rocksdb_database_that_is_not_a_store_is_left_alone():
    import rocksdict
    path = tempfile.mkdtemp()
    options = rocksdict.Options(raw_mode=True)
    options.create_if_missing(True)
    db = rocksdict.Rdict(path, options)
    db[b"\x00someone else's"] = b"data"
    db.close()
    with pytest.raises(StoreMismatchError, match="not a dynemb store"):
        new_disk(path)
    db = rocksdict.Rdict(path, options)
    assert list(db.keys()) == [b"\x00someone else's"]
    db.close()
