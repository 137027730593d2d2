"""What padding each table's unique keys to its input count costs on the host kernels, against
exact unique keys, in one run on the same batches.

A table group's phases take one form of deduplicated keys on both kernel backends
(``dedup_segments``): each table's unique keys start where its keys start and are padded
with ``EMPTY_KEY`` (count 0, no slot) to its number of keys. CUDA needs that form (the sizes
are known from the input, nothing is read back); the host kernels could take exact unique
keys instead. This benchmark times, per step, the phases whose length is the number of
unique keys -- the dedup, the claim (``find_or_insert_group``), the claim's counters
(``add_claim_counts``), the new rows' initializer, the occurrence CSR and the fused SGD
update -- over exact and over padded keys, alternating the two forms step by step on the
same Zipf batches, and reports the padded / exact ratio of the medians. The embeddings
updated must be the same in both forms (else the run is refused).

Run from the repository root::

    .venv/bin/python -m benchmarks.bench_dedup_form            # ~1 minute
    .venv/bin/python -m benchmarks.bench_dedup_form --quick    # seconds

Writes ``<out-dir>/dedup_form_cpu.json`` and ``.png``.
"""
from __future__ import annotations

import statistics
import time
from typing import Dict, List

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.common import (add_run_options, check, config_of, fill_defaults, git_state,
                               machine_info, new_parser, pyplot, report_stem, run_command,
                               save_figure, write_report, zipf_ranks)
from dynemb.backends.numba_backends import get_backend
from dynemb.backends.protocol import Segments, TableArrays
from dynemb.kernels import groups_cpu
from dynemb.rows.optimizers import OccurrenceGrads, OptimizerConfig, fused_update
from dynemb.types import EMPTY_KEY, ScorePolicy

QUICK = dict(tables=[1, 26], ids=8192, steps=4)
FULL = dict(tables=[1, 26, 128], ids=65536, steps=12)
DIM = 32
BUCKET = 128


