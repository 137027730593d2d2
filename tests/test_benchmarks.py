"""The benchmarks' smoke modes run, check their own results and write their reports."""
import json
import math

import pytest

from benchmarks import bench_collection, bench_hash_table


def test_hash_table_benchmark_quick(tmp_path):
    report = bench_hash_table.main(["--quick", "--out-dir", str(tmp_path)])
    ops = {(r["op"], r["impl"]) for r in report["rows"]}
    assert {("find_hit", "dynemb"), ("find_hit", "dict"), ("find_hit", "searchsorted"),
            ("insert_evict", "dynemb")} <= ops
    evict = [r for r in report["rows"] if r["op"] == "insert_evict" and r["impl"] == "dynemb"]
    assert all(r["evicted"] > 0 for r in evict)
    # find_or_insert under LFU_LRU, on a copy of each table, next to LRU
    lfu_lru = [c for c in report["comparisons"] if c["impl"] == "dynemb-lfu_lru"]
    assert {c["op"] for c in lfu_lru} == {"insert_unique", "insert_dedup", "insert_evict"}
    lru = {(c["capacity_log2"], c["load_target"], c["op"], c["threads"]): c
           for c in report["comparisons"] if c["impl"] == "dynemb"}
    for c in lfu_lru:
        same = lru[(c["capacity_log2"], c["load_target"], c["op"], c["threads"])]
        assert c["vs_lru"] == pytest.approx(c["mkeys_per_s"] / same["mkeys_per_s"])
        assert c["evicted"] == same["evicted"]  # the same keys in full buckets evict alike
    saved = json.loads((tmp_path / "hash_table_cpu_quick.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(report["rows"]))
    assert (tmp_path / "hash_table_cpu_quick.png").stat().st_size > 0


def test_collection_benchmark_quick(tmp_path):
    report = bench_collection.main(["--quick", "--profile", "1", "--out-dir", str(tmp_path)])
    methods = {(r["optimizer"], r["method"]) for r in report["rows"]}
    common = {"hbm_direct", "cache", "static", "managed_collision"}
    assert {("sgd", m) for m in common | {"static_torch"}} | {("adam", m) for m in common} \
        == methods
    steps = report["config"]["steps"]
    assert all(len(r["step_ms"]) == steps and r["median_ms"] > 0 for r in report["rows"])
    cache = [r for r in report["rows"] if r["method"] == "cache"]
    assert all(r["extra"]["timed_counters"]["evictions"] > 0 for r in cache)
    for c in report["comparisons"]:
        assert 0.0 <= c["cache_hit_rate"] <= 1.0
        assert min(c["hbm_vs_static"], c["mc_vs_hbm"], c["cache_vs_hbm"]) > 0
        torch_sparse = "static_torch" if c["optimizer"] == "sgd" else "static"
        assert c["hbm_vs_torch_sparse"] == pytest.approx(
            c["median_ms"]["hbm_direct"] / c["median_ms"][torch_sparse])
    assert len(report["targets"]) == 4 * len(report["comparisons"])
    assert {p["method"] for p in report["profile"]} == {"hbm_direct", "cache"}
    saved = json.loads((tmp_path / "collection_cpu_quick.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(report["rows"]))
    assert (tmp_path / "collection_cpu_quick.png").stat().st_size > 0


def test_sharded_benchmark_quick(tmp_path):
    """Two spawned ranks train both sharded models under TrainPipelineSparseDist; the report
    has every field, and every time is finite and positive (no timing is asserted)."""
    from benchmarks import bench_sharded
    report = bench_sharded.main(["--quick", "--out-dir", str(tmp_path)])
    steps = report["config"]["steps"]
    assert len(report["rows"]) == 1
    for row in report["rows"]:
        for method in ("dynemb", "torchrec"):
            times = row["step_ms"][method]
            assert len(times) == steps
            assert all(math.isfinite(t) and t > 0 for t in times)
            assert math.isfinite(row["median_ms"][method]) and row["median_ms"][method] > 0
        assert math.isfinite(row["ratio"]) and row["ratio"] > 0
        assert row["max_loss_rel_diff"] <= bench_sharded.LOSS_RTOL
        assert [p["rank"] for p in row["per_rank"]] == [0, 1]
        for profile in row["profile"]:
            for method in ("dynemb", "torchrec"):
                phases = profile[method]["phases_ms"]
                assert {"forward", "backward"} <= set(phases)
                assert all(math.isfinite(v) and v >= 0 for v in phases.values())
    saved = json.loads((tmp_path / "sharded_cpu_quick.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(report["rows"]))
    assert (tmp_path / "sharded_cpu_quick.png").stat().st_size > 0


def test_checkpoint_benchmark_quick(tmp_path):
    from benchmarks import bench_checkpoint
    report = bench_checkpoint.main(["--quick", "--rows", "50000", "--work-dir", str(tmp_path),
                                    "--out-dir", str(tmp_path)])
    result = report["result"]
    assert result["rows"] >= 0.999 * 50_000
    assert result["delta"]["rows"] == pytest.approx(0.01 * result["rows"], rel=0.01)
    for name in ("dump", "load", "raw_write", "raw_read"):
        assert result[name]["seconds"] > 0 and result[name]["mb_per_s"] > 0
    assert set(result["targets"]) == {"dump >= 0.5 raw write", "load >= 0.5 raw read",
                                      "dump peak <= 2 chunks", "load peak <= 2 chunks",
                                      "1% delta <= 3% of a full dump's time",
                                      "checkpoints <= 1.1x the live rows' bytes"}
    sizes = result["sizes"]["tables"]
    assert [t["live_rows"] > 0 for t in sizes] == [True] * 4
    assert all(set(t["bytes"]) == {"state_dict", "dcp", "dump"} for t in sizes)
    assert (tmp_path / "checkpoint_cpu_quick.png").stat().st_size > 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("bench_checkpoint_")]


def test_pooled_benchmark_quick(tmp_path):
    """Two spawned ranks train the pooled modules (ours and TorchRec's EBC) under
    TrainPipelineSparseDist; the report has every field and every time is finite and positive
    (no timing is asserted)."""
    from benchmarks import bench_pooled
    report = bench_pooled.main(["--quick", "--out-dir", str(tmp_path)])
    assert len(report["rows"]) == 1
    row = report["rows"][0]
    for method in ("dynemb", "torchrec"):
        times = row["step_ms"][method]
        assert len(times) == report["config"]["steps"]
        assert all(math.isfinite(t) and t > 0 for t in times)
    assert math.isfinite(row["ratio"]) and row["ratio"] > 0
    assert row["max_loss_rel_diff"] <= bench_pooled.LOSS_RTOL
    for profile in row["profile"]:
        for method in ("dynemb", "torchrec"):
            assert {"forward", "backward"} <= set(profile[method]["phases_ms"])
            assert profile[method]["profiler_ops"]
    saved = json.loads((tmp_path / "pooled_cpu_quick.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(report["rows"]))
    assert (tmp_path / "pooled_cpu_quick.png").stat().st_size > 0


def test_tables_benchmark_quick(tmp_path):
    """The table-count sweep: every method at every T and optimizer, the ratios are those of
    the medians, the evicting methods evicted; the profile splits a step into its phases."""
    from benchmarks import bench_tables
    report = bench_tables.main(["--quick", "--out-dir", str(tmp_path)])
    tables, opts = report["config"]["tables"], report["config"]["optimizers"]
    assert [(r["tables"], r["optimizer"]) for r in report["rows"]] == [
        (t, o) for t in tables for o in opts]
    for row in report["rows"]:
        assert row["ids_per_table"] * row["tables"] == report["config"]["ids"]
        for name in bench_tables.METHODS:
            times = row["methods"][name]["step_ms"]
            assert len(times) == report["config"]["steps"]
            assert all(math.isfinite(t) and t > 0 for t in times)
        assert row["hbm_fit_vs_torch_sparse"] == pytest.approx(
            row["methods"]["hbm_fit"]["median_ms"] / row["methods"]["torch_sparse"]["median_ms"])
        assert row["methods"]["hbm_evict"]["timed_counters"]["evictions"] > 0
        assert row["methods"]["cache"]["timed_counters"]["write_backs"] > 0
        assert row["methods"]["hbm_fit"]["timed_counters"]["evictions"] == 0
        assert set(row["eval_ms"]) == set(bench_tables.EVAL_METHODS)
        assert all(math.isfinite(t) and t > 0 for t in row["eval_ms"].values())
    assert len(report["targets"]) == 3 * len(bench_tables.DYNEMB_METHODS) * len(opts)
    saved = json.loads((tmp_path / "tables_cpu_quick.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(report["rows"]))
    assert (tmp_path / "tables_cpu_quick.png").stat().st_size > 0

    profile = bench_tables.main(["--quick", "--profile", "--out-dir", str(tmp_path)])
    assert [r["tables"] for r in profile["runs"]] == profile["config"]["profile_tables"]
    for run in profile["runs"]:
        phases = run["phases_ms"]
        assert {"dedup", "fused update (kernel)",
                "python and autograd (the rest of the step)"} <= set(phases)
        assert all(math.isfinite(v) for v in phases.values())
        # the tables form one group (or there is one table): one call per phase per step
        for phase in ("dedup", "find_or_insert (claim, pin)", "fused update (kernel)"):
            assert run["calls_per_step"][phase] == 1, phase
    saved = json.loads((tmp_path / "tables_profile_quick.json").read_text())
    assert saved["runs"] == json.loads(json.dumps(profile["runs"]))


def test_disk_benchmark_quick(tmp_path):
    from benchmarks import bench_disk
    report = bench_disk.main(["--quick", "--out-dir", str(tmp_path), "--work-dir",
                              str(tmp_path)])
    r = report["result"]
    assert r["store"]["insert"]["rows_per_s"] > 0 and r["store"]["find"]["rows_per_s"] > 0
    assert set(r["step"]["ms_per_step"]) == {"host memory", "disk", "disk + host level"}
    big = r["big"]
    assert big["rows"] > 4 * big["host_cap_bytes"] // (64 * 4)  # larger than its host cap
    assert big["host_rows"] + big["disk_rows"] + big["cached_rows"] >= big["rows"]
    saved = json.loads((tmp_path / "disk_cpu_quick.json").read_text())
    assert saved["result"]["big"]["rows"] == big["rows"]
    assert (tmp_path / "disk_cpu_quick.png").stat().st_size > 0


def test_before_after_pairs_every_timing_both_sides_measured():
    from benchmarks import before_after
    before = [{"rows": [{"op": "a", "step_ms": 2.0}, {"op": "b", "step_ms": 4.0}], "n": 7},
              {"rows": [{"op": "a", "step_ms": 4.0}, {"op": "b", "step_ms": 6.0}], "n": 7}]
    after = [{"rows": [{"op": "a", "step_ms": 3.0}, {"op": "b", "step_ms": 5.0}],
              "extra_ms": 1.0}]
    assert before_after.compare(before, after) == {
        "rows.0.step_ms": {"before": 3.0, "after": 3.0, "ratio": 1.0},
        "rows.1.step_ms": {"before": 5.0, "after": 5.0, "ratio": 1.0}}
    assert dict(before_after.timings({"flag_ms": True, "ms": 2, "deep": [[{"x_ms": 1}]]})) == \
        {"ms": 2.0, "deep.0.0.x_ms": 1.0}


def test_gpu_step_benchmark_runs_its_workloads_on_cpu(tmp_path):
    """bench_gpu's five workloads at 1% of their size on the CPU: every row names its
    workload, both times and their ratio, and the report and plot are written (what the
    gpu_check stage commits)."""
    from benchmarks import bench_gpu
    path, image = tmp_path / "gpu_step.json", tmp_path / "gpu_step.png"
    report = bench_gpu.main(["--device", "cpu", "--scale", "0.01", "--rounds", "2",
                             "--warmup", "1", "--steps", "2", "--profiled-steps", "1",
                             "--batches", "2", "--json", str(path), "--plot", str(image)])
    rows = {r["workload"]: r for r in report["rows"]}
    assert list(rows) == list(bench_gpu.WORKLOADS)
    for name, row in rows.items():
        assert len(row["dynemb_ms_rounds"]) == len(row["torch_sparse_ms_rounds"]) == 2
        assert row["dynemb_ms"] > 0 and row["torch_sparse_ms"] > 0 and row["dynemb_host_ms"] > 0
        assert row["ratio"] == pytest.approx(row["dynemb_ms"] / row["torch_sparse_ms"])
        assert row["target_ratio"] == bench_gpu.TARGETS[name]
        assert row["tables"] == bench_gpu.WORKLOADS[name].tables
    assert json.loads(path.read_text())["rows"] == json.loads(json.dumps(report["rows"]))
    assert image.stat().st_size > 0


def test_growth_benchmark_quick(tmp_path):
    """Tables growing from init_capacity, grouped next to alone: the run grew them (the same
    capacities both ways, checked by the run itself), the ratios are those of the medians
    and of the run totals."""
    from benchmarks import bench_growth
    report = bench_growth.main(["--quick", "--out-dir", str(tmp_path)])
    assert [r["tables"] for r in report["rows"]] == report["config"]["tables"]
    for row in report["rows"]:
        assert row["capacity_end"] > row["capacity_start"] and row["growth_steps"] >= 1
        grouped, alone = (row["methods"][n] for n in (bench_growth.GROUPED, bench_growth.ALONE))
        assert len(grouped["step_ms"]) == report["config"]["steps"]
        assert row["grow_grouped_vs_grow_alone"] == pytest.approx(
            grouped["median_ms"] / alone["median_ms"])
        assert row["grow_grouped_vs_grow_alone_total"] == pytest.approx(
            sum(grouped["step_ms"]) / sum(alone["step_ms"]))
    assert (tmp_path / "growth_cpu_quick.png").stat().st_size > 0


def test_default_groups_benchmark_quick(tmp_path):
    """DEFAULT tables grouped and one by one: the same rows every step and the same counters
    (the run checks both), rows in both tiers, the ratio that of the medians."""
    from benchmarks import bench_default_groups
    report = bench_default_groups.main(["--quick", "--out-dir", str(tmp_path),
                                        "--optimizers", "sgd"])
    assert [(r["tables"], r["capacity"]) for r in report["rows"]] == [
        (t, c) for t in report["config"]["tables"] for c in bench_default_groups.CAPACITIES]
    for row in report["rows"]:
        assert row["rows_device"] > 0 and row["rows_host"] > 0
        assert row["ratio"] == pytest.approx(row["grouped_ms"] / row["alone_ms"])
        assert len(row["step_ms"]["grouped"]) == report["config"]["steps"]
    assert (tmp_path / "default_groups_cpu_quick.png").stat().st_size > 0


def test_stash_groups_benchmark_quick(tmp_path):
    """Stashing tables grouped, one by one and not stashing: identical embeddings every step
    (the run checks it), every stashing table stashed every step, one stash for the group."""
    from benchmarks import bench_stash_groups
    report = bench_stash_groups.main(["--quick", "--out-dir", str(tmp_path)])
    assert [r["tables"] for r in report["rows"]] == report["config"]["tables"]
    for row in report["rows"]:
        grouped = row["methods"][bench_stash_groups.GROUPED]["step_ms"]
        alone = row["methods"][bench_stash_groups.ALONE]["step_ms"]
        assert len(grouped) == len(alone) == report["config"]["steps"]
        ratios = sorted(a / b for a, b in zip(grouped, alone))
        assert row["stash_grouped_vs_stash_alone"]["median"] == pytest.approx(
            ratios[len(ratios) // 2] if len(ratios) % 2 else
            (ratios[len(ratios) // 2 - 1] + ratios[len(ratios) // 2]) / 2)
        width = 32  # SGD rows: the embedding only
        assert row["stashed_mib"] * 2 ** 20 >= row["tables"] * row["rows_per_table"] * width * 4
    assert (tmp_path / "stash_groups_cpu_quick.png").stat().st_size > 0


def test_dedup_form_benchmark_quick(tmp_path):
    """Exact and padded unique keys on the host kernels: the same slots and rows in both forms
    (the run checks both), every table count reported, the ratio that of the medians."""
    from benchmarks import bench_dedup_form
    report = bench_dedup_form.main(["--quick", "--out-dir", str(tmp_path)])
    assert [r["tables"] for r in report["results"]] == report["config"]["tables"]
    for row in report["results"]:
        assert 0 < row["unique_share"] < 1
        assert len(row["exact_steps_ms"]) == len(row["padded_steps_ms"]) == \
            report["config"]["steps"]
        assert row["padded_over_exact"] == pytest.approx(row["padded_ms"] / row["exact_ms"])
    assert (tmp_path / "dedup_form_cpu_quick.png").stat().st_size > 0


def test_bench_expiry_quick_run_erases_what_the_ages_say(tmp_path):
    from benchmarks import bench_expiry
    report = bench_expiry.main(["--quick", "--out-dir", str(tmp_path)])
    (row,) = report["rows"]
    assert row["rows"] == 20_000 and 0 < row["erased_half"] < 20_000
    assert row["sweep_nothing_ms"] > 0 and row["train_step_ms"] > 0
    assert (tmp_path / "expiry_cpu_quick.png").exists()
