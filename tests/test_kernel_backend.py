"""Both backends implement the KernelBackend protocol, and the hash table hands them one
TableArrays per allocation."""
import inspect

import pytest
import torch

from dynemb import ScoredHashTable
from dynemb.backends import get_backend
from dynemb.kernel_backend import KernelBackend, TableArrays
from dynemb.types import EMPTY_KEY

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
