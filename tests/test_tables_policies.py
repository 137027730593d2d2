"""Storage policies (dynemb/tables/policies.py) against the tables they describe, and the
allocation errors they word, one per storage mode."""
from __future__ import annotations

import pytest
import torch

from dynemb import DynamicEmbTableOptions, OptimizerConfig, StorageMode
from dynemb.rows.hash_table import SLOT_BYTES
from dynemb.options import choose_storage_mode
from dynemb.tables import build_table
from dynemb.tables.grouping import GROUPED_MODES
from dynemb.tables.policies import POLICIES, EvictedRows, NewRows, storage_policy
import dynemb.tables.allocation_checks as allocation_checks

DIM = 8
ROW_BYTES = DIM * 4  # float32, SGD: no optimizer state

#: Options that lead to each mode for 1000 ids of dim 8 (256 device rows where there is a
#: budget).
OPTIONS = {
    StorageMode.HBM_DIRECT: DynamicEmbTableOptions(max_capacity=1024, init_capacity=256),
    StorageMode.CACHE: DynamicEmbTableOptions(caching=True, global_hbm_for_values=256 * 32),
    StorageMode.DEFAULT: DynamicEmbTableOptions(global_hbm_for_values=256 * 32),
    StorageMode.HOST_ONLY: DynamicEmbTableOptions(local_hbm_for_values=0, max_capacity=512),
}


def layout_of(mode: StorageMode):
    layout = choose_storage_mode(OPTIONS[mode], name="t", num_embeddings=1000, width=DIM,
                                 config_dtype=torch.float32)
    assert layout.mode is mode
    return layout


def test_every_storage_mode_has_one_policy_whose_table_class_stores_it():
    assert set(POLICIES) == set(StorageMode)
    for mode in StorageMode:
        policy = storage_policy(mode)
        assert policy.mode is mode and policy.table_class.mode is mode
    assert set(GROUPED_MODES) == set(StorageMode)  # (on CUDA not DEFAULT nor HOST_ONLY)
    cache = storage_policy(StorageMode.CACHE)
    assert (cache.new_rows, cache.evicted_rows, cache.backing_store) == (
        NewRows.STORE_LOAD, EvictedRows.WRITTEN_BACK, True)
    assert not any(storage_policy(mode).backing_store for mode in StorageMode
                   if mode is not StorageMode.CACHE)


@pytest.mark.parametrize("mode", list(StorageMode), ids=lambda m: m.name)
def test_the_rows_a_policy_allocates_up_front_are_the_built_tables(mode):
    """Device rows and hash slots, read off the built table's tensors; host rows too, but
    for a backing store (it starts small and grows: not counted up front)."""
    layout = layout_of(mode)
    policy = storage_policy(mode)
    table = build_table("t", 0, DIM, layout, OPTIONS[mode], OptimizerConfig(),
                        torch.device("cpu"))
    memory = table.memory_breakdown()
    assert memory.values_bytes == policy.upfront_device_rows(layout) * ROW_BYTES
    device_slots = policy.upfront_device_rows(layout)
    assert memory.hash_bytes == (device_slots * SLOT_BYTES + 8 if device_slots else 0)
    if not policy.backing_store:
        assert memory.host_values_bytes == policy.upfront_host_rows(layout) * ROW_BYTES
    assert (policy.upfront_device_rows(layout), policy.upfront_host_rows(layout)) == {
        StorageMode.HBM_DIRECT: (256, 0), StorageMode.CACHE: (256, 0),
        StorageMode.DEFAULT: (256, 1408), StorageMode.HOST_ONLY: (0, 512)}[mode]


#: The error of each mode when host memory is 8 KiB (every table's rows exceed it); a row
#: and its hash slot take 32 + 20 bytes.
ERRORS = {
    StorageMode.HBM_DIRECT: (
        "table 't': the 256 rows allocated up front (init_capacity) need 13 KiB on cpu, "
        "which has 8 KiB; set init_capacity to start smaller (the table grows up to "
        "max_capacity=1024 as rows arrive), or a memory budget (local_hbm_for_values / "
        "global_hbm_for_values) with caching=True to keep only the hot rows on the device (a "
        "backing store that grows as rows arrive holds the rest)"),
    StorageMode.CACHE: (
        "table 't': the 256 device rows of the memory budget need 13 KiB on cpu, which has "
        "8 KiB; lower the memory budget (local_hbm_for_values / global_hbm_for_values)"),
    StorageMode.DEFAULT: (
        "table 't': the 256 device rows of the memory budget and the 1408 rows of the host "
        "tier, allocated up front, need 84.5 KiB on cpu, which has 8 KiB; with "
        "caching=False the host tier holds max_capacity minus the device rows from the start: "
        "lower max_capacity, or set caching=True (its backing store grows as rows arrive)"),
    StorageMode.HOST_ONLY: (
        "table 't': the 512 host rows of max_capacity, allocated up front, need 26 KiB on "
        "cpu, which has 8 KiB; lower max_capacity (a HOST_ONLY table holds all of it in "
        "host memory)"),
}


@pytest.mark.parametrize("mode", list(StorageMode), ids=lambda m: m.name)
def test_an_allocation_beyond_memory_is_worded_by_the_mode(mode, monkeypatch):
    monkeypatch.setattr(allocation_checks, "total_memory", lambda device: 8 << 10)
    with pytest.raises(ValueError) as err:
        allocation_checks.check_allocation(layout_of(mode), OPTIONS[mode], name="t",
                                           device=torch.device("cpu"))
    assert str(err.value) == ERRORS[mode]
