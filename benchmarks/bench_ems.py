"""Embedding memory stashing (EMS): what a stash and a restore cost against a plain copy of the
same bytes, and what stashing does to a training step's time and to the device memory at the
forward -> backward turn, with and without stashing in the same run.

Run from the repository root::

    .venv/bin/python -m benchmarks.bench_ems             # full run (~2 minutes on 2 cores)
    .venv/bin/python -m benchmarks.bench_ems --quick     # seconds-long smoke run
    .venv/bin/python -m benchmarks.bench_ems --device cuda --sync-debug   # on a GPU

Two parts:

- **bandwidth**: a table's device rows (``--sizes-mib``) stashed and restored by
  ``TableStash`` (``ALL``: whole rows; ``VALUES``: the embedding columns, a strided copy),
  against ``copy_`` of the same bytes into a buffer allocated once (``memcpy reused``) and
  into new memory (``memcpy fresh``: a restore gives the rows new memory). On CUDA the copies
  run between the device and a pinned buffer, with ``torch.cuda.set_sync_debug_mode("error")``
  around every stash and restore under ``--sync-debug``.
- **step**: a model whose dense part (an MLP applied to every id's embedding) keeps large
  activations for backward, trained with and without stashing on the same batches, steps
  alternating. Device memory at the turn: on CUDA ``torch.cuda.max_memory_allocated`` per step;
  on CPU (host and "device" are the same memory) an account of what is live at the end of the
  dense forward: the table's row storage (and columns parked on the device), the hash table,
  and every tensor autograd saved for backward. Both models must give the same losses.

Writes ``<out-dir>/ems_<device>.json`` and ``.png`` (``ems_<device>_quick.*`` with
``--quick``).
"""
from __future__ import annotations

import gc
import statistics
import time
from typing import Dict, List, Optional

import torch

from benchmarks.common import (add_run_options, check, config_of, fill_defaults, git_state,
                               load_before_run, machine_info, new_parser, paired_ratios,
                               peak_rss_gib, pyplot, report_stem, run_command, save_figure,
                               spread, write_report)
from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig, OptimizerType)
from dynemb.rows.flat_table import RowLayout
from dynemb.options import StashMode, choose_storage_mode
from dynemb.stashing.table_stash import TableStash
from dynemb.stashing.transfers import transfers_for
from dynemb.tables.tier import Tier

QUICK = dict(sizes_mib=[4, 16], repeats=3, rows=1 << 14, dim=16, batch=64, length=8,
             hidden=64, layers=2, steps=4, warmup=1)
FULL = dict(sizes_mib=[64, 256, 512], repeats=7, rows=1 << 20, dim=32, batch=512, length=16,
            hidden=512, layers=3, steps=12, warmup=2)
STATE_PER_DIM = 2  # Adam: two moments per column


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sync_debug(on: bool):
    """``torch.cuda.set_sync_debug_mode("error")`` while inside (CUDA and ``--sync-debug``)."""
    class _Mode:
        def __enter__(self):
            if on:
                torch.cuda.set_sync_debug_mode("error")

        def __exit__(self, *exc):
            if on:
                torch.cuda.set_sync_debug_mode("default")
    return _Mode()


# -- bandwidth -------------------------------------------------------------------------------
def _tier(rows: int, dim: int, device: torch.device) -> Tier:
    options = DynamicEmbTableOptions()
    state = STATE_PER_DIM * dim
    layout = choose_storage_mode(options, name="t", num_embeddings=rows, width=dim + state,
                                 state_dim=state, config_dtype=torch.float32)
    return Tier(layout, layout.init_capacity, dim, state, options, device, None)


