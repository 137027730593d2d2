"""examples/train_dlrm.py: DLRM with its sparse arch on row-wise sharded dynamic bag tables,
two spawned CPU ranks under TrainPipelineSparseDist, on synthetic Criteo-format data and on a
given file with a malformed line."""
import json
import math

import numpy as np
import pytest

from examples.dlrm_data import held_out_mask, write_synthetic_criteo
from examples.train_dlrm import main


def test_quick_run_learns_and_writes_its_results(tmp_path):
    m = main(["--quick", "--out-dir", str(tmp_path)])
    assert m["world_size"] == 2 and m["pipeline"] == "TrainPipelineSparseDist"
    first, last = m["initial"], m["final"]
    assert all(math.isfinite(x) for x in (first["auc"], last["auc"], last["log_loss"]))
    assert abs(first["auc"] - 0.5) < 0.05          # untrained: near chance
    assert last["auc"] > 0.7 and last["auc"] > first["auc"] + 0.15
    assert last["log_loss"] < m["constant_log_loss"] - 0.05 < first["log_loss"]
    assert last["auc"] < m["data"]["synthetic"]["bayes_auc"]
    assert np.mean(m["losses"][-10:]) < np.mean(m["losses"][:10]) - 0.05
    # the held-out split is ~10% of the file, every held-out example scored once
    assert 0.08 * m["data"]["synthetic"]["rows"] < m["held_out_examples"] <= m["config"][
        "eval_rows"] + m["config"]["batch"]
    # each rank owns rows of the tables: ids went to their owners
    assert m["stats"]["inserts"] >= m["stats"]["rows_device"] > 0
    assert len(m["rows_per_rank"]) == 2 and min(m["rows_per_rank"]) > 0
    assert sum(m["rows_per_rank"]) == m["stats"]["rows_device"]
    assert len(m["tables"]) == 26
    saved = json.loads((tmp_path / "train_dlrm.json").read_text())
    assert saved["final"] == last and saved["steps"] == m["steps"]
    assert (tmp_path / "train_dlrm.png").stat().st_size > 0
    assert not (tmp_path / "synthetic_criteo.tsv").exists()     # removed after the run


def file_with_malformed_lines(tmp_path):
    """A small synthetic Criteo-format file with two malformed lines: the first training line
    (not held out) after line 100 has a categorical value that is not hex, the first held-out
    line after line 200 lacks its last field. Returns (path, the training line's number, the
    held-out line's number, the number of well-formed training lines)."""
    path = tmp_path / "small.tsv"
    write_synthetic_criteo(path, rows=3000, seed=1)
    lines = path.read_text().splitlines(keepends=True)
    held = held_out_mask(np.arange(1, len(lines) + 1), 0.1)
    in_training = next(n for n in range(101, len(lines)) if not held[n - 1])
    fields = lines[in_training - 1].split("\t")
    fields[20] = "not-hex"
    lines[in_training - 1] = "\t".join(fields)
    held_out = next(n for n in range(201, len(lines)) if held[n - 1])
    lines[held_out - 1] = "\t".join(lines[held_out - 1].split("\t")[:-1]) + "\n"
    path.write_text("".join(lines))
    return path, in_training, held_out, int((~held).sum()) - 1


def test_given_file_with_malformed_lines(tmp_path):
    """The reader's documented behaviour, through the example: the first malformed line read
    (the held-out lines are read first) stops the run with the file and line number; with
    --skip-malformed each is skipped and counted once, in its split."""
    path, in_training, held_out, training_lines = file_with_malformed_lines(tmp_path)
    common = ["--data", str(path), "--batch", "64", "--eval-every", "10",
              "--out-dir", str(tmp_path / "out")]
    with pytest.raises(RuntimeError, match=rf"{path.name}:{held_out}: malformed line: "
                                           rf"expected 40 tab-separated fields"):
        main(common + ["--nproc", "1"])       # spawn's RankError, with each rank's traceback
    m = main(common + ["--skip-malformed"])
    assert m["skipped_lines"] == 1 and m["eval_skipped_lines"] == 1
    assert m["data"] == {"path": str(path), "format": "criteo", "synthetic": None}
    # one epoch of full batches of 64, every other one on each rank, until one rank runs out
    assert m["steps"] == (training_lines // 64) // 2
    assert m["final"]["auc"] > 0.55
    assert min(m["rows_per_rank"]) > 0
    assert (tmp_path / "out" / "train_dlrm.png").stat().st_size > 0
