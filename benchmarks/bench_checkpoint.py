"""Checkpoint files: dump and load throughput of a big table beside the disk's raw speed.

One HBM_DIRECT table (dim 64, Adam: 768-byte rows) is filled with ``--rows`` trained rows,
then, in one run on the same disk:

- ``dynemb.checkpoint.dump`` (full) and ``load`` into a fresh module: rows/s, MB/s, and the
  peak memory each adds over the process's resident memory before it (VmHWM after the
  kernel's high-water mark is reset), against the chunk size the files are written in;
- the raw baseline: the same number of bytes written from and read back into memory with
  plain file writes (plus fsync, as the dump does) in the same directory;
- an incremental dump after ``--changed`` (1%) of the rows were trained once more: its size
  and time against the full dump's;
- checkpoint bytes against the live rows' bytes (:func:`checkpoint_sizes`): a table of
  ``SIZE_CAPACITY`` slots holding 1% to 70% of it, saved as a ``torch.save``'d
  ``state_dict``, a ``torch.distributed.checkpoint`` directory (one process) and a full
  dump; a checkpoint's size should follow the rows trained, not the table's headroom.

Before each read (the baseline's and the load's) the files' pages are dropped from the page
cache (``posix_fadvise(DONTNEED)``: written and fsynced pages are clean, no root needed), so
both read from the disk. Results: ``results/checkpoint_cpu.json`` and ``.png``.

    .venv/bin/python -m benchmarks.bench_checkpoint            # 10M rows: ~20 GiB RAM, 16 GB disk
    .venv/bin/python -m benchmarks.bench_checkpoint --quick    # 200k rows, seconds
"""
from __future__ import annotations

import gc
import io
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, Tuple

import torch
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from tqdm import tqdm

from benchmarks.common import (add_run_options, check, config_of, fill_defaults, git_state,
                               machine_info, new_parser, pyplot, report_stem, run_command,
                               save_figure, verdict, write_report)
from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig,
                    OptimizerType)
from dynemb.checkpoint import dump, load
from dynemb.checkpoint.file_dump import CHUNK_ROWS

DIM = 64
TARGET_RAW_FRACTION = 0.5    # dump and load at >= half the raw disk speed
TARGET_PEAK_CHUNKS = 2.0     # peak extra memory <= 2 chunks
TARGET_DELTA_TIME = 0.03     # a 1% delta in <= 3% of a full dump's time
SIZE_CAPACITY = 1 << 16      # the table of the size measurement
SIZE_FRACTIONS = (0.01, 0.1, 0.5, 0.7)  # its live rows, as fractions of the capacity
TARGET_SIZE_RATIO = 1.1      # every checkpoint <= 1.1x its live rows' bytes (1% full too)


def build(rows: int, capacity: int = 0) -> DynamicEmbCollection:
    capacity = capacity or -(-int(rows / 0.7) // 128) * 128
    options = DynamicEmbTableOptions(init_capacity=capacity, max_capacity=capacity)
    return DynamicEmbCollection(
        [EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=capacity,
                         feature_names=["f"])],
        table_options=options, optimizer=OptimizerConfig(OptimizerType.ADAM,
                                                         learning_rate=1e-3))


def train_ids(ec: DynamicEmbCollection, ids: torch.Tensor, batch: int, desc: str) -> None:
    """One training step per ``batch`` ids (each row gets an Adam update)."""
    for part in tqdm(ids.split(batch), desc=desc, leave=False):
        kjt = KeyedJaggedTensor.from_lengths_sync(["f"], part, torch.ones_like(part))
        ec(kjt)["f"].values().sum().backward()


# -- memory ----------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(fn: Callable[[], object]) -> Tuple[object, float, int]:
    """``fn()``'s result, seconds, and the peak resident bytes it added (VmHWM reset first
    through /proc/self/clear_refs; -1 where the kernel does not allow it)."""
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_kib("VmRSS")
    except OSError:
        before = None
    start = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - start
    peak = -1 if before is None else (_status_kib("VmHWM") - before) * 1024
    return out, seconds, peak


