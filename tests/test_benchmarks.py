"""The benchmark's smoke mode runs, checks its own results and writes its report."""
import json

from benchmarks import bench_hash_table


def test_hash_table_benchmark_quick(tmp_path):
    report = bench_hash_table.main(["--quick", "--out-dir", str(tmp_path)])
    ops = {(r["op"], r["impl"]) for r in report["rows"]}
    assert {("find_hit", "dynemb"), ("find_hit", "dict"), ("find_hit", "searchsorted"),
            ("insert_evict", "dynemb")} <= ops
    evict = [r for r in report["rows"] if r["op"] == "insert_evict" and r["impl"] == "dynemb"]
    assert all(r["evicted"] > 0 for r in evict)
    saved = json.loads((tmp_path / "hash_table_cpu_quick.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(report["rows"]))
    assert (tmp_path / "hash_table_cpu_quick.png").stat().st_size > 0
