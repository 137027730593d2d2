"""Any pytest invocation of one test file behaves as the suite does.

The suite runs under xdist, whose workers inherit the environment the controller's conftest
set; a contributor running one file in one process must get the same backends. These runs
start from a clean environment (no ``NUMBA_ENABLE_CUDASIM`` inherited from this process), so
the CUDA tests pass only if the conftest chooses numba's simulator in time.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def run_pytest(*args, cwd):
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMBA_ENABLE_CUDASIM", "PYTEST_XDIST_WORKER", "PYTEST_CURRENT_TEST")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the runs choose the real GPU there")
@pytest.mark.parametrize("where", ["repository", "tests"])
def test_one_cuda_simulator_file_in_one_process(where):
    cwd = REPO if where == "repository" else REPO / "tests"
    target = "tests/test_hash_table.py" if where == "repository" else "test_hash_table.py"
    done = run_pytest("-n", "0", target, "-k", "cuda and (duplicates or pinned)", cwd=cwd)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "3 passed" in done.stdout, done.stdout[-3000:]