def drop_cached(root: Path) -> None:
    """Ask the kernel to drop the cached pages of every file under ``root``."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# -- raw baseline ----------------------------------------------------------------------------
def raw_write(path: Path, source: torch.Tensor, nbytes: int, chunk_bytes: int) -> None:
    """Write ``nbytes`` of ``source``'s memory to ``path`` in ``chunk_bytes`` writes, fsync."""
    flat = source.view(torch.uint8).reshape(-1)
    with open(path, "wb") as f:
        for lo in range(0, nbytes, chunk_bytes):
            f.write(memoryview(flat[lo:lo + chunk_bytes].numpy()))
        f.flush()
        os.fsync(f.fileno())


def raw_read(path: Path, target: torch.Tensor, chunk_bytes: int) -> None:
    """Read ``path`` back into ``target``'s memory in ``chunk_bytes`` reads."""
    flat = target.view(torch.uint8).reshape(-1)
    with open(path, "rb") as f:
        lo = 0
        while True:
            n = f.readinto(memoryview(flat[lo:lo + chunk_bytes].numpy()))
            if not n:
                break
            lo += n


# -- checkpoint bytes against live bytes -----------------------------------------------------
def _dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def checkpoint_sizes(seed: int, work_dir) -> Dict:
    """Bytes of a ``state_dict`` (``torch.save``), a DCP directory and a full dump of one
    table of ``SIZE_CAPACITY`` slots at each of ``SIZE_FRACTIONS`` full, against its live
    rows' bytes (rows with their optimizer state, plus an 8-byte key and score each)."""
    import torch.distributed.checkpoint as dcp
    out = []
    gen = torch.Generator().manual_seed(seed)
    for fraction in SIZE_FRACTIONS:
        ec = build(0, SIZE_CAPACITY)
        n = int(fraction * SIZE_CAPACITY)
        ids = torch.randint(0, 1 << 40, (2 * n,), generator=gen).unique()[:n]
        train_ids(ec, ids, 8192, f"fill {fraction:.0%}")
        table = ec.tables["t"]
        live = table.tier.hash.size()  # at 70% a few buckets overflow and evict
        check(live >= 0.99 * n, f"the table holds {live} rows of {n} ids")
        live_bytes = live * (table.row_layout.row_bytes + 16)
        buffer = io.BytesIO()
        torch.save(ec.state_dict(), buffer)
        root = Path(tempfile.mkdtemp(prefix="bench_checkpoint_", dir=work_dir))
        try:
            with warnings.catch_warnings():  # one process: DCP says it assumes so
                warnings.simplefilter("ignore")
                dcp.save(ec.state_dict(), checkpoint_id=str(root / "dcp"))
            dump(ec, root / "dump")
            sizes = {"state_dict": buffer.getbuffer().nbytes,
                     "dcp": _dir_bytes(root / "dcp"), "dump": _dir_bytes(root / "dump")}
        finally:
            shutil.rmtree(root, ignore_errors=True)
        out.append({"capacity": table.tier.hash.capacity, "live_rows": live,
                    "live_bytes": live_bytes, "bytes": sizes,
                    "ratio": {k: v / live_bytes for k, v in sizes.items()}})
    return {"tables": out,
            "worst_ratio": max(max(t["ratio"].values()) for t in out)}