def _gbps(nbytes: int, seconds: List[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def bandwidth(cfg, device: torch.device) -> List[dict]:
    rows_out = []
    dim = cfg.dim
    row = RowLayout(dim, STATE_PER_DIM * dim)
    for size in cfg.sizes_mib:
        rows = max(128, (size << 20) // row.row_bytes // 128 * 128)
        tier = _tier(rows, dim, device)
        tier.flat.weights.normal_(generator=None)
        checksum = float(tier.flat.weights.double().sum())
        for mode in (StashMode.ALL, StashMode.VALUES):
            stash = TableStash("t", tier, mode, row, transfers_for(device))
            nbytes = stash.stashed_bytes
            stash_s, restore_s = [], []
            for rep in range(cfg.repeats + 1):
                sync(device)
                t0 = time.perf_counter()
                with _sync_debug(cfg.sync_debug):
                    check(stash.stash(), "the rows could not be stashed")
                sync(device)
                t1 = time.perf_counter()
                with _sync_debug(cfg.sync_debug):
                    stash.restore()
                sync(device)
                t2 = time.perf_counter()
                if rep:  # the first round allocates the host buffer
                    stash_s.append(t1 - t0)
                    restore_s.append(t2 - t1)
            check(float(tier.flat.weights.double().sum()) == checksum,
                  f"{size} MiB {mode.value}: the rows changed across stash and restore")
            part = (tier.flat.weights if mode is StashMode.ALL
                    else tier.flat.weights[:, :row.embedding_columns].contiguous())
            reused_s, fresh_s = _memcpy_times(part, cfg.repeats, device)
            del part
            rows_out.append({
                "size_mib": nbytes / 2**20, "rows": rows, "mode": mode.value, "bytes": nbytes,
                "stash_s": stash_s, "restore_s": restore_s,
                "memcpy_reused_s": reused_s, "memcpy_fresh_s": fresh_s,
                "stash_gbps": _gbps(nbytes, stash_s), "restore_gbps": _gbps(nbytes, restore_s),
                "memcpy_reused_gbps": _gbps(nbytes, reused_s),
                "memcpy_fresh_gbps": _gbps(nbytes, fresh_s),
                "stash_vs_memcpy": statistics.median(stash_s) / statistics.median(reused_s),
                "restore_vs_memcpy_fresh": (statistics.median(restore_s)
                                            / statistics.median(fresh_s)),
            })
        del tier
        gc.collect()
    return rows_out


def _memcpy_times(src: torch.Tensor, repeats: int, device: torch.device):
    """``copy_`` of ``src`` into a buffer made once, and into new memory each time (on CUDA:
    device to pinned host, and host to new device memory)."""
    on_gpu = device.type == "cuda"
    host = torch.empty(src.shape, dtype=src.dtype, pin_memory=on_gpu)
    reused, fresh = [], []
    for rep in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        host.copy_(src, non_blocking=on_gpu)
        sync(device)
        t1 = time.perf_counter()
        back = torch.empty(src.shape, dtype=src.dtype, device=device)
        back.copy_(host, non_blocking=on_gpu)
        sync(device)
        t2 = time.perf_counter()
        del back
        if rep:
            reused.append(t1 - t0)
            fresh.append(t2 - t1)
    return reused, fresh


# -- training step ---------------------------------------------------------------------------
class EmsModel(torch.nn.Module):
    """One dynamic table (Adam) and an MLP applied to every id's embedding, so the dense
    forward keeps ``layers`` x [ids, hidden] activations for backward."""

    def __init__(self, cfg, stash: StashMode, device: torch.device):
        super().__init__()
        from torchrec import EmbeddingConfig
        self.emb = DynamicEmbCollection(
            [EmbeddingConfig(name="t", embedding_dim=cfg.dim, num_embeddings=cfg.rows,
                             feature_names=["f"])], device,
            table_options=DynamicEmbTableOptions(stash=stash, max_capacity=cfg.rows),
            optimizer=OptimizerConfig(OptimizerType.ADAM, learning_rate=1e-3),
            validate_inputs=device.type != "cuda")
        layers: List[torch.nn.Module] = []
        width = cfg.dim
        for _ in range(cfg.layers):
            layers += [torch.nn.Linear(width, cfg.hidden), torch.nn.ReLU()]
            width = cfg.hidden
        layers.append(torch.nn.Linear(width, 1))
        self.mlp = torch.nn.Sequential(*layers).to(device)

    def forward(self, kjt):
        return self.mlp(self.emb(kjt)["f"].values()).pow(2).mean()


def table_device_bytes(model: EmsModel) -> int:
    """Bytes of the table on the device now, read without restoring stashed rows."""
    table = model.emb.tables["t"]
    stash = model.emb.memory_stash
    if stash is None:
        rows = table.tier.flat.weights.untyped_storage().nbytes()
    else:
        rows = sum(s.device_bytes() + s.parked_bytes for s in stash.table_stashes().values())
    return rows + table.tier.hash.nbytes()


def timed_step(model: EmsModel, kjt, dense_opt, device: torch.device):
    """(loss, seconds, device bytes at the forward -> backward turn) of one step."""
    saved: Dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    t0 = time.perf_counter()
    dense_opt.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(kjt)
    turn = table_device_bytes(model) + sum(saved.values())  # the CPU account
    loss.backward()
    dense_opt.step()
    sync(device)
    seconds = time.perf_counter() - t0
    if device.type == "cuda":
        turn = torch.cuda.max_memory_allocated(device)
    return float(loss.detach()), seconds, turn


def step_times(cfg, device: torch.device) -> dict:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    models = {}
    for name, stash in (("plain", StashMode.NONE), ("stash", StashMode.ALL)):
        torch.manual_seed(cfg.seed)
        model = EmsModel(cfg, stash, device)
        models[name] = (model, torch.optim.SGD(model.mlp.parameters(), lr=1e-3))
    gen = torch.Generator().manual_seed(cfg.seed)
    ids_per_batch = cfg.batch * cfg.length
    out = {name: {"step_s": [], "turn_bytes": [], "losses": []} for name in models}
    for step in range(cfg.warmup + cfg.steps):
        ids = torch.randint(0, cfg.rows // 2, (ids_per_batch,), generator=gen).to(device)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            ["f"], ids, torch.full((cfg.batch,), cfg.length, device=device))
        order = ("plain", "stash") if step % 2 == 0 else ("stash", "plain")
        for name in order:
            model, opt = models[name]
            loss, seconds, turn = timed_step(model, kjt, opt, device)
            if step >= cfg.warmup:
                out[name]["step_s"].append(seconds)
                out[name]["turn_bytes"].append(turn)
            out[name]["losses"].append(loss)
    check(out["plain"]["losses"] == out["stash"]["losses"],
          "training with stashing gave other losses than without")
    stash = models["stash"][0].emb.memory_stash.table_stashes()["t"]
    stashed = stash.stashed_bytes
    peak = {name: max(v["turn_bytes"]) for name, v in out.items()}
    return {
        "table_bytes": stashed, "ids_per_batch": ids_per_batch,
        "step_ms": {n: [s * 1e3 for s in v["step_s"]] for n, v in out.items()},
        "median_ms": {n: statistics.median(v["step_s"]) * 1e3 for n, v in out.items()},
        "spread_ms": {n: spread([s * 1e3 for s in v["step_s"]]) for n, v in out.items()},
        "overhead": paired_ratios(out["stash"]["step_s"], out["plain"]["step_s"]),
        "turn_peak_bytes": peak,
        "peak_reduction_bytes": peak["plain"] - peak["stash"],
        "peak_reduction_of_stashed": (peak["plain"] - peak["stash"]) / stashed,
        "peak_account": "torch.cuda.max_memory_allocated" if device.type == "cuda" else
                        "rows + parked columns + hash table + tensors saved for backward",
        "stashes": stash.stashes, "restores": stash.restores,
    }


# -- report ----------------------------------------------------------------------------------
def plot(report: dict, path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode, marker in (("all", "o"), ("values", "s")):
        rows = [r for r in report["bandwidth"] if r["mode"] == mode]
        sizes = [r["size_mib"] for r in rows]
        for key, label in (("stash_gbps", "stash"), ("restore_gbps", "restore"),
                           ("memcpy_reused_gbps", "memcpy (reused)"),
                           ("memcpy_fresh_gbps", "memcpy (fresh)")):
            left.plot(sizes, [r[key] for r in rows], marker=marker,
                      label=f"{label}, {mode}")
    left.set_xscale("log", base=2)
    left.set_xlabel("bytes moved (MiB)")
    left.set_ylabel("GB/s (median)")
    left.set_title(f"stash / restore vs memcpy ({report['device']})")
    left.legend(fontsize=7)
    step = report["step"]
    names = ["plain", "stash"]
    right.bar([0, 1], [step["median_ms"][n] for n in names], color=["#888", "#3a7"])
    right.set_xticks([0, 1], ["no stashing", "stashing"])
    right.set_ylabel("step time, median (ms)")
    twin = right.twinx()
    twin.plot([0, 1], [step["turn_peak_bytes"][n] / 2**20 for n in names], "kD-")
    twin.set_ylabel("device MiB at the forward -> backward turn")
    right.set_title(f"overhead {step['overhead']['median']:.2f}x, peak -"
                    f"{step['peak_reduction_bytes'] / 2**20:.0f} MiB "
                    f"({step['peak_reduction_of_stashed']:.0%} of stashed)")
    save_figure(fig, path)


def main(argv: Optional[List[str]] = None) -> dict:
    parser = new_parser(__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes-mib", type=int, nargs="+")
    for name in ("repeats", "rows", "dim", "batch", "length", "hidden", "layers", "steps",
                 "warmup"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--sync-debug", action="store_true",
                        help="CUDA: set_sync_debug_mode('error') around each stash and restore")
    add_run_options(parser, "tiny sizes, a few steps")
    args = parser.parse_args(argv)
    fill_defaults(args, QUICK, FULL)
    device = torch.device(args.device)
    check(not args.sync_debug or device.type == "cuda", "--sync-debug needs --device cuda")
    git = git_state()
    load = load_before_run()
    report = {"config": config_of(args), "device": str(device), "load_before": load}
    report["bandwidth"] = bandwidth(args, device)
    report["step"] = step_times(args, device)
    report["peak_rss_gib"] = peak_rss_gib()
    report["machine"] = machine_info(git, packages=["torchrec"])  # after the kernels ran
    _print(report)
    write_report(report, args.out_dir, report_stem(f"ems_{device.type}", args.quick), plot)
    return report


def _print(report: dict) -> None:
    print(f"{'MiB':>7} {'mode':>6} {'stash GB/s':>10} {'restore':>8} {'memcpy':>7} "
          f"{'fresh':>6} {'stash/memcpy':>12} {'restore/fresh':>13}")
    for r in report["bandwidth"]:
        print(f"{r['size_mib']:7.1f} {r['mode']:>6} {r['stash_gbps']:10.2f} "
              f"{r['restore_gbps']:8.2f} {r['memcpy_reused_gbps']:7.2f} "
              f"{r['memcpy_fresh_gbps']:6.2f} {r['stash_vs_memcpy']:12.2f} "
              f"{r['restore_vs_memcpy_fresh']:13.2f}")
    step = report["step"]
    print(f"step: {step['median_ms']['plain']:.1f} ms without stashing, "
          f"{step['median_ms']['stash']:.1f} ms with (paired ratio "
          f"{step['overhead']['median']:.3f}); device at the turn "
          f"{step['turn_peak_bytes']['plain'] / 2**20:.1f} -> "
          f"{step['turn_peak_bytes']['stash'] / 2**20:.1f} MiB, "
          f"{step['peak_reduction_of_stashed']:.0%} of the {step['table_bytes'] / 2**20:.1f} "
          f"MiB stashed ({step['peak_account']})")


if __name__ == "__main__":
    run_command(main)
