"""CACHE tables whose store is on disk (dynemb.stores.disk_levels.disk_store), with and without a
host level, against the same tables over the default host-memory store: bit for bit, every
optimizer; checkpoints through dump / load; a full disk mid-step; a killed process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import DynamicEmbCollection, DynamicEmbTableOptions
from dynemb.checkpoint import dump, load
from dynemb.stores.disk_levels import HostCachedStore, disk_store
from dynemb.stores.disk_store import DiskBackingStore
from dynemb.rows.optimizers import OptimizerConfig, OptimizerType
from dynemb.types import ScorePolicy

FEATURES = ["f0", "f1", "f2"]
DIM = 8
VOCAB = (900, 1500, 400)
CACHED = (96, 128, 64)  # device rows, well below the ids seen: every step writes back


def module(store_factory, optimizer=OptimizerType.ADAM, policy=ScorePolicy.LFU,
           group_tables=True):
    width = DIM + OptimizerConfig(optimizer).state_dim(DIM)
    configs = [EmbeddingConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=v,
                               feature_names=[f]) for i, (f, v) in enumerate(zip(FEATURES, VOCAB))]
    options = {f"t{i}": DynamicEmbTableOptions(
        caching=True, bucket_size=32, score_strategy=policy, backing_store=store_factory,
        local_hbm_for_values=rows * width * 4) for i, rows in enumerate(CACHED)}
    decay = 0.01 if optimizer is OptimizerType.ADAM else 0.0
    return DynamicEmbCollection(configs, table_options=options, group_tables=group_tables,
                                optimizer=OptimizerConfig(optimizer, learning_rate=0.05,
                                                          weight_decay=decay))


def batch(gen):
    parts = [torch.randint(0, v, (48,), generator=gen) for v in VOCAB]
    return KeyedJaggedTensor.from_lengths_sync(FEATURES, torch.cat(parts),
                                               torch.full((3 * 12,), 4))


def step(m, kjt):
    out = m(kjt)
    sum((out[f].values() ** 2).sum() * (i + 1) for i, f in enumerate(FEATURES)).backward()
    return out


def assert_same_tables(a, b):
    """Outputs aside, everything a table holds: device images, rows with optimizer state,
    the stores' rows and scores, counters."""
    assert a.stats() == b.stats()
    for name, vocab in zip(a.tables, VOCAB):
        ta, tb = a.tables[name], b.tables[name]
        for x, y in zip(ta.tier.hash.image(), tb.tier.hash.image()):
            assert torch.equal(x, y), name
        keys = torch.arange(vocab)
        ra, rb = a.read_rows(name, keys, with_state=True), b.read_rows(name, keys, with_state=True)
        assert torch.equal(ra[0], rb[0]) and torch.equal(ra[1], rb[1]), name
        (rows_a, found_a, scores_a), (rows_b, found_b, scores_b) = (
            ta.store.find(keys), tb.store.find(keys))  # what a key not stored gets is unset
        assert torch.equal(found_a, found_b), name
        assert torch.equal(rows_a[found_a], rows_b[found_b]), name
        assert torch.equal(scores_a[found_a], scores_b[found_b]), name
        assert ta.store.size() == tb.store.size()


def host_bytes(optimizer, rows=128):
    return rows * ((DIM + OptimizerConfig(optimizer).state_dim(DIM)) * 4 + 20)


def trained_on_disk(seed: int, steps: int):
    """(the disk store factory, a module over it trained ``steps`` steps)."""
    factory = disk_store(tempfile.mkdtemp(), host_cache_bytes=host_bytes(OptimizerType.ADAM))
    trained = module(factory)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        step(trained, batch(gen))
    return factory, trained


