"""dynemb's thread defaults (:mod:`dynemb.backends.threads`): the idle OpenMP team, numba's thread
count, and the user's overrides."""
import os
import subprocess
import sys
from pathlib import Path

import numba
import pytest

from dynemb.backends.threads import (apply_defaults, available_cores, default_numba_threads,
                            idle_team_wanted)

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("cores, expected", [(1, 1), (2, 1), (3, 2), (16, 15)])
def test_numba_gets_one_core_less_than_the_process_while_idle_threads_spin(cores, expected):
    assert default_numba_threads(environ={}, cores=cores) == expected


@pytest.mark.parametrize("cores", [1, 2, 16])
def test_numba_keeps_every_core_once_idle_threads_sleep(cores):
    assert default_numba_threads(environ={}, cores=cores, idle_threads_sleep=True) is None


@pytest.mark.parametrize("environ, wanted", [
    ({}, True), ({"NUMBA_NUM_THREADS": "2"}, True), ({"OMP_NUM_THREADS": "1"}, True),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, False), ({"OMP_WAIT_POLICY": "active"}, False),
    ({"GOMP_SPINCOUNT": "10000"}, False), ({"DYNEMB_THREADS": "off"}, False)])
def test_the_idle_team_steps_aside_for_the_users_wait_settings(environ, wanted):
    assert idle_team_wanted(environ) is wanted


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
    spinning = {"OMP_WAIT_POLICY": "ACTIVE"}  # no idle team in this process: the cap applies
    numba.set_num_threads(2)
    assert apply_defaults(environ=spinning, cores=2) == 1
    assert numba.get_num_threads() == 1
    assert apply_defaults(environ=spinning, cores=8) is None  # 7 would raise it: left at 1
    assert numba.get_num_threads() == 1
    numba.set_num_threads(2)
    assert apply_defaults(environ={"DYNEMB_THREADS": "off"}, cores=2) is None
    assert numba.get_num_threads() == 2


_SCRIPT = """
import threading
import numba, torch
from torchrec import EmbeddingConfig, KeyedJaggedTensor
from dynemb import DynamicEmbCollection
ec = DynamicEmbCollection([EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=64,
                                           feature_names=["f"])])
ec(KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([3, 4]), torch.tensor([2])))
parked = any(t.name == "dynemb-idle-openmp-team" for t in threading.enumerate())
print(numba.get_num_threads(), torch.get_num_threads(), int(parked))
"""
_VARIABLES = ("NUMBA_NUM_THREADS", "DYNEMB_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
              "OMP_NUM_THREADS")


def _threads_in_a_plain_script(**env):
    """(numba threads, torch threads, idle team parked) after a plain script built a table
    and ran a batch."""
    environ = {k: v for k, v in os.environ.items() if k not in _VARIABLES}
    environ.update(env)
    out = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=environ,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    numba_threads, torch_threads, parked = map(int, out.stdout.split()[-3:])
    return numba_threads, torch_threads, bool(parked)


@pytest.mark.skipif(available_cores() < 2, reason="needs 2 cores")
def test_a_plain_script_shares_every_core_with_idle_threads_asleep():
    cores = available_cores()
    assert _threads_in_a_plain_script() == (cores, cores, True)


@pytest.mark.skipif(available_cores() < 2, reason="needs 2 cores")
def test_the_users_variables_win_in_a_plain_script():
    cores = available_cores()
    assert _threads_in_a_plain_script(OMP_WAIT_POLICY="ACTIVE") == (cores - 1, cores, False)
    assert _threads_in_a_plain_script(OMP_WAIT_POLICY="PASSIVE") == (cores, cores, False)
    assert _threads_in_a_plain_script(NUMBA_NUM_THREADS="1") == (1, cores, True)
    assert _threads_in_a_plain_script(DYNEMB_THREADS="off") == (cores, cores, False)


@pytest.mark.skipif(available_cores() < 2, reason="needs 2 cores")
def test_a_script_with_one_torch_thread_keeps_it_and_the_numba_cap():
    # numba's pool start set OpenMP's count to numba's, and torch followed it (it ran on
    # every core); one torch thread forms no team to park, so numba's cap stays
    cores = available_cores()
    assert _threads_in_a_plain_script(OMP_NUM_THREADS="1") == (cores - 1, 1, False)