# -- the run ---------------------------------------------------------------------------------
def run(args) -> Dict:
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(-2 ** 62, 2 ** 62, (args.rows,), generator=gen).unique()
    ec = build(args.rows)
    train_ids(ec, ids, args.batch, "fill")
    table = ec.tables["t"]
    rows = table.tier.hash.size()
    # at load 0.7 a few 128-slot buckets overflow and evict (the table's own semantics)
    check(rows >= 0.999 * ids.numel(), f"the table holds {rows} rows of {ids.numel()} ids")
    row_bytes = table.row_layout.row_bytes
    # a chunk is one data file: rows plus key, score and slot (8 bytes each) per entry
    file_row_bytes = row_bytes + 24
    chunk_bytes = args.chunk_rows * file_row_bytes
    root = Path(tempfile.mkdtemp(prefix="bench_checkpoint_", dir=args.work_dir))
    try:
        # raw writes before and after the dump (the disk's speed drifts): the baseline is
        # their mean; the raw write moves as many bytes as the dump's files hold
        payload = rows * file_row_bytes
        weights = table.tier.flat.weights
        nbytes = min(payload, weights.numel() * weights.element_size())
        _, raw_before_s, _ = measure(lambda: raw_write(root / "raw0.bin", weights, nbytes,
                                                       chunk_bytes))
        full, dump_s, dump_peak = measure(lambda: dump(ec, root / "full",
                                                        chunk_rows=args.chunk_rows))
        check(full.rows == rows, f"the dump wrote {full.rows} rows of {rows}")
        payload = full.bytes
        # a new file, as the dump's are (overwriting the first one measured faster)
        os.remove(root / "raw0.bin")
        _, raw_after_s, _ = measure(lambda: raw_write(root / "raw.bin", weights, nbytes,
                                                      chunk_bytes))
        raw_write_s = (raw_before_s + raw_after_s) / 2
        # 1% of the rows trained once more, then a delta
        changed = ids[torch.randperm(ids.numel(), generator=gen)[:max(1, int(
            args.changed * ids.numel()))]]
        train_ids(ec, changed, args.batch, "touch 1%")
        delta, delta_s, delta_peak = measure(lambda: dump(ec, root / "delta", since=full,
                                                          chunk_rows=args.chunk_rows))
        check(abs(delta.rows - changed.numel()) <= 0.001 * changed.numel() + 16,
              f"the delta holds {delta.rows} rows, {changed.numel()} changed")
        expected, found = ec.read_rows("t", ids[:1000], with_state=True)
        probe, expected = ids[:1000][found], expected[found].clone()
        raw_target = table.tier.flat.weights  # the baseline reads into the table's memory
        drop_cached(root)
        _, raw_read_s, _ = measure(lambda: raw_read(root / "raw.bin", raw_target, chunk_bytes))
        del ec, table, raw_target
        gc.collect()
        fresh = build(args.rows)
        drop_cached(root)
        loaded, load_s, load_peak = measure(lambda: load(fresh, [root / "full",
                                                                 root / "delta"]))
        got = fresh.read_rows("t", probe, with_state=True)[0]
        check(torch.equal(got, expected), "the loaded rows differ from the dumped ones")
        disk = shutil.disk_usage(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mb = payload / 1e6
    out = {
        "rows": rows, "row_bytes": row_bytes, "chunk_rows": args.chunk_rows,
        "chunk_bytes": chunk_bytes, "full_bytes": payload, "files": full.files,
        "dump": {"seconds": dump_s, "rows_per_s": rows / dump_s, "mb_per_s": mb / dump_s,
                 "peak_extra_bytes": dump_peak},
        "raw_write": {"seconds": raw_write_s, "mb_per_s": mb / raw_write_s,
                      "seconds_before_dump": raw_before_s, "seconds_after_dump": raw_after_s},
        "load": {"seconds": load_s, "rows_per_s": rows / load_s,
                 "mb_per_s": (payload + delta.bytes) / 1e6 / load_s,
                 "peak_extra_bytes": load_peak},
        "raw_read": {"seconds": raw_read_s, "mb_per_s": mb / raw_read_s},
        "delta": {"rows": delta.rows, "bytes": delta.bytes, "seconds": delta_s,
                  "peak_extra_bytes": delta_peak,
                  "bytes_fraction": delta.bytes / payload, "time_fraction": delta_s / dump_s},
        "disk_free_bytes": disk.free,
    }
    out["sizes"] = checkpoint_sizes(args.seed, args.work_dir)
    out["ratios"] = {"dump_vs_raw_write": raw_write_s / dump_s,
                     "dump_vs_faster_raw_write": min(raw_before_s, raw_after_s) / dump_s,
                     "load_vs_raw_read": raw_read_s * (payload + delta.bytes) / payload / load_s,
                     "dump_peak_chunks": dump_peak / chunk_bytes,
                     "load_peak_chunks": load_peak / chunk_bytes,
                     "delta_time_fraction": delta_s / dump_s}
    out["targets"] = {
        "dump >= 0.5 raw write": out["ratios"]["dump_vs_raw_write"] >= TARGET_RAW_FRACTION,
        "load >= 0.5 raw read": out["ratios"]["load_vs_raw_read"] >= TARGET_RAW_FRACTION,
        "dump peak <= 2 chunks": 0 <= out["ratios"]["dump_peak_chunks"] <= TARGET_PEAK_CHUNKS,
        "load peak <= 2 chunks": 0 <= out["ratios"]["load_peak_chunks"] <= TARGET_PEAK_CHUNKS,
        "1% delta <= 3% of a full dump's time":
            out["ratios"]["delta_time_fraction"] <= TARGET_DELTA_TIME,
        "checkpoints <= 1.1x the live rows' bytes":
            out["sizes"]["worst_ratio"] <= TARGET_SIZE_RATIO,
    }
    return out


def plot(report: Dict, path: Path) -> None:
    r = report["result"]
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["dump", "raw write", "load", "raw read"]
    values = [r["dump"]["mb_per_s"], r["raw_write"]["mb_per_s"], r["load"]["mb_per_s"],
              r["raw_read"]["mb_per_s"]]
    ax1.bar(names, values, color=["C0", "C7", "C1", "C7"])
    ax1.set_ylabel("MB/s")
    ax1.set_title(f"{r['rows']:,} rows x {r['row_bytes']} B ({r['full_bytes'] / 1e9:.2f} GB)")
    ax2.bar(["full dump", "1% delta"], [r["dump"]["seconds"], r["delta"]["seconds"]],
            color=["C0", "C2"])
    ax2.set_ylabel("seconds")
    ax2.set_title(f"delta: {100 * r['delta']['bytes_fraction']:.2f}% of the bytes, "
                  f"{100 * r['delta']['time_fraction']:.2f}% of the time")
    save_figure(fig, path)


def main(argv=None) -> Dict:
    parser = new_parser(__doc__)
    parser.add_argument("--rows", type=int, help="rows in the table (default 10M; quick 200k)")
    parser.add_argument("--batch", type=int, help="ids per training step while filling")
    parser.add_argument("--chunk-rows", type=int, default=CHUNK_ROWS,
                        help=f"entries per data file (default {CHUNK_ROWS})")
    parser.add_argument("--changed", type=float, default=0.01,
                        help="fraction of rows trained again before the delta")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where the files go (default: the system temp dir)")
    add_run_options(parser, "200k rows, seconds")
    args = parser.parse_args(argv)
    fill_defaults(args, {"rows": 200_000, "batch": 100_000},
                  {"rows": 10_000_000, "batch": 1_000_000})
    if args.quick and args.chunk_rows == CHUNK_ROWS:
        args.chunk_rows = 1 << 16
    torch.manual_seed(args.seed)
    result = run(args)
    report = {"benchmark": "checkpoint", "machine": machine_info(git_state(), ["safetensors"]),
              "config": config_of(args), "result": result}
    r = result
    print(f"{r['rows']:,} rows of {r['row_bytes']} B, files of {r['chunk_rows']:,} rows")
    for name in ("dump", "raw_write", "load", "raw_read"):
        line = f"  {name:9s} {r[name]['seconds']:7.2f} s  {r[name]['mb_per_s']:8.0f} MB/s"
        if "peak_extra_bytes" in r[name]:
            line += (f"  peak +{r[name]['peak_extra_bytes'] / 2**20:7.0f} MiB "
                     f"({r[name]['peak_extra_bytes'] / r['chunk_bytes']:.2f} chunks)")
        print(line)
    d = r["delta"]
    print(f"  delta     {d['seconds']:7.2f} s  {d['rows']:,} rows, {d['bytes'] / 1e6:.1f} MB "
          f"({100 * d['bytes_fraction']:.2f}% of the bytes, {100 * d['time_fraction']:.2f}% "
          f"of the time)")
    for t in r["sizes"]["tables"]:
        print(f"  {t['live_rows']:7,} of {t['capacity']:,} rows live ({t['live_bytes'] / 1e6:.2f} "
              f"MB): " + ", ".join(f"{k} {v / 1e6:.2f} MB ({t['ratio'][k]:.2f}x)"
                                   for k, v in t["bytes"].items()))
    for name, ok in r["targets"].items():
        print(f"  {verdict(ok)} {name}")
    write_report(report, args.out_dir, report_stem("checkpoint_cpu", args.quick), plot)
    return report


if __name__ == "__main__":
    run_command(main)