@pytest.mark.parametrize("optimizer", list(OptimizerType))
@pytest.mark.parametrize("host_level", [False, True])
def test_tables_on_disk_train_bit_for_bit_as_over_host_memory(optimizer, host_level):
    directory = tempfile.mkdtemp()
    factory = disk_store(directory, host_cache_bytes=host_bytes(optimizer) if host_level else 0)
    on_disk, in_memory = module(factory, optimizer), module(None, optimizer)
    if host_level:
        assert all(isinstance(t.store, HostCachedStore) for t in on_disk.tables.values())
    gen = torch.Generator().manual_seed(11)
    for _ in range(25):
        kjt = batch(gen)
        a, b = step(on_disk, kjt), step(in_memory, kjt)
        for f in FEATURES:
            assert torch.equal(a[f].values(), b[f].values()), f
    assert_same_tables(on_disk, in_memory)
    stats = on_disk.stats()
    assert all(s["write_backs"] > 300 and s["loads"] > 100 for s in stats.values())
    if host_level:  # the host level filled and spilled to disk
        assert all(t.store.disk.size() > 0 for t in on_disk.tables.values())
    assert len(os.listdir(directory)) == 3
    del on_disk, a, b  # the outputs' autograd graph holds the module too
    import gc
    gc.collect()
    assert os.listdir(directory) == []  # a table's directory goes with it


@pytest.mark.parametrize("group_tables", [False, True])
def test_a_full_disk_mid_step_raises_and_leaves_every_table_as_it_was(group_tables):
    factory = disk_store(tempfile.mkdtemp(), host_cache_bytes=host_bytes(OptimizerType.ADAM))
    on_disk = module(factory, group_tables=group_tables)
    in_memory = module(None, group_tables=group_tables)
    gen = torch.Generator().manual_seed(5)
    for _ in range(6):  # the caches and host levels fill: the next step spills to disk
        kjt = batch(gen)
        step(on_disk, kjt), step(in_memory, kjt)
    full = on_disk.tables["t1"].store.disk
    write = full._write

    def no_space(*args, **kwargs):
        raise OSError(f"writing the disk store at {str(full.path)!r} failed, nothing was "
                      f"written: IO error: No space left on device")
    full._write = no_space
    kjt = batch(gen)
    with pytest.raises(OSError, match="No space left"):
        on_disk(kjt)
    assert not any(t.has_batches_in_flight() for t in on_disk.tables.values())
    assert all(t.tier.hash.pinned_count() == 0 for t in on_disk.tables.values())
    # t1 is as it was; the tables filled before it in the step keep that step's claim
    # (their evicted rows are safely in their stores), and nothing of any table is lost
    t1 = ("t1",)
    keys = torch.arange(VOCAB[1])
    before = in_memory.read_rows("t1", keys, with_state=True)
    after = on_disk.read_rows("t1", keys, with_state=True)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert in_memory.stats()["t1"] == on_disk.stats()["t1"]
    for x, y in zip(on_disk.tables["t1"].tier.hash.image(),
                    in_memory.tables["t1"].tier.hash.image()):
        assert torch.equal(x, y), t1
    full._write = write  # room again: training goes on
    step(on_disk, batch(gen))


@pytest.mark.parametrize("group_tables", [False, True])
def test_a_failed_store_read_mid_step_counts_nothing_and_the_retry_trains_as_a_twin(
        group_tables):
    factory = disk_store(tempfile.mkdtemp(), host_cache_bytes=host_bytes(OptimizerType.ADAM))
    on_disk = module(factory, group_tables=group_tables)
    in_memory = module(None, group_tables=group_tables)  # never sees the failed step
    gen = torch.Generator().manual_seed(5)
    for _ in range(6):  # the caches and host levels fill: the next step reads the disk
        kjt = batch(gen)
        step(on_disk, kjt), step(in_memory, kjt)
    disk = on_disk.tables["t0"].store.disk  # the first table filled: none keeps the step

    def corrupt(keys):  # as the store raises when RocksDB finds a corrupt block
        raise OSError(f"reading the disk store at {str(disk.path)!r} failed: Corruption: "
                      f"block checksum mismatch")
    disk.find = corrupt
    kjt = batch(gen)
    with pytest.raises(OSError, match="reading the disk store at .* failed: Corruption"):
        on_disk(kjt)
    assert not any(t.has_batches_in_flight() for t in on_disk.tables.values())
    del disk.find  # the disk reads again
    assert_same_tables(on_disk, in_memory)  # counters, rows, stores: as before the step
    # the same step again, then training goes on alike
    for _ in range(3):
        a, b = step(on_disk, kjt), step(in_memory, kjt)
        for f in FEATURES:
            assert torch.equal(a[f].values(), b[f].values()), f
        kjt = batch(gen)
    assert_same_tables(on_disk, in_memory)


