"""Tables on disk: the RocksDB store's throughput beside the disk's raw speed, a training step
over disk against one over host memory, and a table several times larger than its host cap.

Three parts, in one run on the same disk (``--work-dir``, default the system temp dir):

1. **Store throughput.** ``--store-rows`` rows of dim 64 (float32 with a score: 264 bytes)
   inserted into a :class:`~dynemb.stores.disk_store.DiskBackingStore` in batches of 8192 and
   flushed to its files, then found again in random batches of 8192 after the files' pages were
   dropped from the page cache (``posix_fadvise(DONTNEED)``, no root needed): rows/s and MB/s,
   next to the same bytes written (plus fsync) and read back with plain file calls.
2. **Training step.** One CACHE table (dim 64, SGD, Zipf ids) trained over the default
   host-memory store, over the disk store, and over the disk store behind a host level of a
   quarter of the table's bytes, taking turns on the same batches: the three are bit for bit
   the same table (checked), so they hit their device cache alike; ms per step and the ratio
   to host memory.
3. **Larger than the host cap.** A table grown to ``--big-rows`` rows (fresh ids every step)
   whose store is on disk behind a host level capped at ``--host-cap-mb``: the process's peak
   resident memory over the run (VmHWM) against the cap plus the device cache, and a check
   that every row is kept (cache + host + disk = rows inserted).

Results: ``results/disk_cpu.json`` and ``.png``.

    .venv/bin/python -m benchmarks.bench_disk             # 20M rows on disk: ~10 min, 7 GB disk
    .venv/bin/python -m benchmarks.bench_disk --quick     # seconds
"""
from __future__ import annotations

import gc
import shutil
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from tqdm import tqdm

from benchmarks.bench_checkpoint import _status_kib, drop_cached, raw_read, raw_write
from benchmarks.common import (add_run_options, check, config_of, fill_defaults, git_state,
                               machine_info, new_parser, pyplot, report_stem, run_command,
                               save_figure, write_report, zipf_ranks)
from dynemb import DynamicEmbCollection, DynamicEmbTableOptions
from dynemb.stores.disk_levels import HostCachedStore, disk_store
from dynemb.stores.disk_store import DiskBackingStore
from dynemb.rows.optimizers import OptimizerConfig, OptimizerType

DIM = 64
ROW_BYTES = DIM * 4 + 8  # float32 row and its int64 score
BATCH = 8192
SGD = OptimizerConfig(OptimizerType.SGD, learning_rate=0.01)


# -- 1. store throughput ----------------------------------------------------------------------
def store_throughput(args, root: Path) -> Dict:
    n = args.store_rows
    gen = torch.Generator().manual_seed(args.seed)
    keys = torch.randperm(n * 8, generator=gen)[:n] * 7919 - (n * 4)
    rows = torch.randn(n, DIM, generator=gen)
    scores = torch.arange(n)
    store = DiskBackingStore(root / "store", DIM, torch.float32, torch.device("cpu"))
    start = time.perf_counter()
    for lo in tqdm(range(0, n, BATCH), desc="store insert", leave=False):
        store.insert(keys[lo:lo + BATCH], rows[lo:lo + BATCH], scores[lo:lo + BATCH])
    store.flush()
    insert_s = time.perf_counter() - start
    drop_cached(root / "store")
    order = keys[torch.randperm(n, generator=gen)]
    start = time.perf_counter()
    found_rows = 0
    for lo in tqdm(range(0, n, BATCH), desc="store find", leave=False):
        found_rows += int(store.find(order[lo:lo + BATCH])[1].sum())
    find_s = time.perf_counter() - start
    check(found_rows == n, f"find: {found_rows} of {n} rows found")
    on_disk = store.nbytes_on_disk()
    store.close()
    payload = torch.empty(n * ROW_BYTES, dtype=torch.uint8)
    payload.copy_(torch.cat([rows.view(torch.uint8).reshape(n, -1),
                             scores.view(torch.uint8).reshape(n, 8)], 1).reshape(-1))
    start = time.perf_counter()
    raw_write(root / "raw.bin", payload, payload.numel(), 1 << 22)
    raw_write_s = time.perf_counter() - start
    drop_cached(root)
    target = torch.empty_like(payload)
    start = time.perf_counter()
    raw_read(root / "raw.bin", target, 1 << 22)
    raw_read_s = time.perf_counter() - start
    check(torch.equal(target, payload), "raw read: bytes differ")
    mb = n * ROW_BYTES / 1e6
    return {"rows": n, "row_bytes": ROW_BYTES, "bytes_on_disk": on_disk,
            "insert": {"seconds": insert_s, "rows_per_s": n / insert_s, "mb_per_s": mb / insert_s},
            "find": {"seconds": find_s, "rows_per_s": n / find_s, "mb_per_s": mb / find_s},
            "raw_write": {"seconds": raw_write_s, "mb_per_s": mb / raw_write_s},
            "raw_read": {"seconds": raw_read_s, "mb_per_s": mb / raw_read_s},
            "insert_vs_raw_write": raw_write_s / insert_s, "find_vs_raw_read": raw_read_s / find_s}


