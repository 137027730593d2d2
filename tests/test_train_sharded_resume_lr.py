"""The main job's checkpoint holds the tables' learning rate, and ``--resume`` trains on at
the lr of the checkpoint, not at the one the script builds its optimizer with."""
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from tests.test_examples import run_example

BUILT_LR = 0.1        # examples/train_next_item.py's EMBEDDING_LR
CHANGED_LR = 0.025
LR_SUFFIX = ".dynamic_tables.param_group.lr"


def saved_lr_keys(path):
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return [k for k in metadata.state_dict_metadata
            if k.startswith("optim.state.") and k.endswith(LR_SUFFIX)]


def rewrite_lr(path, lr):
    """The checkpoint at ``path`` again, with the tables' saved lr replaced by ``lr``."""
    state = _load_state_dict_from_keys(checkpoint_id=str(path))
    (key,) = [k for k in state["optim"]["state"] if k.endswith(".dynamic_tables")]
    state["optim"]["state"][key]["param_group"]["lr"] = lr
    rewritten = path.with_name("rewritten")
    dcp.save(state, checkpoint_id=str(rewritten))
    for f in path.iterdir():
        f.unlink()
    for f in rewritten.iterdir():
        f.rename(path / f.name)


@pytest.mark.filterwarnings("ignore:torch.distributed is")
def test_the_checkpoint_holds_the_lr_and_resume_trains_at_it(tmp_path):
    run_example("train_sharded.py", "--quick", "--out-dir", "out", "--nproc", "1",
                "--steps", "4", cwd=tmp_path)
    m = json.loads((tmp_path / "out" / "train_sharded.json").read_text())
    path = tmp_path / "out" / "checkpoint"
    assert m["checkpoint"]["lr"] == m["first_lr"] == BUILT_LR
    (key,) = saved_lr_keys(path)
    saved = {"optim": {"state": {key[len("optim.state."):-len(LR_SUFFIX)] + ".dynamic_tables":
                                 {"param_group": {"lr": None}}}}}
    dcp.load(saved, checkpoint_id=str(path))
    (entry,) = saved["optim"]["state"].values()
    assert entry["param_group"]["lr"] == BUILT_LR

    rewrite_lr(path, CHANGED_LR)
    proc = run_example("train_sharded.py", "--quick", "--out-dir", "out", "--nproc", "1",
                       "--steps", "2", "--resume", cwd=tmp_path)
    assert f"embedding lr {CHANGED_LR:g}" in proc.stdout
    resumed = json.loads((tmp_path / "out" / "train_sharded.json").read_text())
    assert resumed["first_step"] == 4
    assert resumed["first_lr"] == resumed["checkpoint"]["lr"] == CHANGED_LR
    assert torch.isfinite(torch.tensor(resumed["final_loss"]))