@pytest.mark.parametrize("group_tables", [False, True])
def test_a_failed_store_read_in_eval_counts_nothing_and_ends_its_pins(group_tables):
    factory = disk_store(tempfile.mkdtemp(), host_cache_bytes=host_bytes(OptimizerType.ADAM))
    on_disk = module(factory, group_tables=group_tables)
    in_memory = module(None, group_tables=group_tables)
    gen = torch.Generator().manual_seed(7)
    for _ in range(6):
        kjt = batch(gen)
        step(on_disk, kjt), step(in_memory, kjt)
    on_disk.eval(), in_memory.eval()
    disk = on_disk.tables["t0"].store.disk

    def corrupt(keys):
        raise OSError(f"reading the disk store at {str(disk.path)!r} failed: Corruption")
    disk.find = corrupt
    kjt = batch(gen)
    with torch.no_grad(), pytest.raises(OSError, match="Corruption"):
        on_disk(kjt)
    del disk.find
    assert not any(t.has_batches_in_flight() for t in on_disk.tables.values())
    assert all(t.tier.hash.pinned_count() == 0 for t in on_disk.tables.values())
    assert_same_tables(on_disk, in_memory)
    with torch.no_grad():
        a, b = on_disk(kjt), in_memory(kjt)
    for f in FEATURES:
        assert torch.equal(a[f].values(), b[f].values()), f
    on_disk.train(), in_memory.train()
    step(on_disk, kjt), step(in_memory, kjt)
    assert_same_tables(on_disk, in_memory)


def test_dump_and_load_stream_a_disk_backed_module_and_training_goes_on_the_same():
    factory, trained = trained_on_disk(seed=3, steps=12)
    gen = torch.Generator().manual_seed(30)
    with pytest.raises(RuntimeError, match="dynemb.checkpoint.dump"):
        trained.state_dict()
    path = tempfile.mkdtemp()
    dump(trained, path)
    resumed, in_memory = module(factory), module(None)
    load(resumed, path), load(in_memory, path)
    for name, vocab in zip(trained.tables, VOCAB):
        keys = torch.arange(vocab)
        want = trained.read_rows(name, keys, with_state=True)
        for other in (resumed, in_memory):
            got = other.read_rows(name, keys, with_state=True)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
    for _ in range(5):
        kjt = batch(gen)
        a, b, c = step(trained, kjt), step(resumed, kjt), step(in_memory, kjt)
        for f in FEATURES:
            assert torch.equal(a[f].values(), b[f].values())
            assert torch.equal(a[f].values(), c[f].values())


