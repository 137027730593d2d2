"""Models and comparisons for the checkpoint-file tests: the models of checkpoint_models with
capacities small enough that every kind of row movement happens (HBM_DIRECT and DEFAULT
evict, CACHE writes back and, with a small store, the store evicts), and the state of a
module as a value that can be kept and compared (every tier's live keys, scores and rows,
the clocks, the steps and the counters)."""
import dataclasses

import torch
from torchrec import EmbeddingConfig

from checkpoint_models import DIM, OPTIMIZERS, options
from dynemb import DynamicEmbCollection, ScorePolicy, StorageMode
from dynemb.stores.backing_store import HostBackingStore
from dynemb.types import EMPTY_KEY, TOMBSTONE_KEY
from dynemb.rows.flat_table import RowLayout

ALL_IDS = torch.arange(600) * 7919 - 1000


def small_store(width, dtype, device):
    """A CACHE backing store that fills up (and evicts) on the test workload."""
    return HostBackingStore(width, dtype, device, initial_capacity=16, max_capacity=32)


def make(mode="hbm_direct", optimizer="sgd", *, policy=ScorePolicy.LRU, admission=False,
         evicting=False, store_evicts=False, dtype=None, backend=None, device=None,
         **overrides):
    """A two-table collection; ``evicting``: too small for the ids of the workload;
    ``store_evicts``: a CACHE store of 32 slots; ``backend`` "cuda": the CUDA kernels (under
    numba's simulator without a GPU), on ``device`` (None: the CPU)."""
    opt = OPTIMIZERS[optimizer]
    table_options = options(mode, opt, policy, admission, dtype)
    if evicting:  # 32 device rows (HBM_DIRECT: growing to 64); DEFAULT: 96 in all
        row_bytes = RowLayout(DIM, opt.state_dim(DIM), dtype or torch.float32).row_bytes
        extra = (dict(init_capacity=32, max_capacity=64) if mode == "hbm_direct" else
                 dict(max_capacity=64) if mode == "host_only" else
                 dict(global_hbm_for_values=32 * row_bytes))
        if mode == "default":
            extra["max_capacity"] = 96
        overrides = {**extra, **overrides}
    if store_evicts:
        overrides["backing_store"] = small_store
    table_options = dataclasses.replace(table_options, **overrides)
    configs = [EmbeddingConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=1024,
                               feature_names=[f"f{i}"]) for i in range(2)]
    ec = DynamicEmbCollection(configs, table_options=table_options, optimizer=opt,
                              backend=backend, device=device)
    assert set(ec.storage_modes().values()) == {StorageMode(mode)}
    return ec


def table_state(table, step):
    """Everything a checkpoint must give back of one table, as copies."""
    out = {"step": step, "counters": table.counters.snapshot()}
    for name, part in table.checkpoint_tiers().items():
        if part.hash is None:  # a user store: see logical_rows
            continue
        keys, scores = part.hash.image()
        live = (keys != EMPTY_KEY) & (keys != TOMBSTONE_KEY)
        k = keys[live]
        order = torch.argsort(k)
        out[name] = {"keys": k[order], "scores": scores[live][order], "clock": part.hash.clock}
        if part.rows is not None:
            # bytes: half rows hold float32 optimizer state, which may read as NaN
            out[name]["rows"] = part.rows[live][order].contiguous().view(torch.uint8)
    return out


def module_state(ec):
    return {name: table_state(t, ec.steps[name]) for name, t in ec.tables.items()}


def assert_same_state(got, expected):
    assert got.keys() == expected.keys()
    for name in expected:
        g, e = got[name], expected[name]
        assert g.keys() == e.keys(), name
        for field in e:
            if isinstance(e[field], dict):
                for k in e[field]:
                    a, b = g[field][k], e[field][k]
                    same = torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b
                    assert same, f"table {name}, tier {field}: {k} differs"
            else:
                assert g[field] == e[field], f"table {name}: {field} differs"


def logical_rows(ec):
    """Every id's current row and optimizer state (wherever it lives) and whether stored."""
    return {name: ec.read_rows(name, ALL_IDS, with_state=True) for name in ec.tables}


def assert_same_rows(a, b):
    for name in a:
        assert torch.equal(a[name][1], b[name][1]), name
        assert torch.equal(a[name][0], b[name][0]), name


def signed(manifest):
    """``manifest`` with its checksum computed as the format documents it (sha256 of the
    manifest without the field, as JSON with sorted keys and no whitespace), written
    independently of the library's own function."""
    import hashlib
    import json
    rest = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return {**rest, "manifest_sha256": hashlib.sha256(text.encode()).hexdigest()}


def edit_manifest(rank_dir, edit, *, sign=True):
    """Apply ``edit`` to the manifest of ``rank_dir`` in place and write it back, signed
    again unless ``sign`` is False (an edit the checksum must catch)."""
    import json
    path = rank_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(signed(manifest) if sign else manifest, indent=1))
    return manifest
