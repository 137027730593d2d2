"""The examples run as a user would run them: a fresh interpreter, outside the checkout."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_hash_table_tour_runs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "hash_table_tour.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "evicted [11]" in proc.stdout          # LRU: 11 is the least recently used key
    assert "TableFullError for keys [99]" in proc.stdout
    assert "row moved with it: True" in proc.stdout


def test_train_next_item_quick_learns(tmp_path):
    """The README's main job in its seconds-long form: it trains, beats the popularity
    baseline, stores nothing in eval mode, exercises the cache and admission, writes the plot."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_next_item.py"),
                           "--quick", "--out-dir", "out"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "HR@10 on the held-out stream" in proc.stdout
    m = json.loads((tmp_path / "out" / "train_next_item.json").read_text())
    assert (tmp_path / "out" / "train_next_item.png").stat().st_size > 0
    numbers = [m["initial_loss"], m["final_loss"], m["hr10"], m["hr10_popularity"],
               m["cache_hit_rate"]]
    assert all(math.isfinite(x) for x in numbers), numbers
    assert m["final_loss"] < m["initial_loss"] - 0.5
    assert m["hr10"] > m["hr10_popularity"] + 0.1
    assert m["eval_inserts"] == 0
    items, users = m["stats"]["items"], m["stats"]["users"]
    assert items["storage_mode"] == "cache" and items["evictions"] > 0 and items["loads"] > 0
    assert items["rows_device"] == items["device_capacity"] < items["rows_backing"]
    assert users["admission_rejects"] > 0


def test_train_sharded_quick_learns(tmp_path):
    """The README's main job in its seconds-long form: two spawned CPU ranks train under
    TrainPipelineSparseDist, beat the popularity baseline, store nothing in eval mode,
    exercise the cache and admission on every rank, write the plot."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_sharded.py"),
                           "--quick", "--out-dir", "out"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "2 ranks (cpu, gloo), TrainPipelineSparseDist" in proc.stdout
    assert "HR@10 on the held-out stream" in proc.stdout
    m = json.loads((tmp_path / "out" / "train_sharded.json").read_text())
    assert (tmp_path / "out" / "train_sharded.png").stat().st_size > 0
    assert m["world_size"] == 2 and m["pipeline"] == "TrainPipelineSparseDist"
    numbers = [m["initial_loss"], m["final_loss"], m["hr10"], m["hr10_popularity"],
               m["cache_hit_rate"]]
    assert all(math.isfinite(x) for x in numbers), numbers
    assert m["final_loss"] < m["initial_loss"] - 0.5
    assert m["hr10"] > m["hr10_popularity"] + 0.1
    assert m["eval_inserts"] == 0
    items, users = m["stats"]["items"], m["stats"]["users"]
    assert items["storage_mode"] == "cache" and items["evictions"] > 0 and items["loads"] > 0
    assert users["admission_rejects"] > 0
    for rank in m["stats_per_rank"]:   # both ranks own a share of each table
        assert rank["items"]["rows_device"] > 0 and rank["users"]["rows_device"] > 0