KILLED = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, {tests!r})
    from test_disk_tables import batch, module, step
    from dynemb.stores.disk_levels import disk_store
    m = module(disk_store({directory!r}))
    gen = torch.Generator().manual_seed(1)
    for i in range(30):
        step(m, batch(gen))
        if i == 20:
            m.tables["t1"].store._db.flush()
    print(m.tables["t1"].store.path, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_store_left_by_a_killed_process_opens_again():
    directory = tempfile.mkdtemp()
    script = KILLED.format(tests=os.path.dirname(__file__), directory=directory)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    path = run.stdout.strip().splitlines()[-1]
    assert os.path.isdir(path)  # killed: nothing removed it
    width = DIM + OptimizerConfig(OptimizerType.ADAM).state_dim(DIM)
    facts = {"name": "t1", "dim": DIM, "optimizer": "ADAM", "width": width}
    store = DiskBackingStore(path, width, torch.float32, torch.device("cpu"), table=facts)
    keys, start, seen = [], 0, 0
    while start is not None:
        k, r, s, start = store.export(start, 100)
        seen += k.numel()
        keys.append(k)
    assert seen == store.size() > 0  # the row count and the rows agree
    found = store.find(torch.cat(keys))[1]
    assert bool(found.all())
    assert int(torch.cat(keys).max()) < VOCAB[1]


FLUSHED_THEN_KILLED = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, {tests!r})
    from test_disk_tables import VOCAB, batch, host_bytes, module, step
    from dynemb.stores.disk_levels import disk_store
    from dynemb.stores.disk_store import DiskOptions
    from dynemb.rows.optimizers import OptimizerType
    report, alive = {{}}, []  # a module freed removes its stores' directories
    for wal, host_level in ((True, True), (False, True), (False, False)):
        m = module(disk_store(os.path.join({directory!r}, f"{{wal}}-{{host_level}}"),
                              host_cache_bytes=host_bytes(OptimizerType.ADAM) * host_level,
                              options=DiskOptions(wal=wal)))
        alive.append(m)
        gen = torch.Generator().manual_seed(2)
        for _ in range(10):
            step(m, batch(gen))
        m.flush()
        for name, vocab in zip(m.tables, VOCAB):
            store = m.tables[name].store
            keys = torch.arange(vocab)
            rows, found = m.read_rows(name, keys, with_state=True)
            scores = store.find(keys[found])[2]
            host_rows = store.host.size() if host_level else 0
            disk = store.disk if host_level else store
            report[f"{{wal}}-{{host_level}}-{{name}}"] = (str(disk.path), keys[found],
                                                       rows[found], scores, host_rows)
    torch.save(report, os.path.join({directory!r}, "report.pt"))
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_after_a_flush_a_killed_process_leaves_the_latest_row_of_every_id_on_disk():
    # with the write-ahead log and a host level, with neither: every id a table trained
    # is on disk after a flush and a SIGKILL, its row and score those the module reported
    directory = tempfile.mkdtemp()
    script = FLUSHED_THEN_KILLED.format(tests=os.path.dirname(__file__), directory=directory)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    report = torch.load(os.path.join(directory, "report.pt"))
    assert len(report) == 9
    width = DIM + OptimizerConfig(OptimizerType.ADAM).state_dim(DIM)
    lost = {}
    for case, (path, keys, rows, scores, host_rows) in report.items():
        name = case.split("-")[-1]
        assert keys.numel() > CACHED[0] and (host_rows > 0) == ("True-t" in case), case
        facts = {"name": name, "dim": DIM, "optimizer": "ADAM", "width": width}
        store = DiskBackingStore(path, width, torch.float32, torch.device("cpu"), table=facts)
        got_rows, found, got_scores = store.find(keys)
        lost[case] = int((~found).sum())
        if not lost[case]:
            assert torch.equal(got_rows, rows) and torch.equal(got_scores, scores), case
            assert store.size() == keys.numel(), case
        store.close()
    assert lost == {case: 0 for case in report}


def test_a_relative_store_directory_keeps_working_after_a_chdir(tmp_path, monkeypatch):
    made, elsewhere = tmp_path / "made", tmp_path / "elsewhere"
    made.mkdir(), elsewhere.mkdir()
    monkeypatch.chdir(made)
    on_disk = module(disk_store("rel", host_cache_bytes=host_bytes(OptimizerType.ADAM)))
    in_memory = module(None)
    assert len(os.listdir(made / "rel")) == 3
    monkeypatch.chdir(elsewhere)
    gen = torch.Generator().manual_seed(8)
    for _ in range(6):
        kjt = batch(gen)
        step(on_disk, kjt), step(in_memory, kjt)
        on_disk.flush()  # RocksDB writes new files: where the store was made
        in_memory.flush()
    assert_same_tables(on_disk, in_memory)
    assert os.listdir(elsewhere) == []
    del on_disk, kjt
    import gc
    gc.collect()
    assert os.listdir(made / "rel") == []  # removed from where it was made


