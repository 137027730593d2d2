"""Both backends implement the KernelBackend protocol, the hash table hands them one
TableArrays per allocation, and kernels are resolved once, by the object that owns the rest."""
import inspect

import pytest
import torch

from dynemb.backends import numba_backends as backends
from dynemb.backends.numba_backends import get_backend, resolve_kernels
from dynemb.stores.backing_store import HostBackingStore
from dynemb.rows.flat_table import FlatTable
from dynemb.rows.hash_table import ScoredHashTable
from dynemb.rows.initializers import Initializer
from dynemb.backends.protocol import KernelBackend, TableArrays
from dynemb.rows.optimizers import OptimizerConfig, OptimizerType
from dynemb.options import (DynamicEmbTableOptions, FrequencyAdmission, ShardingScheme,
                            choose_storage_mode)
from dynemb.sharding.routing import route_unique
from dynemb.tables import build_table
from dynemb.types import EMPTY_KEY
from table_builder import prefetch, rows_of, update

PROTOCOL_METHODS = [name for name, member in vars(KernelBackend).items()
                    if inspect.isfunction(member) and not name.startswith("_")]


@pytest.mark.parametrize("name", ["cpu", "cuda"])
def test_backends_satisfy_the_protocol(name):
    backend = get_backend(name)
    assert isinstance(backend, KernelBackend)
    assert backend.name == name and isinstance(backend.defers_failures, bool)
    for method in PROTOCOL_METHODS:
        want = list(inspect.signature(getattr(KernelBackend, method)).parameters)[1:]
        got = list(inspect.signature(getattr(backend, method)).parameters)
        assert got == want, f"{name}.{method}"


def test_protocol_lists_the_table_layer_methods():
    assert {"find", "lookup_update", "insert_missing", "erase", "add_refcounts", "export",
            "rehash", "dedup", "claim_summary", "fused_update", "round_rows"} <= set(
                PROTOCOL_METHODS)


def test_table_arrays_empty():
    arrays = TableArrays.empty(256, 64, torch.device("cpu"))
    assert (arrays.capacity, arrays.num_buckets, arrays.bucket_size) == (256, 4, 64)
    assert [t.dtype for t in arrays[:4]] == [torch.int64, torch.int64, torch.int32, torch.int64]
    assert bool((arrays.keys == EMPTY_KEY).all()) and int(arrays.size) == 0
    assert arrays.nbytes() == 256 * (8 + 8 + 4) + 8
    kept = TableArrays.empty(512, 64, torch.device("cpu"), size=arrays.size)
    assert kept.size is arrays.size and kept.num_buckets == 8


def test_growth_replaces_the_arrays_and_keeps_the_size_counter():
    table = ScoredHashTable(128, bucket_size=64)
    table.find_or_insert(torch.arange(1, 51))
    before = table._arrays
    remap = table.grow(256)
    after = table._arrays
    assert after is not before and after.size is before.size
    assert (after.capacity, after.num_buckets) == (256, 4)
    assert table.size() == 50 and int((remap >= 0).sum()) == 50
    assert bool((table.find(torch.arange(1, 51)) >= 0).all())


def test_resolve_kernels_passes_resolved_kernels_down_as_they_are():
    cpu = get_backend("cpu")
    assert resolve_kernels(torch.device("cpu")) is cpu
    assert resolve_kernels(torch.device("cpu"), "cpu") is cpu
    # given kernels were resolved (and checked) by their owner: not resolved again
    assert resolve_kernels(torch.device("meta"), kernels=cpu) is cpu
    assert resolve_kernels(torch.device("cpu"), "cpu", kernels=cpu) is cpu
    with pytest.raises(ValueError, match="backend 'cuda' contradicts the 'cpu' kernels"):
        resolve_kernels(torch.device("cpu"), "cuda", kernels=cpu)


@pytest.fixture
def resolutions(monkeypatch):
    """The backend names resolved from now on (every resolution goes through get_backend)."""
    names = []
    original = backends.get_backend

    def counting(name):
        names.append(name)
        return original(name)

    monkeypatch.setattr(backends, "get_backend", counting)
    return names


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_table_resolves_its_kernels_once_and_hands_them_down(backend, resolutions, dtype):
    name, device = backend
    options = DynamicEmbTableOptions(admission=FrequencyAdmission(threshold=1),
                                     initializer=Initializer(), stochastic_rounding=False)
    sgd = OptimizerConfig(OptimizerType.SGD, learning_rate=0.5)
    layout = choose_storage_mode(options, name="t", num_embeddings=64, width=4,
                                 config_dtype=dtype)
    table = build_table("t", 1, 4, layout, options, sgd, torch.device(device), name)
    assert resolutions == [name]
    kernels = table.kernels
    assert kernels is get_backend(name)
    for user in (table.tier, table.tier.hash, table.tier.flat, table.admission.table):
        assert user.kernels is kernels
    # a training step and an eval lookup of an unseen key: dedup, admission, claims,
    # initial rows, the optimizer (and rounding for float16) all run on the table's kernels
    batch = prefetch(table, torch.tensor([3, 5, 3], device=device))
    rows_of(batch)
    update(table, batch, torch.ones(batch.keys.numel(), 4, device=device), lr=0.5, step=1)
    rows_of(prefetch(table, torch.tensor([5, 8], device=device), training=False))
    assert resolutions == [name]


def test_standalone_objects_resolve_their_backend_once(backend, resolutions):
    name, device = backend
    table = ScoredHashTable(256, device=device, backend=name)
    flat = FlatTable(256, dim=2, optimizer_state_dim=1, device=device, backend=name)
    assert resolutions == [name, name] and table.kernels is flat.kernels is get_backend(name)
    slots = table.find_or_insert(torch.tensor([4, 6], device=device)).slots
    flat.initialize(slots, torch.tensor([4, 6], device=device), Initializer(), seed=0,
                    table_id=0)
    assert table.find(torch.tensor([6], device=device)).tolist() == slots[1:].tolist()
    assert resolutions == [name, name]


def test_a_store_and_the_routing_resolve_once_for_all_their_parts(resolutions):
    store = HostBackingStore(width=2, dtype=torch.float32, device=torch.device("cpu"))
    assert resolutions == ["cpu"]
    assert store.hash_table.kernels is store.row_table.kernels is get_backend("cpu")
    ids = [torch.tensor([1, 2, 1]), torch.tensor([7]), torch.tensor([4, 4])]
    route_unique(ids, [ShardingScheme.MOD] * 3, 2, [("a", 3), ("b", 1), ("c", 2)])
    assert resolutions == ["cpu", "cpu"]
