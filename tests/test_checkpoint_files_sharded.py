"""Checkpoint files of a sharded model: on 2 spawned CPU ranks each rank dumps its share of
a DistributedModelParallel model (full, then a delta) into its own rank directory, and a
freshly sharded model loads the chain back: every key on its owner with its row and optimizer
state, the same counters (see tests/checkpoint_files_worker.py)."""
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the workers

from examples.spawn import run_on_ranks  # noqa: E402
from checkpoint_files_worker import dump_and_load  # noqa: E402
from checkpoint_dcp_worker import TABLES  # noqa: E402


def test_each_rank_dumps_its_share_and_a_sharded_model_loads_the_chain(tmp_path):
    results = run_on_ranks(2, dump_and_load, str(tmp_path), timeout=600)
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["rank0_of_2", "rank1_of_2"]
    manifest = json.loads((tmp_path / "delta" / "rank1_of_2" / "manifest.json").read_text())
    assert sorted(manifest["tables"]) == [f"dyn/{t}" for t in TABLES]
    assert manifest["kind"] == "delta" and manifest["world_size"] == 2
    for rank, result in enumerate(results):
        assert result["rank_dir"] == (rank, 2)
        assert result["delta_previous"] == result["full_id"]
        assert result["loaded_id"] == result["delta_id"]
        assert result["loaded_stats"] == result["stats"]
        for name, (rows, count) in result["rows"].items():
            got_rows, got_count = result["loaded_rows"][name]
            np.testing.assert_array_equal(got_count, count)
            np.testing.assert_array_equal(got_rows, rows)