def test_tables_of_300_character_names_get_stores_and_checkpoint_files_of_their_own():
    # TorchRec takes any name; two that differ only at the end (past any cut of a file name)
    names = ["t" * 299 + "x", "t" * 299 + "y"]
    directory = tempfile.mkdtemp()
    configs = [EmbeddingConfig(name=n, embedding_dim=DIM, num_embeddings=400,
                               feature_names=[f"f{i}"]) for i, n in enumerate(names)]

    def long_named(factory):
        options = DynamicEmbTableOptions(caching=True, bucket_size=32, backing_store=factory,
                                         local_hbm_for_values=64 * DIM * 4)
        return DynamicEmbCollection(configs, table_options={n: options for n in names},
                                    optimizer=OptimizerConfig(OptimizerType.SGD, 0.1))
    on_disk, in_memory = long_named(disk_store(directory)), long_named(None)
    made = sorted(os.listdir(directory))
    assert len(made) == 2 and all(d.startswith("t" * 100) and len(d) < 128 for d in made)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.randint(0, 400, (96,),
                                                  generator=gen), torch.full((24,), 4))
        for m in (on_disk, in_memory):
            out = m(kjt)
            sum((out[f].values() ** 2).sum() for f in ("f0", "f1")).backward()
    for name in names:
        assert on_disk.tables[name].store._facts["table"]["name"] == name
        assert on_disk.tables[name].store.size() > 0
    path = tempfile.mkdtemp()
    dump(on_disk, path)
    resumed = long_named(None)
    load(resumed, path)
    keys = torch.arange(400)
    for name in names:
        want = in_memory.read_rows(name, keys, with_state=True)
        for m in (on_disk, resumed):
            got = m.read_rows(name, keys, with_state=True)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name


def test_the_planner_counts_device_host_and_disk_bytes_of_a_table_on_disk():
    from dynemb.planning.footprint import table_footprint
    config = EmbeddingConfig(name="big", embedding_dim=64, num_embeddings=1_000_000,
                             feature_names=["f"])
    optimizer = OptimizerConfig(OptimizerType.SGD)
    row_bytes = 64 * 4
    cache = 8192 * row_bytes
    in_memory = table_footprint(config, DynamicEmbTableOptions(
        caching=True, global_hbm_for_values=cache), optimizer, world_size=1)
    factory = disk_store(tempfile.mkdtemp(), host_cache_bytes=64 << 20)
    on_disk = table_footprint(config, DynamicEmbTableOptions(
        caching=True, global_hbm_for_values=cache, backing_store=factory), optimizer,
        world_size=1)
    host_rows, disk_rows, disk_bytes, rocksdb = factory.planned_levels(1_000_000, row_bytes)
    assert rocksdb == 2 * (64 << 20) + (64 << 20)  # two memtables and the block cache
    assert on_disk.device_rows == in_memory.device_rows == 8192
    assert on_disk.host_rows == host_rows and host_rows * (row_bytes + 20) <= 64 << 20
    assert on_disk.storage().ddr < (64 << 20) + rocksdb + 4096 < in_memory.storage().ddr
    assert on_disk.storage().ssd == disk_bytes >= disk_rows * (row_bytes + 8 + 9)
    assert on_disk.storage().hbm == in_memory.storage().hbm and in_memory.storage().ssd == 0


FULL_DISK = textwrap.dedent("""
    import resource, signal, sys, torch
    sys.path.insert(0, {tests!r})
    from test_disk_tables import CACHED, DIM, VOCAB, batch, step
    from dynemb import DynamicEmbCollection, DynamicEmbTableOptions
    from dynemb.stores.disk_levels import disk_store
    from dynemb.stores.disk_store import DiskOptions
    from dynemb.rows.optimizers import OptimizerConfig, OptimizerType
    from torchrec import EmbeddingConfig
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails, EFBIG
    config = EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=50_000,
                             feature_names=["f0", "f1", "f2"])
    store = disk_store({directory!r}, options=DiskOptions(wal=True, write_buffer_bytes=1 << 20))

    def build(store):
        return DynamicEmbCollection([config], table_options=DynamicEmbTableOptions(
            caching=True, bucket_size=32, backing_store=store,
            local_hbm_for_values=512 * 24 * 4),
            optimizer=OptimizerConfig(OptimizerType.ADAM, learning_rate=0.05))
    m, twin = build(store), build(None)  # the twin never sees the failed step
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIMIT_FSIZE))
    gen = torch.Generator().manual_seed(0)
    keys = torch.arange(50_000)

    def same(a, b):
        return (torch.equal(a[0][0], b[0][0]) and torch.equal(a[0][1], b[0][1]) and
                a[1] == b[1])

    def state(m):
        return m.read_rows("t", keys, with_state=True), m.stats()["t"]
    for i in range(300):
        kjt = batch(gen)
        before = state(m)
        try:
            step(m, kjt)
        except OSError as error:
            pins = m.tables["t"].tier.hash.pinned_count()
            print("FAILED AT", i, "UNCHANGED", same(before, state(m)), "PINS", pins, "|",
                  error, flush=True)
            break
        step(twin, kjt)
    else:
        print("NEVER FAILED")
    # room again: the store opens its database again, and trains on as its twin
    unlimited = resource.RLIM_INFINITY
    resource.setrlimit(resource.RLIMIT_FSIZE, (unlimited, unlimited))
    for _ in range(4):
        step(m, kjt), step(twin, kjt)
        kjt = batch(gen)
    print("RECOVERED", same(state(m), state(twin)), flush=True)
""").replace("resource.RLIMIT_FSIZE))", "resource.RLIM_INFINITY))")


