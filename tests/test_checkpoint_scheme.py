"""A checkpoint saved under one ``ShardingScheme`` loaded into a model sharded under the other,
on 2 spawned gloo ranks, with ``load_state_dict`` and with ``torch.distributed.checkpoint``
(see tests/checkpoint_scheme_worker.py): every key is sent to its owner under the loading
model's scheme, with its trained row and optimizer state, and eval outputs are those of the
trained model. A state dict or DCP checkpoint whose signatures end before the scheme (which
no format-2 save writes) is refused naming them; checkpoint files of another scheme are
refused, naming both."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import DynamicEmbCollection, DynamicEmbTableOptions, ShardingScheme

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the worker

from examples.spawn import run_on_ranks  # noqa: E402
from checkpoint_scheme_worker import run  # noqa: E402

WORLD = 2


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_on_ranks(WORLD, run, str(tmp_path_factory.mktemp("scheme")), timeout=600)


def _check_load(world, case, trained_scheme):
    for rank, ranks_out in enumerate(world):
        got = ranks_out[case]
        assert "error" not in got, got["error"]
        trained = ranks_out[("trained", trained_scheme)]
        assert got["strays"] == 0, f"{got['strays']} keys on ranks that do not own them"
        for name, (rows, count) in trained["rows"].items():
            got_rows, got_count = got["rows"][name]
            np.testing.assert_array_equal(got_count, count, err_msg=name)
            np.testing.assert_array_equal(got_rows, rows, err_msg=name)
        for feature, values in trained["eval"].items():
            np.testing.assert_array_equal(got["eval"][feature], values, err_msg=feature)
    assert world[0][("trained", trained_scheme)]["rows"]["t1"][1].sum() > 20  # trained keys
    # some of t1's rows sit in its backing store, the rest in its cache
    assert any(r[("trained", trained_scheme)]["stats"]["t1"]["rows_backing"] for r in world)


@pytest.mark.parametrize("how", ["load_state_dict", "dcp", "dcp_default"])
@pytest.mark.parametrize("saved,loaded", [("hash", "mod"), ("mod", "hash")])
def test_every_key_is_sent_to_its_owner_under_the_loading_scheme(world, saved, loaded, how):
    _check_load(world, (saved, loaded, how), saved)


@pytest.mark.parametrize("saved,loaded", [("hash", "mod"), ("mod", "hash")])
def test_checkpoint_files_of_another_scheme_are_refused_naming_both(world, saved, loaded):
    for ranks_out in world:
        got = ranks_out[(saved, loaded, "files")]
        assert got["error"] is not None and got["error"].startswith("CheckpointFileError"), got
        assert f"placed by ShardingScheme.{saved.upper()}" in got["error"], got["error"]
        assert f"shards by ShardingScheme.{loaded.upper()}" in got["error"], got["error"]
        assert "torch.distributed.checkpoint" in got["error"], got["error"]
        assert got["held"] == 0  # the fresh model is unchanged


def _trained_unsharded():
    ec = DynamicEmbCollection([EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=64,
                                               feature_names=["f"])])
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([5, 6, 9]),
                                              torch.tensor([3]))
    ec(kjt)["f"].values().sum().backward()
    return ec


def test_the_signature_records_the_scheme_and_an_unknown_code_is_refused():
    from dynemb.checkpoint.table_state import saved_scheme
    ec = _trained_unsharded()
    state = ec.state_dict()
    assert saved_scheme(state["dynamic_tables.t.signature"]) is ShardingScheme.HASH
    assert DynamicEmbTableOptions().sharding is ShardingScheme.HASH
    before = {k: v.clone() for k, v in ec.state_dict().items()}
    bad = dict(state)
    bad["dynamic_tables.t.signature"] = state["dynamic_tables.t.signature"].clone()
    bad["dynamic_tables.t.signature"][-1] = 7
    with pytest.raises(RuntimeError, match=r"table 't': cannot load the checkpoint: sharding "
                                           r"scheme code 7 is none of \['MOD', 'HASH'\]"):
        ec.load_state_dict(bad)
    for key, value in ec.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_a_state_dict_of_signatures_without_the_scheme_is_refused_naming_them():
    """Every format-2 signature records the scheme: one that ends before it is refused, the
    module unchanged."""
    ec = _trained_unsharded()
    state = {k: v[:8].clone() if k.endswith(".signature") else v.clone()
             for k, v in ec.state_dict().items()}
    fresh = type(ec)(ec.embedding_configs())
    with pytest.raises(RuntimeError, match=r"table 't' \(rank0_of_1\): a signature of 8 "
                                           r"fields, 9 expected"):
        fresh.load_state_dict(state)
    assert not fresh.read_rows("t", torch.tensor([5, 6, 9]))[1].any()


def test_a_dcp_checkpoint_of_signatures_without_the_scheme_is_refused_naming_them(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from dynemb.checkpoint import DynamicEmbLoadPlanner
    ec = _trained_unsharded()
    state = {k: v[:8].clone() if k.endswith(".signature") else v.clone()
             for k, v in ec.state_dict().items()}
    fresh = type(ec)(ec.embedding_configs())
    target = fresh.state_dict()
    with warnings.catch_warnings():  # one process: DCP says it assumes so
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path))
        with pytest.raises(CheckpointException, match=r"dynamic_tables\.t\.signature"):
            dcp.load(target, checkpoint_id=str(tmp_path), planner=DynamicEmbLoadPlanner())
    assert not fresh.read_rows("t", torch.tensor([5, 6, 9]))[1].any()
