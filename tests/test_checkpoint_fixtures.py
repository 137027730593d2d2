"""Checkpoints written by an earlier commit still load: a ``state_dict`` (layout format 2), a
``torch.distributed.checkpoint`` directory and checkpoint files (a full dump and a delta,
format version 2), written at 84785c9 by ``tests/data/make_checkpoint_fixtures.py``, load
into a fresh module, on each backend, giving back the rows with their optimizer state, the
stats (what ``stats()`` reports since, at 0), steps and learning rate that code recorded
beside them; training goes on as it did there. A copy of the dump whose manifest names an unknown format version is refused naming
it."""
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import BACKENDS
from dynemb.checkpoint import DynamicEmbLoadPlanner, load
from dynemb.checkpoint.files import CHECKSUM_FIELD, CheckpointFileError, manifest_checksum
from tests.data.make_checkpoint_fixtures import (STEPS_BEFORE_SAVE, TABLES, make, snapshot,
                                                 train_step)

FIXTURES = Path(__file__).parent / "data" / "checkpoint_fixtures"
BACKEND_IDS = [b for b, _ in BACKENDS]


@pytest.fixture(scope="module")
def expected():
    return torch.load(FIXTURES / "expected.pt", weights_only=True)


def assert_as_recorded(module, recorded, exact=True):
    """``exact``: bit for bit; else rows to float32 rounding (the CUDA kernels' Adam update
    rounds otherwise than the CPU kernels that recorded them)."""
    got = snapshot(module)
    for name in TABLES:
        (rows, found), (want_rows, want_found) = got["rows"][name], recorded["rows"][name]
        assert torch.equal(found, want_found), name
        if exact:
            assert torch.equal(rows, want_rows), name
        else:
            torch.testing.assert_close(rows, want_rows, rtol=1e-6, atol=1e-7, msg=name)
    assert got["steps"] == recorded["steps"]
    for name, want in recorded["stats"].items():  # what stats() reports since: 0
        have = got["stats"][name]
        assert {k: have[k] for k in want} == want, name
        assert all(have[k] == 0 for k in set(have) - set(want)), name


def fresh(backend):
    name, device = backend
    return make(backend=name, device=torch.device(device))


def load_dcp(module, path, planner):
    state = {"model": module.state_dict(), "optim": module.fused_optimizer.state_dict()}
    with warnings.catch_warnings():  # one process: DCP says it assumes so
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(path), **planner)
    module.load_state_dict(state["model"])
    module.fused_optimizer.load_state_dict(state["optim"])


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("how", ["state_dict", "dcp", "dcp_default_planner", "dump"])
def test_a_checkpoint_of_an_earlier_commit_loads_and_trains_on_as_it_did(how, backend,
                                                                        expected):
    module = fresh(backend)
    if how == "state_dict":
        module.load_state_dict(torch.load(FIXTURES / "state_dict.pt", weights_only=True))
    elif how == "dump":
        load(module, FIXTURES / "dump_full")
    else:
        planner = {"planner": DynamicEmbLoadPlanner()} if how == "dcp" else {}
        load_dcp(module, FIXTURES / "dcp", planner)
    assert_as_recorded(module, expected["saved"])
    if how.startswith("dcp"):  # the fused optimizer's state was saved beside the tables
        assert module.fused_optimizer.lr == expected["lr"]
    else:  # a module's state_dict and its dumps hold no lr
        module.fused_optimizer.param_groups[0]["lr"] = expected["lr"]
    outputs = train_step(module, STEPS_BEFORE_SAVE)
    assert outputs.keys() == expected["next_outputs"].keys()
    for feature, values in expected["next_outputs"].items():
        assert torch.equal(outputs[feature], values), feature
    assert_as_recorded(module, expected["after"], exact=backend[0] == "cpu")


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_a_full_dump_and_its_delta_of_an_earlier_commit_load(backend, expected):
    module = fresh(backend)
    load(module, [FIXTURES / "dump_full", FIXTURES / "dump_delta"])
    assert_as_recorded(module, expected["after"])


def test_a_dump_of_an_unknown_format_version_is_refused_naming_it(tmp_path, expected):
    copy = tmp_path / "dump"
    shutil.copytree(FIXTURES / "dump_full", copy)
    path = copy / "rank0_of_1" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["format_version"] = 3
    manifest[CHECKSUM_FIELD] = manifest_checksum(manifest)
    path.write_text(json.dumps(manifest))
    module = make()
    before = snapshot(module)
    with pytest.raises(CheckpointFileError, match=r"format version 3, this dynemb reads "
                                                  r"version 2"):
        load(module, copy)
    after = snapshot(module)
    assert after["stats"] == before["stats"] and after["steps"] == before["steps"]
    assert not any(after["rows"][name][1].any() for name in TABLES)
