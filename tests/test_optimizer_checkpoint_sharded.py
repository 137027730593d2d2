"""The learning rate survives a checkpoint of a sharded model: DMP with dynamic tables, a
TorchRec table and a dense layer, DMP's ``fused_optimizer`` in a CombinedOptimizer with a
dense SGD, an LR scheduler, saved with ``torch.distributed.checkpoint`` on 2 spawned ranks and
loaded into a freshly built model: every step after the load runs at the lr of the
uninterrupted run (the scheduler's closed form) with its losses and rows (see
tests/optimizer_checkpoint_worker.py)."""
import numpy as np
import pytest

from examples.spawn import run_on_ranks
from tests.optimizer_checkpoint_worker import run

WORLD, STEPS_BEFORE, STEPS_AFTER = 2, 3, 3
BASE_LR = 0.02  # the dynamic tables' (tests/checkpoint_dcp_worker.py)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """scenario -> (uninterrupted, resumed): rank 0's results."""
    root = tmp_path_factory.mktemp("lr")
    scenarios = ("dynamic", "all")
    jobs = []
    for scenario in scenarios:
        path = str(root / scenario)
        jobs += [("save_and_continue", (scenario, path, STEPS_BEFORE, STEPS_AFTER)),
                 ("load_and_continue", (scenario, path, STEPS_BEFORE, STEPS_AFTER))]
    (rank0, _) = run_on_ranks(WORLD, run, jobs, timeout=600)
    return {s: (rank0[2 * i], rank0[2 * i + 1]) for i, s in enumerate(scenarios)}


def _same_continuation(uninterrupted, resumed):
    np.testing.assert_allclose(resumed["losses"], uninterrupted["losses"], rtol=1e-6)
    for name, (rows, count) in uninterrupted["rows"].items():
        np.testing.assert_array_equal(resumed["rows"][name][1], count)
        np.testing.assert_allclose(resumed["rows"][name][0], rows, rtol=1e-6, atol=1e-7)


def test_a_schedule_of_the_dynamic_tables_resumes_with_torchrecs_defaults(runs):
    uninterrupted, resumed = runs["dynamic"]
    dynamic_lrs = [lrs[0] for lrs in resumed["lrs"]]  # the first group: "sparse.dyn"
    expected = [BASE_LR * 0.5 ** (k // 2) for k in range(STEPS_BEFORE, STEPS_BEFORE + 3)]
    assert dynamic_lrs == pytest.approx(expected, rel=1e-12)
    assert resumed["lrs"] == uninterrupted["lrs"]
    _same_continuation(uninterrupted, resumed)


def test_a_schedule_of_the_whole_combined_optimizer_resumes_with_save_param_groups(runs):
    uninterrupted, resumed = runs["all"]
    # dynamic tables, TorchRec table, dense SGD: base lrs 0.02, 0.05, 0.01 over 1 + step
    expected = [[base / (1 + k) for base in (BASE_LR, 0.05, 0.01)]
                for k in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)]
    assert resumed["lrs"] == uninterrupted["lrs"]
    np.testing.assert_allclose(resumed["lrs"], expected, rtol=1e-7)  # fbgemm's lr: float32
    _same_continuation(uninterrupted, resumed)
