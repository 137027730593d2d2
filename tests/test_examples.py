"""The examples run as a user would run them: a fresh interpreter, outside the checkout."""
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
