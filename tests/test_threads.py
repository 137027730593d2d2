"""dynemb's default numba thread count (:mod:`dynemb.foundations.threads`) and the user's overrides."""
import os
import subprocess
import sys
from pathlib import Path

import numba
import pytest

from dynemb.foundations.threads import apply_defaults, available_cores, default_numba_threads

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("cores, expected", [(1, 1), (2, 1), (3, 2), (16, 15)])
def test_numba_gets_one_core_less_than_the_process(cores, expected):
    assert default_numba_threads(environ={}, cores=cores) == expected


@pytest.mark.parametrize("environ", [{"NUMBA_NUM_THREADS": "2"}, {"DYNEMB_THREADS": "off"},
                                     {"DYNEMB_THREADS": "OFF", "NUMBA_NUM_THREADS": "1"},
                                     {"OMP_WAIT_POLICY": "passive"}])
def test_the_users_settings_leave_numba_alone(environ):
    assert default_numba_threads(environ=environ, cores=16) is None


def test_an_active_wait_policy_keeps_the_cap():
    assert default_numba_threads(environ={"OMP_WAIT_POLICY": "ACTIVE"}, cores=4) == 3


@pytest.fixture
def numba_threads():
    before = numba.get_num_threads()
    yield before
    numba.set_num_threads(before)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 numba threads")
def test_apply_caps_the_calling_thread_and_never_raises_it(numba_threads):
    numba.set_num_threads(2)
    assert apply_defaults(environ={}, cores=2) == 1
    assert numba.get_num_threads() == 1
    assert apply_defaults(environ={}, cores=8) is None  # 7 would raise it: left at 1
    assert numba.get_num_threads() == 1
    numba.set_num_threads(2)
    assert apply_defaults(environ={"DYNEMB_THREADS": "off"}, cores=2) is None
    assert numba.get_num_threads() == 2


_SCRIPT = """
import numba, torch
from torchrec import EmbeddingConfig, KeyedJaggedTensor
from dynemb import DynamicEmbCollection
ec = DynamicEmbCollection([EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=64,
                                           feature_names=["f"])])
ec(KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([3, 4]), torch.tensor([2])))
print(numba.get_num_threads())
"""


def _threads_in_a_plain_script(**env) -> int:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("NUMBA_NUM_THREADS", "DYNEMB_THREADS", "OMP_WAIT_POLICY")}
    environ.update(env)
    out = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=environ,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(available_cores() < 2, reason="needs 2 cores")
def test_a_plain_script_gets_the_default_and_the_users_variables_win():
    cores = available_cores()
    assert _threads_in_a_plain_script() == cores - 1
    assert _threads_in_a_plain_script(NUMBA_NUM_THREADS=str(cores)) == cores