def test_a_really_full_disk_raises_leaves_the_table_as_it_was_and_recovers_with_room():
    # a file-size limit makes RocksDB's writes fail as on a full disk (EFBIG, not ENOSPC);
    # with the limit lifted the store (write-ahead log on) trains on as a twin that never
    # saw the failed step
    script = FULL_DISK.format(tests=os.path.dirname(__file__), directory=tempfile.mkdtemp())
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    line, recovered = run.stdout.strip().splitlines()[-2:]
    assert line.startswith("FAILED AT") and "UNCHANGED True PINS 0" in line, line
    assert "writing the disk store" in line and "nothing was written" in line
    assert recovered == "RECOVERED True", run.stdout[-3000:] + run.stderr[-3000:]


def test_dump_and_load_move_a_disk_backed_table_a_chunk_at_a_time(monkeypatch):
    # never the whole table in memory: every read from the store and every write to it
    # during dump and load is at most one chunk
    factory, trained = trained_on_disk(seed=4, steps=10)
    stored = sum(t.store.size() for t in trained.tables.values())
    assert stored > 500
    sizes = {"export": [], "insert": []}
    for cls in (DiskBackingStore, HostCachedStore):
        export, insert = cls.export, cls.insert
        monkeypatch.setattr(cls, "export", lambda self, start, n, _f=export: (
            sizes["export"].append(n), _f(self, start, n))[1])
        monkeypatch.setattr(cls, "insert", lambda self, k, r, s, _f=insert: (
            sizes["insert"].append(k.numel()), _f(self, k, r, s))[1])
    path = tempfile.mkdtemp()
    dump(trained, path, chunk_rows=64)
    resumed = module(factory)
    load(resumed, path)
    assert max(sizes["export"]) == 64 and sum(sizes["insert"]) >= stored
    assert max(sizes["insert"]) <= 64
    for name, vocab in zip(trained.tables, VOCAB):
        keys = torch.arange(vocab)
        want, got = (m.read_rows(name, keys, with_state=True) for m in (trained, resumed))
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_memory_breakdown_counts_the_host_level_and_what_rocksdb_holds():
    _, on_disk = trained_on_disk(seed=6, steps=8)
    table = on_disk.tables["t1"]
    memory = table.memory_breakdown()
    rows, hash_bytes = table.store.host.nbytes()
    assert memory.host_values_bytes + memory.host_optimizer_bytes == rows
    assert memory.host_hash_bytes == hash_bytes
    rocksdb = table.store.memory_bytes()
    assert rocksdb > 0 and memory.host_other_bytes >= rocksdb
    assert rocksdb <= table.store.disk.options.memory_bytes() + (1 << 20)



def test_saving_or_copying_a_disk_backed_module_whole_refuses_and_names_dump():
    import copy
    import io
    on_disk = module(disk_store(tempfile.mkdtemp()))
    for attempt in (lambda: torch.save(on_disk, io.BytesIO()), lambda: copy.deepcopy(on_disk)):
        with pytest.raises(TypeError, match="dynemb.checkpoint.dump"):
            attempt()


def test_a_non_blocking_dump_of_a_table_on_disk_is_refused(tmp_path):
    m = module(disk_store(tempfile.mkdtemp()))
    step(m, batch(torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match=r"table 't0' keeps its rows on disk .* dump it with "
                                         r"blocking=True"):
        dump(m, tmp_path / "ckpt", blocking=False)
    assert not (tmp_path / "ckpt").exists()
    assert dump(m, tmp_path / "ckpt").rows > 0
