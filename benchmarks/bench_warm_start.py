"""Warm start and ``write_rows`` on the CPU: the rows of a TorchRec ``EmbeddingCollection``
table put into a ``DynamicEmbCollection`` by ``dynemb.warm_start`` (HBM_DIRECT; CACHE, whose
rows beyond the cache go to its backing store), then all of them written again by
``write_rows`` (every id held: overwrites), against the static table's own import in the same
run: TorchRec's ``EmbeddingCollection.load_state_dict`` of the same rows.

Each method runs once untimed (numba loads its kernels), then ``--repeats`` times on a fresh
module (building it is not timed); the
report gives each one's median seconds, rows per second and its ratio to the baseline's
median. Every warm start is checked: a sample of ids reads back its row bit for bit, or the
run is not reported.

Run from the repository root::

    .venv/bin/python -m benchmarks.bench_warm_start            # 1M rows of dim 64 (~1 minute)
    .venv/bin/python -m benchmarks.bench_warm_start --quick    # seconds-long smoke run

Writes ``<out-dir>/warm_start_cpu.json`` and ``.png`` (seconds per method, the baseline's
beside them).
"""
from __future__ import annotations

import gc
import statistics
import time
from typing import Callable, Dict, List

import torch
from torchrec import EmbeddingCollection, EmbeddingConfig
from tqdm import tqdm

import dynemb
from benchmarks.common import (add_run_options, check, config_of, fill_defaults, git_state,
                               machine_info, new_parser, pyplot, report_stem, run_command,
                               save_figure, write_report)
from dynemb import DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig, OptimizerType

BASELINE = "torchrec_load_state_dict"
LABELS = {
    BASELINE: "TorchRec EmbeddingCollection.load_state_dict (the baseline)",
    "warm_start_hbm_direct": "dynemb.warm_start into HBM_DIRECT",
    "warm_start_cache": "dynemb.warm_start into CACHE (1/8 of the rows cached: the rest to "
                        "its store)",
    "overwrite_hbm_direct": "write_rows of every held id again (HBM_DIRECT)",
}


def config(rows: int, dim: int) -> EmbeddingConfig:
    return EmbeddingConfig(name="t", embedding_dim=dim, num_embeddings=rows,
                           feature_names=["f"])


def dynamic(rows: int, dim: int, cache: bool) -> DynamicEmbCollection:
    budget = (rows // 8) * dim * 4 if cache else None
    options = DynamicEmbTableOptions(caching=cache, local_hbm_for_values=budget)
    return DynamicEmbCollection([config(rows, dim)], table_options=options,
                                optimizer=OptimizerConfig(OptimizerType.SGD))


def methods(rows: int, dim: int, state: Dict[str, torch.Tensor]) -> Dict[str, Callable]:
    """Per method: a setup (untimed) returning the timed call and the module to check."""
    def torchrec():
        ec = EmbeddingCollection(tables=[config(rows, dim)])
        return (lambda: ec.load_state_dict(state)), None

    def warm(cache: bool):
        def setup():
            module = dynamic(rows, dim, cache)
            return (lambda: dynemb.warm_start(module, state)), module
        return setup

    def overwrite():
        module = dynamic(rows, dim, False)
        dynemb.warm_start(module, state)
        weight = state["embeddings.t.weight"]
        keys = torch.arange(rows)
        return (lambda: module.write_rows("t", keys, weight)), module
    return {BASELINE: torchrec, "warm_start_hbm_direct": warm(False),
            "warm_start_cache": warm(True), "overwrite_hbm_direct": overwrite}


def run(args) -> dict:
    gen = torch.Generator().manual_seed(args.seed)
    weight = torch.rand(args.rows, args.dim, generator=gen)
    state = {"embeddings.t.weight": weight}
    sample = torch.randint(0, args.rows, (1000,), generator=gen)
    seconds: Dict[str, List[float]] = {}
    todo = methods(args.rows, args.dim, state)
    for setup in todo.values():  # a first run each, untimed: numba loads its kernels
        setup()[0]()
    with tqdm(total=len(todo) * args.repeats, desc="warm start") as bar:
        for repeat in range(args.repeats):
            for name, setup in todo.items():
                call, module = setup()
                gc.collect()
                start = time.perf_counter()
                call()
                seconds.setdefault(name, []).append(time.perf_counter() - start)
                if module is not None:
                    rows, found = module.read_rows("t", sample)
                    check(bool(found.all()) and torch.equal(rows, weight[sample]),
                          f"{name}: rows read back differ from the rows written")
                del module, call
                bar.update()
    base = statistics.median(seconds[BASELINE])
    results = [{"method": name, "label": LABELS[name], "seconds": times,
                "median_s": statistics.median(times),
                "rows_per_s": args.rows / statistics.median(times),
                "ratio_to_baseline": statistics.median(times) / base}
               for name, times in seconds.items()]
    return {"machine": machine_info(git_state(), ("torch", "torchrec", "numba")),
            "config": config_of(args), "results": results}


def plot(report: dict, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    rows = report["results"]
    ax.barh([r["method"] for r in rows], [r["median_s"] for r in rows],
            color=["grey"] + ["C0"] * (len(rows) - 1))
    for i, r in enumerate(rows):
        ax.text(r["median_s"], i, f"  {r['ratio_to_baseline']:.1f}x", va="center")
    cfg = report["config"]
    ax.set_xlabel(f"seconds for {cfg['rows']:,} rows of dim {cfg['dim']} (median of "
                  f"{cfg['repeats']})")
    ax.set_xlim(0, 1.15 * max(r["median_s"] for r in rows))  # room for the ratios
    ax.invert_yaxis()
    save_figure(fig, path)


def main(argv=None) -> dict:
    parser = new_parser(__doc__)
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    add_run_options(parser, "20,000 rows, 2 repeats")
    args = parser.parse_args(argv)
    fill_defaults(args, {"rows": 20_000, "dim": 32, "repeats": 2},
                  {"rows": 1_000_000, "dim": 64, "repeats": 3})
    report = run(args)
    for r in report["results"]:
        print(f"{r['method']:24s} {r['median_s']:8.3f} s  {r['rows_per_s'] / 1e6:7.2f} M rows/s"
              f"  {r['ratio_to_baseline']:6.2f}x the baseline")
    write_report(report, args.out_dir, report_stem("warm_start_cpu", args.quick), plot)
    return report


if __name__ == "__main__":
    run_command(main)