# -- 2. a training step over each store -------------------------------------------------------
def collection(rows: int, cached: int, factory) -> DynamicEmbCollection:
    config = EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=rows,
                             feature_names=["f"])
    options = DynamicEmbTableOptions(caching=True, local_hbm_for_values=cached * DIM * 4,
                                     backing_store=factory)
    return DynamicEmbCollection([config], table_options={"t": options}, optimizer=SGD)


def train_step(module, ids: torch.Tensor) -> torch.Tensor:
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.full((ids.numel() // 64,), 64))
    out = module(kjt)["f"].values()
    out.sum().backward()
    return out


def training_step(args, root: Path) -> Dict:
    rng = np.random.default_rng(args.seed)
    vocab, cached, batch = args.step_vocab, args.step_cached, args.step_batch
    steps = args.warmup + args.steps
    ids = torch.from_numpy(zipf_ranks(rng, steps * batch, 1.05, vocab) * 2654435761 % (1 << 40))
    host_level = vocab * (DIM * 4 + 20) // 4
    methods = {"host memory": collection(vocab, cached, None),
               "disk": collection(vocab, cached, disk_store(root / "step")),
               "disk + host level": collection(vocab, cached, disk_store(
                   root / "step_host", host_cache_bytes=host_level))}
    times: Dict[str, List[float]] = {name: [] for name in methods}
    names = list(methods)
    for i in tqdm(range(steps), desc="training steps", leave=False):
        part = ids[i * batch:(i + 1) * batch]
        outs = {}
        for name in names[i % 3:] + names[:i % 3]:  # turns rotate: noise falls on all alike
            start = time.perf_counter()
            outs[name] = train_step(methods[name], part)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
        check(all(torch.equal(outs[names[0]], o) for o in outs.values()),
              f"step {i}: the stores gave different rows")
    stats = {name: m.stats()["t"] for name, m in methods.items()}
    check(len({tuple(s.values()) for s in stats.values()}) == 1, "counters differ")
    s = stats["host memory"]
    median = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
    return {"vocab": vocab, "cached_rows": cached, "ids_per_step": batch,
            "host_level_bytes": host_level,
            "hit_rate": s["hits"] / max(1, s["unique_keys"]),
            "write_backs_per_step": s["write_backs"] / steps, "loads_per_step": s["loads"] / steps,
            "ms_per_step": median,
            "ratio_to_host_memory": {n: median[n] / median["host memory"] for n in names}}


# -- 3. a table larger than its host cap -------------------------------------------------------
def big_table(args, root: Path) -> Dict:
    rows, steps, cached = args.big_rows, args.big_steps, args.big_cached
    cap = args.host_cap_mb << 20
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    baseline = _status_kib("VmRSS") * 1024
    module = collection(rows, cached, disk_store(root / "big", host_cache_bytes=cap))
    per_step = -(-rows // steps) // 64 * 64
    rss, inserted = [], 0
    start = time.perf_counter()
    for i in tqdm(range(steps), desc="larger than the host cap", leave=False):
        ids = torch.arange(inserted, inserted + per_step) * 2654435761 % (1 << 50)
        train_step(module, ids)
        inserted += per_step
        rss.append(_status_kib("VmRSS") * 1024)
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM") * 1024
    table = module.tables["t"]
    store = table.store
    check(isinstance(store, HostCachedStore), "the big table's store has no host level")
    held = table.tier.hash.size() + store.size()
    check(held >= inserted, f"rows lost: {held} held of {inserted} inserted")
    device_bytes = table.tier.hash.capacity * (DIM * 4 + 20)
    result = {"rows": inserted, "steps": steps, "cached_rows": cached, "host_cap_bytes": cap,
              "table_bytes": inserted * DIM * 4, "table_over_cap": inserted * DIM * 4 / cap,
              "host_rows": store.host.size(), "disk_rows": store.disk.size(),
              "disk_bytes": store.disk.nbytes_on_disk(), "seconds": seconds,
              "ms_per_step": seconds / steps * 1e3, "rss_before_bytes": baseline,
              "peak_rss_bytes": peak, "peak_rss_over_start_bytes": peak - baseline,
              "device_cache_bytes": device_bytes,
              "rss_per_step_bytes": rss[:: max(1, steps // 100)]}
    result["peak_over_start_per_cap"] = result["peak_rss_over_start_bytes"] / cap
    del module, table, store
    gc.collect()
    return result


# -- report ----------------------------------------------------------------------------------
def plot(report: Dict, path: Path) -> None:
    plt = pyplot()
    r = report["result"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5))
    s = r["store"]
    ax1.bar(["store insert", "raw write", "store find", "raw read"],
            [s["insert"]["mb_per_s"], s["raw_write"]["mb_per_s"], s["find"]["mb_per_s"],
             s["raw_read"]["mb_per_s"]], color=["C0", "C7", "C1", "C7"])
    ax1.set_ylabel("MB/s")
    ax1.set_yscale("log")
    ax1.set_title(f"RocksDB store, {s['rows']:,} rows of {s['row_bytes']} B")
    t = r["step"]
    names = list(t["ms_per_step"])
    ax2.bar(names, [t["ms_per_step"][n] for n in names], color=["C7", "C0", "C2"])
    ax2.set_ylabel("ms per training step")
    ax2.set_title(f"same table, hit rate {100 * t['hit_rate']:.0f}%")
    b = r["big"]
    mib = np.asarray(b["rss_per_step_bytes"]) / 2**20
    ax3.plot(np.linspace(0, b["steps"], len(mib)), mib, label="resident memory")
    ax3.axhline(b["rss_before_bytes"] / 2**20 + (b["host_cap_bytes"] + b["device_cache_bytes"])
                / 2**20, color="C3", linestyle="--", label="start + host cap + device cache")
    ax3.set_xlabel("step")
    ax3.set_ylabel("MiB")
    ax3.set_title(f"{b['rows']:,} rows = {b['table_over_cap']:.1f}x the host cap")
    ax3.legend()
    save_figure(fig, path)


def main(argv=None) -> Dict:
    parser = new_parser(__doc__)
    parser.add_argument("--store-rows", type=int, help="rows of the throughput part")
    parser.add_argument("--step-vocab", type=int, help="ids of the training-step table")
    parser.add_argument("--step-cached", type=int, help="its device cache rows")
    parser.add_argument("--step-batch", type=int, help="its ids per step")
    parser.add_argument("--warmup", type=int, help="untimed steps first")
    parser.add_argument("--steps", type=int, help="timed steps")
    parser.add_argument("--big-rows", type=int, help="rows of the larger-than-host table")
    parser.add_argument("--big-steps", type=int, help="steps that grow it")
    parser.add_argument("--big-cached", type=int, help="its device cache rows")
    parser.add_argument("--host-cap-mb", type=int, help="its host level, MiB")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where the stores go (default: the system temp dir)")
    add_run_options(parser, "small sizes, seconds")
    args = parser.parse_args(argv)
    fill_defaults(args, {"store_rows": 20_000, "step_vocab": 20_000, "step_cached": 2048,
                         "step_batch": 2048, "warmup": 2, "steps": 4, "big_rows": 40_000,
                         "big_steps": 8, "big_cached": 16_384, "host_cap_mb": 2},
                  {"store_rows": 2_000_000, "step_vocab": 2_000_000, "step_cached": 65_536,
                   "step_batch": 16_384, "warmup": 10, "steps": 40, "big_rows": 20_000_000,
                   "big_steps": 300, "big_cached": 262_144, "host_cap_mb": 512})
    torch.manual_seed(args.seed)
    root = Path(tempfile.mkdtemp(prefix="bench_disk-", dir=args.work_dir))
    try:
        result = {"store": store_throughput(args, root), "step": training_step(args, root),
                  "big": big_table(args, root)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = {"benchmark": "disk", "machine": machine_info(git_state(), ["rocksdict"]),
              "config": config_of(args), "result": result}
    s, t, b = result["store"], result["step"], result["big"]
    print(f"store: insert {s['insert']['rows_per_s']:,.0f} rows/s {s['insert']['mb_per_s']:.0f} "
          f"MB/s (raw write {s['raw_write']['mb_per_s']:.0f} MB/s), find "
          f"{s['find']['rows_per_s']:,.0f} rows/s {s['find']['mb_per_s']:.0f} MB/s (raw read "
          f"{s['raw_read']['mb_per_s']:.0f} MB/s)")
    print("step (ms): " + ", ".join(f"{n} {v:.1f} ({t['ratio_to_host_memory'][n]:.2f}x)"
                                    for n, v in t["ms_per_step"].items())
          + f"; hit rate {100 * t['hit_rate']:.1f}%")
    print(f"big: {b['rows']:,} rows ({b['table_over_cap']:.1f}x the {b['host_cap_bytes'] >> 20} "
          f"MiB host cap), peak RSS {b['peak_rss_bytes'] / 2**30:.2f} GiB, "
          f"{b['peak_rss_over_start_bytes'] / 2**20:.0f} MiB over the start "
          f"({b['peak_over_start_per_cap']:.2f}x the cap), {b['ms_per_step']:.0f} ms/step")
    write_report(report, args.out_dir, report_stem("disk_cpu", args.quick), plot)
    return report


if __name__ == "__main__":
    run_command(main)