class Group:
    """Arrays of ``tables`` tables of ``capacity`` slots each, as a group lays them out."""

    def __init__(self, tables: int, capacity: int):
        self.kernels = get_backend("cpu")
        rows = tables * capacity
        self.arrays = TableArrays.empty(rows, BUCKET, torch.device("cpu"),
                                        torch.zeros(tables, dtype=torch.int64))
        self.weights = torch.zeros(rows, DIM)
        self.row_offset = torch.arange(tables, dtype=torch.int64) * capacity
        self.num_buckets = torch.full((tables,), capacity // BUCKET, dtype=torch.int64)
        self.counters = torch.zeros(tables, 6, dtype=torch.int64)
        self.clock = 0

    def step(self, keys: torch.Tensor, key_bounds: np.ndarray, pad: bool):
        """One step's phases over exact or padded unique keys; returns (unique keys, their
        slots): the rows updated are those of the keys not ``EMPTY_KEY`` (picked out after
        the timing: the check is not part of a step)."""
        kernels, n = self.kernels, keys.numel()
        tables = len(key_bounds) - 1
        unique, inverse, counts = (torch.empty(n, dtype=torch.int64) for _ in range(3))
        bounds = np.empty(tables + 1, dtype=np.int64)
        total = groups_cpu.dedup_segments_cpu(keys.numpy(), key_bounds,
                                              self.num_buckets.numpy(), pad, unique.numpy(),
                                              inverse.numpy(), counts.numpy(), bounds)
        unique, counts = unique[:total], counts[:total]
        segments = Segments(bounds)
        slots, prev_keys, prev_scores = (torch.empty_like(unique) for _ in range(3))
        inserted, failed = (torch.empty(total, dtype=torch.bool) for _ in range(2))
        self.clock += 1
        clocks = torch.full((tables,), self.clock, dtype=torch.int64)
        kernels.find_or_insert_group(
            self.arrays, self.arrays.size, segments, self.row_offset, self.num_buckets,
            unique, counts, unique.new_zeros(1).expand(unique.shape),
            ScorePolicy.LFU_LRU.code, clocks, True, slots, inserted, prev_keys, prev_scores,
            failed)
        kernels.add_claim_counts(segments, unique, slots, inserted, prev_keys, None,
                                 self.counters)
        ones = torch.ones(tables, dtype=torch.float64)
        kernels.init_rows_at_group(self.weights, slots, unique, inserted, segments, DIM,
                                   torch.zeros(tables, dtype=torch.int64),
                                   torch.arange(tables, dtype=torch.int64),
                                   torch.zeros(tables, dtype=torch.int64), ones * 0.0,
                                   ones * 0.1, ones * -1.0, ones)
        grads = OccurrenceGrads.from_inverse(torch.ones(n, DIM), inverse, total, clip=None,
                                             kernels=kernels)
        fused_update(self.weights, slots, grads, dim=DIM, config=OptimizerConfig(), lr=0.01,
                     step=self.clock, kernels=kernels, keys=unique,
                     stochastic_rounding=False)
        kernels.add_refcounts(self.arrays, slots, -1)
        return unique, slots


def run(args) -> Dict:
    rng = np.random.default_rng(args.seed)
    results: List[Dict] = []
    for tables in tqdm(args.tables, desc="tables"):
        per_table = args.ids // tables
        id_space = 4 * per_table
        capacity = max(BUCKET, 1 << int(np.ceil(np.log2(2 * id_space))))
        forms = {pad: Group(tables, capacity) for pad in (False, True)}
        times: Dict[bool, List[float]] = {False: [], True: []}
        unique_share = []
        for step in range(args.steps + 2):
            keys = torch.from_numpy(np.concatenate([
                zipf_ranks(rng, per_table, 1.05, id_space) for _ in range(tables)]))
            key_bounds = np.arange(tables + 1, dtype=np.int64) * per_table
            order = (False, True) if step % 2 == 0 else (True, False)  # alternate
            slots = {}
            for pad in order:
                start = time.perf_counter()
                unique, claimed = forms[pad].step(keys, key_bounds, pad)
                if step >= 2:  # two warm-up steps: compiles, first inserts
                    times[pad].append((time.perf_counter() - start) * 1e3)
                slots[pad] = claimed[unique != EMPTY_KEY]
            check(torch.equal(slots[False].sort().values, slots[True].sort().values),
                  f"T={tables} step {step}: the two forms claimed different slots")
            unique_share.append(len(slots[False]) / keys.numel())
        check(torch.equal(forms[False].weights, forms[True].weights),
              f"T={tables}: the two forms trained different rows")
        exact, padded = statistics.median(times[False]), statistics.median(times[True])
        results.append(dict(tables=tables, ids=per_table * tables,
                            unique_share=statistics.mean(unique_share),
                            exact_ms=exact, padded_ms=padded, padded_over_exact=padded / exact,
                            exact_steps_ms=times[False], padded_steps_ms=times[True]))
        print(f"T={tables:4d}  unique {statistics.mean(unique_share):.0%} of the ids  "
              f"exact {exact:7.2f} ms  padded {padded:7.2f} ms  padded/exact "
              f"{padded / exact:.2f}")
    return dict(config=config_of(args), machine=machine_info(git_state()), results=results)


def plot(report: Dict, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    rows = report["results"]
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["exact_ms"] for r in rows], 0.4, label="exact unique keys")
    ax.bar(x + 0.2, [r["padded_ms"] for r in rows], 0.4, label="padded to the input")
    ax.set_xticks(x, [f"T={r['tables']}\n{r['padded_over_exact']:.2f}x" for r in rows])
    ax.set_ylabel("ms per step (median)")
    ax.set_title("dedup form on the host kernels: the phases of one step")
    ax.legend()
    save_figure(fig, path)


def main(argv=None) -> Dict:
    parser = new_parser(__doc__)
    parser.add_argument("--tables", type=int, nargs="+")
    parser.add_argument("--ids", type=int, help="ids per step, over all tables")
    parser.add_argument("--steps", type=int, help="timed steps per form")
    add_run_options(parser, "seconds-long smoke run")
    args = parser.parse_args(argv)
    fill_defaults(args, QUICK, FULL)
    report = run(args)
    write_report(report, args.out_dir, report_stem("dedup_form_cpu", args.quick), plot)
    return report


if __name__ == "__main__":
    run_command(main)
