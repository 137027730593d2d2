"""The launches of a steady-state training step on the CUDA kernels (under the simulator
without a GPU), counted by ``benchmarks/step_census.py``: numba launches and the torch ops
that launch device work, host reads and host values, allocation shapes. They must not grow
with the number of tables, and must not grow past what this commit issues (lower the budgets as launches are fused; the GPU's own kernel
count, sorts included, comes from ``scripts/gpu_check.sh step``)."""
import argparse

import pytest

from conftest import BACKENDS

#: launches per step (torch ops + numba launches) at this commit, by workload
BUDGET = {"T1_82k_sgd": 30, "T26_sgd": 36, "T256_sgd": 36}
#: host reads and host values per step (a step that is to run without a host sync needs 0 of
#: each; the refused-key counts' host copy, made without waiting, is counted apart)
HOST_BUDGET = {"T1_82k_sgd": (0, 0), "T26_sgd": (0, 0), "T256_sgd": (0, 0)}


#: the workloads' scale under the simulator (every thread of a launch is a Python call):
#: the smallest at which each issues every launch of its step (one table: enough repeated
#: ids for the update's hot-row layout; counts that do not depend on the tables' sizes)
SCALE = {"T1_82k_sgd": 0.002, "T26_sgd": 0.0005, "T256_sgd": 0.0005}


@pytest.fixture(scope="module")
def census():
    from benchmarks.step_census import census_of
    return {name: census_of(name, argparse.Namespace(
        device=BACKENDS[1][1], backend="cuda", scale=SCALE[name], warmup=1, steps=2,
        batches=2, seed=0)) for name in BUDGET}


def launches(row) -> float:
    return row["torch_ops"] + row["numba_launches"]


def test_a_step_launches_no_more_than_its_budget(census):
    for name, row in census.items():
        assert launches(row) <= BUDGET[name], (name, row["torch_ops_by_op"],
                                               row["numba_by_kernel"])


def test_a_step_reads_back_and_sends_no_more_than_its_budget(census):
    for name, row in census.items():
        reads, values = HOST_BUDGET[name]
        assert row["host_reads"] <= reads, (name, row["host_reads_by_site"])
        assert row["host_values"] <= values, (name, row["host_values_by_site"])


def test_every_step_of_a_bucket_allocates_the_same_shapes(census):
    for name, row in census.items():
        first, *others = row["allocation_shapes_by_step"]
        assert first and all(shapes == first for shapes in others), name


def test_the_census_sees_a_host_read_and_a_host_value():
    """What a step does on the host is counted where dynemb does it, not elsewhere."""
    import torch
    from benchmarks.step_census import StepCensus
    from dynemb.backends.device_values import values_on
    t = torch.arange(4)
    with StepCensus() as census:
        values_on([1, 2], torch.int64, torch.device("cpu"))  # a host value, in dynemb
        t.tolist()                                           # a host read, here: not counted
        torch.zeros(3)
    row = census.report(1)
    assert row["host_values_by_site"] == {
        "tensor at backends/device_values.py:values_on": 1}
    assert row["host_reads"] == 0
    assert row["allocation_shapes"] == ["torch.float32[3]"]


def test_a_step_launches_as_much_for_256_tables_as_for_26(census):
    """One group: nothing is launched per table."""
    assert census["T256_sgd"]["torch_ops_by_op"] == census["T26_sgd"]["torch_ops_by_op"]
    assert census["T256_sgd"]["numba_by_kernel"] == census["T26_sgd"]["numba_by_kernel"]


def test_a_lone_table_steps_as_a_group_of_one(census):
    """A table alone launches the group's kernels, with one sort in its dedup."""
    kernels = census["T1_82k_sgd"]["numba_by_kernel"]
    assert {"lookup_update_group_kernel", "add_claim_counts_kernel"} <= set(kernels)
    dedup = "aten.sort at backends/cuda_backend.py:dedup_segments"
    assert census["T1_82k_sgd"]["torch_ops_by_op"][dedup] == 1
    assert census["T26_sgd"]["torch_ops_by_op"][dedup] == 2
