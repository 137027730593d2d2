"""bench_ems's smoke mode runs, checks its own results and writes its report."""
import json
import math

from benchmarks import bench_ems


def test_ems_benchmark_quick(tmp_path):
    report = bench_ems.main(["--quick", "--out-dir", str(tmp_path)])
    modes = {(r["mode"], round(r["size_mib"])) for r in report["bandwidth"]}
    assert {m for m, _ in modes} == {"all", "values"}
    for row in report["bandwidth"]:
        for key in ("stash_gbps", "restore_gbps", "memcpy_reused_gbps", "memcpy_fresh_gbps"):
            assert math.isfinite(row[key]) and row[key] > 0
        assert len(row["stash_s"]) == report["config"]["repeats"]
    step = report["step"]
    assert step["stashes"] == step["restores"] > 0
    assert step["turn_peak_bytes"]["plain"] - step["turn_peak_bytes"]["stash"] \
        == step["table_bytes"]  # the CPU account: the whole table is away at the turn
    assert step["peak_reduction_of_stashed"] == 1.0
    assert all(len(v) == report["config"]["steps"] for v in step["step_ms"].values())
    saved = json.loads((tmp_path / "ems_cpu_quick.json").read_text())
    assert saved["step"]["median_ms"] == step["median_ms"]
    assert (tmp_path / "ems_cpu_quick.png").stat().st_size > 0
