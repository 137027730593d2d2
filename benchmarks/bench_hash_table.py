"""CPU throughput of ``ScoredHashTable.find`` / ``find_or_insert`` against a Python dict and
``torch.searchsorted``, measured in the same run on the same keys.

Run from the repository root::

    .venv/bin/python -m benchmarks.bench_hash_table            # full run (capacities 2^20..2^24)
    .venv/bin/python -m benchmarks.bench_hash_table --quick    # seconds-long smoke run

Writes ``<out-dir>/hash_table_cpu.json`` and ``.png`` (``hash_table_cpu_quick.*`` with
``--quick``) and prints a table plus PASS/FAIL lines for the throughput targets. Every timed
result is checked against the expected slots first; a mismatch aborts the run (nothing written).

The tables run the LRU policy; the find_or_insert rows are also timed for the other
``--policies`` (default: LFU_LRU) on a copy of each table with the same keys in the same slots,
as rows ``dynemb-<policy>``, with their ratio to LRU (``vs_lru``).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numba
import numpy as np
import torch
from tqdm import tqdm

from benchmarks.common import (ALL_THREADS, add_run_options, check, config_of, fill_defaults,
                               format_optional, git_state, machine_info, new_parser,
                               peak_rss_gib, pyplot, report_stem, run_command, save_figure,
                               verdict, write_report)
from dynemb import ScorePolicy
from dynemb.rows.hash_table import ScoredHashTable
from dynemb.types import pack_lfu_lru

FILE_STEM = "hash_table_cpu"
#: Keys per fill call: at most 2^20 and an eighth of the capacity, so that no bucket receives
#: more keys in one call than it has slots (keys of one call never evict each other).
FILL_CHUNK = 1 << 20
FILL_CHUNK_FRACTION = 8
#: The eviction scenario first inserts this many keys per slot, so (nearly) every bucket is full.
EVICT_OVERFILL = 1.25
#: Keys of the eviction batch per slot: low enough that no bucket receives more new keys than it
#: has slots (keys of one call never evict each other).
EVICT_BATCH_FRACTION = 0.25
KEY_RANGE = (-(2**62), 2**62)  # signed keys, far from the reserved EMPTY/TOMBSTONE keys

OP_HELP = {
    "find_hit": "find, every key present",
    "find_miss50": "find, half the keys absent",
    "insert_unique": "find_or_insert of absent keys, assume_unique=True",
    "insert_dedup": "find_or_insert of absent keys, default path (dedup pass)",
    "insert_evict": "find_or_insert of absent keys into full buckets (every insert evicts)",
}
TARGET_CAPACITY_LOG2 = 22
TARGET_LOAD = 0.5


@dataclass
class Row:
    """One measurement: an implementation running one operation on one table."""

    capacity_log2: int
    load_target: Optional[float]  # None for the eviction scenario (table full)
    load: float  # size / capacity of the table the operation ran on
    op: str
    impl: str  # "dynemb", "dynemb-serial-kernel", "dynemb-<policy>", "dict" or "searchsorted"
    threads: int
    keys: int  # keys per timed call
    seconds: float  # median over the repeats
    mkeys_per_s: float  # keys / seconds, in millions
    times_s: List[float]  # every timed repeat, to judge the noise
    evicted: Optional[int] = None
    dict_entries: Optional[int] = None


# -- keys ------------------------------------------------------------------------------------
def unique_random_keys(n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` distinct random int64 keys in ``KEY_RANGE``, in random order."""
    keys = torch.empty(0, dtype=torch.int64)
    while keys.numel() < n:
        more = torch.randint(*KEY_RANGE, (n - keys.numel(),), generator=gen)
        keys = torch.unique(torch.cat([keys, more]))
    return keys[torch.randperm(n, generator=gen)]


class KeyStream:
    """Hands out consecutive, never repeated keys of a pool, so tables, misses and new keys are
    disjoint by construction."""

    def __init__(self, pool: torch.Tensor):
        self._pool = pool
        self._next = 0

    def take(self, n: int) -> torch.Tensor:
        check(self._next + n <= self._pool.numel(), "key pool exhausted; raise its size")
        out = self._pool[self._next:self._next + n]
        self._next += n
        return out


def pool_size(capacity: int, batch: int) -> int:
    """Keys one capacity's scenarios can consume (fills with evictions, misses, new keys)."""
    return int(max(1.3, EVICT_OVERFILL + EVICT_BATCH_FRACTION) * capacity) + 2 * batch


# -- timing ----------------------------------------------------------------------------------
@contextlib.contextmanager
def thread_count(n: int) -> Iterator[None]:
    """Run numba's parallel kernels and torch on ``n`` threads inside the block."""
    old_numba, old_torch = numba.get_num_threads(), torch.get_num_threads()
    numba.set_num_threads(n)
    torch.set_num_threads(n)
    try:
        yield
    finally:
        numba.set_num_threads(old_numba)
        torch.set_num_threads(old_torch)


def time_calls(fn: Callable, repeats: int, setup: Optional[Callable] = None):
    """Seconds of ``repeats`` calls of ``fn(setup())`` (or ``fn()``) after one warm-up call
    (numba compiles on first use), and the last call's output. ``setup`` is not timed."""
    def once():
        arg = () if setup is None else (setup(),)
        start = time.perf_counter()
        out = fn(*arg)
        return time.perf_counter() - start, out

    once()
    times, out = [], None
    for _ in range(repeats):
        seconds, out = once()
        times.append(seconds)
    return times, out


# -- tables and baselines --------------------------------------------------------------------
def fill_chunk(table: ScoredHashTable) -> int:
    """Keys per insert call while filling (see ``FILL_CHUNK``)."""
    return min(FILL_CHUNK, table.capacity // FILL_CHUNK_FRACTION)


def fill(table: ScoredHashTable, stream: KeyStream, target_size: int) -> None:
    """Insert fresh keys in chunks until the table holds ``target_size`` keys (inserts into full
    buckets evict, so this may take more keys than ``target_size``)."""
    chunk = fill_chunk(table)
    while table.size() < target_size:
        n = min(chunk, target_size - table.size())
        table.find_or_insert(stream.take(n), assume_unique=True)


def overfill(table: ScoredHashTable, stream: KeyStream) -> None:
    """Insert ``EVICT_OVERFILL * capacity`` fresh keys so that the buckets are full."""
    total, chunk = int(EVICT_OVERFILL * table.capacity), fill_chunk(table)
    for start in range(0, total, chunk):
        table.find_or_insert(stream.take(min(chunk, total - start)), assume_unique=True)


def live_entries(table: ScoredHashTable) -> Tuple[torch.Tensor, torch.Tensor]:
    """(keys, slots) of every key in the table."""
    batch = table.export()
    check(batch.keys.numel() == table.size(), "export() and size() disagree")
    return batch.keys, batch.slots


class Baselines:
    """A dict (key -> slot) and sorted keys for ``torch.searchsorted`` holding the table's keys."""

    def __init__(self, keys: torch.Tensor, slots: torch.Tensor):
        self.dict = dict(zip(keys.tolist(), slots.tolist()))
        self.sorted_keys, order = torch.sort(keys)
        self.sorted_slots = slots[order]

    def searchsorted_find(self, queries: torch.Tensor) -> torch.Tensor:
        """Slot of each query or -1: binary search, gather, equality check."""
        pos = torch.searchsorted(self.sorted_keys, queries).clamp_(max=self.sorted_keys.numel() - 1)
        found = self.sorted_keys[pos] == queries
        return torch.where(found, self.sorted_slots[pos], -1)

    def dict_find(self, queries: List[int]) -> List[int]:
        """Slot of each query or -1."""
        d = self.dict
        return [d.get(k, -1) for k in queries]

    def dict_insert(self, new_keys: List[int]) -> List[int]:
        """Slot of each key, giving absent keys the next free slot."""
        d = self.dict
        return [d.setdefault(k, len(d)) for k in new_keys]

    def dict_discard(self, keys: List[int]) -> None:
        """Remove ``keys`` where present (undoes :meth:`dict_insert`)."""
        d = self.dict
        for k in keys:
            d.pop(k, None)


# -- scenarios -------------------------------------------------------------------------------
@dataclass
class Scenario:
    """A filled table and its baselines; ``add`` records a row for it."""

    capacity_log2: int
    load_target: Optional[float]
    table: ScoredHashTable
    baselines: Baselines
    repeats: int
    dict_keys: int
    rows: List[Row]
    #: the table under other policies (same keys, same slots), for the find_or_insert rows
    twins: Dict[str, ScoredHashTable]

    def add(self, op, impl, threads, keys, times, evicted=None, dict_entries=None) -> None:
        seconds = statistics.median(times)
        self.rows.append(Row(self.capacity_log2, self.load_target, self.table.load_factor(), op,
                             impl, threads, keys, seconds, keys / seconds / 1e6, times, evicted,
                             dict_entries))


def find_queries(keys, slots, stream: KeyStream, n: int, miss_fraction: float,
                 gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """``n`` queries (hits drawn with replacement, misses fresh) and their expected slots."""
    n_miss = int(n * miss_fraction)
    pick = torch.randint(keys.numel(), (n - n_miss,), generator=gen)
    queries = torch.cat([keys[pick], stream.take(n_miss)])
    expected = torch.cat([slots[pick], torch.full((n_miss,), -1, dtype=torch.int64)])
    order = torch.randperm(n, generator=gen)
    return queries[order], expected[order]


def bench_find(sc: Scenario, op: str, queries: torch.Tensor, expected: torch.Tensor) -> None:
    """Time ``table.find`` (public, and the serial kernel on one thread), searchsorted and the
    dict on the same queries; check each against ``expected``."""
    table, n = sc.table, queries.numel()
    n_miss = int((expected < 0).sum())
    for threads in sorted({1, ALL_THREADS}):
        with thread_count(threads):
            times, out = time_calls(lambda: table.find(queries), sc.repeats)
            check(torch.equal(out, expected), f"{op}: table.find returned wrong slots")
            check(int((out < 0).sum()) == n_miss, f"{op}: table.find miss count is off")
            sc.add(op, "dynemb", threads, n, times)
            if threads == 1:
                serial_times = time_serial_find(sc, queries, expected, op)
                sc.add(op, "dynemb-serial-kernel", 1, n, serial_times)
            times, out = time_calls(lambda: sc.baselines.searchsorted_find(queries), sc.repeats)
            check(torch.equal(out, expected), f"{op}: searchsorted disagrees with the table")
            sc.add(op, "searchsorted", threads, n, times)
    sub = queries[:sc.dict_keys].tolist()
    times, out = time_calls(lambda: sc.baselines.dict_find(sub), sc.repeats)
    check(out == expected[:len(sub)].tolist(), f"{op}: dict disagrees with the table")
    sc.add(op, "dict", 1, len(sub), times, dict_entries=len(sc.baselines.dict))


def time_serial_find(sc: Scenario, queries: torch.Tensor, expected: torch.Tensor,
                     op: str) -> List[float]:
    """Timings of the backend's single-threaded find kernel (no argument checks)."""
    table = sc.table
    out = torch.empty_like(queries)
    times, _ = time_calls(
        lambda: table.kernels.find(table._arrays, queries, out, parallel=False), sc.repeats)
    check(torch.equal(out, expected), f"{op}: serial find kernel returned wrong slots")
    return times


def bench_insert(sc: Scenario, op: str, new_keys: torch.Tensor, assume_unique: bool,
                 must_evict: bool) -> None:
    """Time ``find_or_insert(new_keys)`` on a fresh copy of the table (and of each policy
    twin) per repeat; check the result (all inserted, findable, evicted keys gone) and record
    the eviction count."""
    n = new_keys.numel()
    tables = [("dynemb", sc.table)] + [(f"dynemb-{p}", t) for p, t in sc.twins.items()]
    for threads in sorted({1, ALL_THREADS}):
        with thread_count(threads):
            for impl, base in tables:
                times, (table, result) = time_calls(
                    lambda t: (t, t.find_or_insert(new_keys, assume_unique=assume_unique)),
                    sc.repeats, setup=lambda: copy.deepcopy(base))
                evicted = check_insert(base, table, result, new_keys, f"{op} ({impl})")
                check(evicted > 0 or not must_evict,
                      f"{op} ({impl}): no insert evicted; buckets not full")
                sc.add(op, impl, threads, n, times, evicted=evicted)
    bench_dict_insert(sc, op, new_keys)


def check_insert(base, table, result, new_keys, op: str) -> int:
    """Check a ``find_or_insert`` of absent keys; returns the number of evictions."""
    n = new_keys.numel()
    check(result.keys.numel() == n, f"{op}: unique key count changed")
    check(not bool(result.failed.any()), f"{op}: some keys found no slot")
    check(bool(result.inserted.all()), f"{op}: keys reported as already present")
    check(torch.equal(table.find(new_keys), result.input_slots), f"{op}: inserted keys not found")
    evicted = result.evicted
    n_evicted = int(evicted.sum())
    check(table.size() == base.size() + n - n_evicted, f"{op}: size is off after the insert")
    gone = table.find(result.previous_keys[evicted])
    check(bool((gone < 0).all()), f"{op}: evicted keys are still found")
    return n_evicted


def bench_dict_insert(sc: Scenario, op: str, new_keys: torch.Tensor) -> None:
    """Time ``d.setdefault(k, len(d))`` over a subset of the new keys (a dict never evicts);
    the keys are removed again (untimed) before each repeat."""
    sub = new_keys[:sc.dict_keys].tolist()
    before = len(sc.baselines.dict)
    times, out = time_calls(lambda _: sc.baselines.dict_insert(sub), sc.repeats,
                            setup=lambda: sc.baselines.dict_discard(sub))
    sc.baselines.dict_discard(sub)
    check(out == list(range(before, before + len(sub))), f"{op}: dict setdefault went wrong")
    sc.add(op, "dict", 1, len(sub), times, dict_entries=before)


def make_scenario(cfg: argparse.Namespace, capacity_log2: int, load_target: Optional[float],
                  table: ScoredHashTable) -> Scenario:
    """Wrap a filled table with baselines holding the same keys."""
    keys, slots = live_entries(table)
    twins = {policy: policy_twin(table, ScorePolicy(policy)) for policy in cfg.policies
             if policy != ScorePolicy.LRU.value}
    return Scenario(capacity_log2, load_target, table, Baselines(keys, slots), cfg.repeats,
                    cfg.dict_keys, rows=[], twins=twins)


def policy_twin(table: ScoredHashTable, policy: ScorePolicy) -> ScoredHashTable:
    """A copy of the LRU ``table`` under ``policy``: the same keys in the same slots, and
    the scores those keys would have had (one use at their LRU clock, for LFU_LRU)."""
    keys, scores = (t.clone() for t in table.image())
    if policy is ScorePolicy.LFU_LRU:
        scores = pack_lfu_lru(torch.ones_like(scores), scores)
    elif policy is not ScorePolicy.LRU:
        raise ValueError(f"no twin of an LRU table for {policy.name}")
    twin = ScoredHashTable(table.capacity, policy=policy, device="cpu")
    twin.load_image(keys, scores, table.clock)
    return twin


def new_table(capacity_log2: int) -> ScoredHashTable:
    """An empty table with the default bucket size and the LRU policy."""
    return ScoredHashTable(1 << capacity_log2, policy=ScorePolicy.LRU, device="cpu")


def run_load(cfg, capacity_log2: int, load: float, pool: torch.Tensor, gen: torch.Generator,
             progress: tqdm) -> List[Row]:
    """find (hits, 50% misses) and find_or_insert of absent keys on a table filled to ``load``.

    The insert batch is capped at half the free slots, so the load stays near ``load``.
    """
    stream = KeyStream(pool)
    label = f"2^{capacity_log2} load {load}"
    progress.set_postfix_str(f"{label}: fill")
    table = new_table(capacity_log2)
    with thread_count(ALL_THREADS):
        fill(table, stream, int(np.ceil(load * table.capacity)))
    sc = make_scenario(cfg, capacity_log2, load, table)
    for op, miss_fraction in (("find_hit", 0.0), ("find_miss50", 0.5)):
        progress.set_postfix_str(f"{label}: {op}")
        queries, expected = find_queries(*live_entries(table), stream, cfg.batch, miss_fraction,
                                         gen)
        bench_find(sc, op, queries, expected)
    new_keys = stream.take(min(cfg.batch, (table.capacity - table.size()) // 2))
    for op, assume_unique in (("insert_unique", True), ("insert_dedup", False)):
        progress.set_postfix_str(f"{label}: {op}")
        bench_insert(sc, op, new_keys, assume_unique, must_evict=False)
    return sc.rows


def run_eviction(cfg, capacity_log2: int, pool: torch.Tensor, progress: tqdm) -> List[Row]:
    """find_or_insert of absent keys (default path) into a table whose buckets are full."""
    stream = KeyStream(pool)
    label = f"2^{capacity_log2} full"
    progress.set_postfix_str(f"{label}: fill")
    table = new_table(capacity_log2)
    with thread_count(ALL_THREADS):
        overfill(table, stream)
    sc = make_scenario(cfg, capacity_log2, None, table)
    progress.set_postfix_str(f"{label}: insert_evict")
    new_keys = stream.take(min(cfg.batch, int(EVICT_BATCH_FRACTION * table.capacity)))
    bench_insert(sc, "insert_evict", new_keys, assume_unique=False, must_evict=True)
    return sc.rows


def run_all(cfg: argparse.Namespace) -> List[Row]:
    """Every scenario of every capacity; one key pool per capacity."""
    gen = torch.Generator().manual_seed(cfg.seed)
    rows: List[Row] = []
    steps = len(cfg.capacities) * (len(cfg.loads) + 1)
    with tqdm(total=steps, desc="hash table bench", unit="table") as progress:
        for capacity_log2 in cfg.capacities:
            progress.set_postfix_str(f"2^{capacity_log2}: generating keys")
            pool = unique_random_keys(pool_size(1 << capacity_log2, cfg.batch), gen)
            for load in cfg.loads:
                rows += run_load(cfg, capacity_log2, load, pool, gen, progress)
                gc.collect()
                progress.update()
            rows += run_eviction(cfg, capacity_log2, pool, progress)
            gc.collect()
            progress.update()
    return rows


# -- report ----------------------------------------------------------------------------------
def comparisons(rows: List[Row]) -> List[dict]:
    """Each dynemb row with the dict row of its scenario and the searchsorted row with the same
    thread count, and the speed-ups over them."""
    dict_rows = {(r.capacity_log2, r.load_target, r.op): r for r in rows if r.impl == "dict"}
    sorted_rows = {(r.capacity_log2, r.load_target, r.op, r.threads): r
                   for r in rows if r.impl == "searchsorted"}
    lru_rows = {(r.capacity_log2, r.load_target, r.op, r.threads): r
                for r in rows if r.impl == "dynemb"}
    out = []
    for r in rows:
        if not r.impl.startswith("dynemb"):
            continue
        d = dict_rows.get((r.capacity_log2, r.load_target, r.op))
        s = sorted_rows.get((r.capacity_log2, r.load_target, r.op, r.threads))
        lru = lru_rows.get((r.capacity_log2, r.load_target, r.op, r.threads))
        out.append({**asdict(r),
                    "vs_lru": (r.mkeys_per_s / lru.mkeys_per_s
                               if lru and r.impl.startswith("dynemb-") and r is not lru
                               and "serial" not in r.impl else None),
                    "dict_mkeys_per_s": d.mkeys_per_s if d else None,
                    "vs_dict": r.mkeys_per_s / d.mkeys_per_s if d else None,
                    "searchsorted_mkeys_per_s": s.mkeys_per_s if s else None,
                    "vs_searchsorted": r.mkeys_per_s / s.mkeys_per_s if s else None})
    return out


def format_table(comps: List[dict]) -> str:
    """Readable text table of :func:`comparisons`."""
    header = (f"{'capacity':>8} {'load':>5} {'op':<13} {'impl':<20} {'thr':>3} {'keys':>8} "
              f"{'Mkeys/s':>8} {'dict':>7} {'x dict':>7} {'sorted':>7} {'x sorted':>8} "
              f"{'evicted':>8}")
    lines = [header, "-" * len(header)]
    for c in comps:
        load = "full" if c["load_target"] is None else f"{c['load_target']:.2f}"
        lines.append(
            f"{'2^' + str(c['capacity_log2']):>8} {load:>5} {c['op']:<13} {c['impl']:<20} "
            f"{c['threads']:>3} {c['keys']:>8} {c['mkeys_per_s']:>8.2f} "
            f"{format_optional(c['dict_mkeys_per_s'], '7.2f'):>7} "
            f"{format_optional(c['vs_dict'], '7.1f'):>7} "
            f"{format_optional(c['searchsorted_mkeys_per_s'], '7.2f'):>7} "
            f"{format_optional(c['vs_searchsorted'], '8.1f'):>8} "
            f"{format_optional(c['evicted'], 'd'):>8}")
    ratios = [c for c in comps if c["vs_lru"] is not None]
    if ratios:
        lines += ["", "find_or_insert throughput of the other policies / LRU's (same keys, slots):"]
        lines += [f"  {c['impl']:<16} 2^{c['capacity_log2']} "
                  f"{'full' if c['load_target'] is None else c['load_target']} {c['op']:<13} "
                  f"{c['threads']:>3} threads: {c['vs_lru']:.2f}x" for c in ratios]
    return "\n".join(lines)


def targets(comps: List[dict]) -> List[dict]:
    """The throughput targets (one thread, capacity 2^22, load 0.5) and whether they pass;
    ``passed`` is None when the run did not measure that configuration."""
    def find(op):
        load = None if op == "insert_evict" else TARGET_LOAD  # evictions: full buckets
        for c in comps:
            if (c["capacity_log2"], c["load_target"], c["op"], c["impl"], c["threads"]) == (
                    TARGET_CAPACITY_LOG2, load, op, "dynemb", 1):
                return c
        return None

    specs = [("find_hit", "vs_dict", 10.0, "find >= 10x dict"),
             ("find_hit", "vs_searchsorted", 4.0, "find >= 4x searchsorted"),
             ("find_hit", "mkeys_per_s", 40.0, "find >= 40 M keys/s"),
             ("insert_unique", "mkeys_per_s", 15.0,
              "find_or_insert (assume_unique) >= 15 M keys/s"),
             ("insert_dedup", "mkeys_per_s", 15.0, "find_or_insert (default) >= 15 M keys/s"),
             ("insert_evict", "mkeys_per_s", 5.0,
              "find_or_insert, every insert evicts >= 5 M keys/s")]
    out = []
    for op, field, threshold, name in specs:
        c = find(op)
        value = c[field] if c else None
        out.append({"target": name, "value": value, "threshold": threshold,
                    "passed": None if value is None else value >= threshold})
    return out


def format_targets(results: List[dict]) -> str:
    """One PASS/FAIL/SKIP line per target."""
    lines = []
    for t in results:
        load = "full buckets" if "evicts" in t["target"] else f"load {TARGET_LOAD}"
        where = f"capacity 2^{TARGET_CAPACITY_LOG2}, {load}, one thread"
        value = format_optional(t["value"], ".2f", "not measured")
        lines.append(f"{verdict(t['passed'])}: {t['target']} ({where}): {value}")
    return "\n".join(lines)


NOTES = [
    "keys/s = keys per timed call / median seconds over the repeats (after one warm-up call).",
    "find queries: hits drawn at random from the table's keys (with replacement), misses are "
    "fresh random keys; the dict is timed on the first dict_keys queries of the same batch.",
    "dict: holds every key of the table (dict_entries); find = [d.get(k, -1) for k in keys], "
    "insert = [d.setdefault(k, len(d)) for k in keys] on pre-built Python int lists (list "
    "conversion untimed); single-threaded (GIL). It never evicts, so insert_evict flatters it.",
    "searchsorted: keys sorted once (untimed); find = searchsorted + gather + equality check. "
    "It has no insert: find_or_insert rows are n/a.",
    "find_or_insert rows: each repeat runs on a fresh copy of the filled table (copy untimed); "
    "the batch is capped at half the free slots (insert_*) or a quarter of the capacity "
    "(insert_evict, on a table first fed 1.25x its capacity in keys).",
    "dynemb-serial-kernel: the backend's single-threaded find kernel called directly (no "
    "argument checks), for comparison with the public find on one thread.",
    "dynemb-<policy>: find_or_insert on a copy of the LRU table under another score policy "
    "(same keys in the same slots; LFU_LRU scores: one use at the key's LRU clock); vs_lru is "
    "its throughput over the LRU row of the same scenario and thread count.",
]


IMPL_ORDER = ["dynemb", "dynemb-serial-kernel", "searchsorted", "dict"]


def plot(report: dict, path: Path) -> None:
    """Grouped bars of keys/s (log scale) per (op, load), one panel per capacity."""
    rows = report["rows"]
    series = sorted({(r["impl"], r["threads"]) for r in rows},
                    key=lambda s: (IMPL_ORDER.index(s[0]) if s[0] in IMPL_ORDER else 0.5,
                                   s[0], s[1]))  # other policies right after LRU
    capacities = sorted({r["capacity_log2"] for r in rows})
    fig, axes = pyplot().subplots(len(capacities), 1, figsize=(14, 4.2 * len(capacities)),
                                  squeeze=False)
    for ax, capacity_log2 in zip(axes[:, 0], capacities):
        mine = [r for r in rows if r["capacity_log2"] == capacity_log2]
        groups = list(dict.fromkeys((r["op"], r["load_target"]) for r in mine))
        value = {(r["op"], r["load_target"], r["impl"], r["threads"]): r["mkeys_per_s"]
                 for r in mine}
        width = 0.8 / len(series)
        x = np.arange(len(groups))
        for i, (impl, threads) in enumerate(series):
            ys = [value.get((op, load, impl, threads), np.nan) for op, load in groups]
            ax.bar(x + (i - (len(series) - 1) / 2) * width, ys, width,
                   label=f"{impl}, {threads} thread{'s' if threads > 1 else ''}")
        ax.set_xticks(x, [f"{op}\n{'full' if load is None else f'load {load}'}"
                          for op, load in groups], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("M keys/s")
        ax.set_title(f"capacity 2^{capacity_log2}")
        ax.grid(axis="y", which="both", alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(series), fontsize=8)
    save_figure(fig, path, top=1 - 0.35 / fig.get_figheight())


# -- command line ----------------------------------------------------------------------------
def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = new_parser(__doc__)
    parser.add_argument("--capacities", type=int, nargs="+", metavar="LOG2",
                        help="log2 of the table capacities (default: 20 22 24)")
    parser.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.75, 0.95],
                        help="load factors the table is filled to (default: 0.5 0.75 0.95)")
    parser.add_argument("--batch", type=int, help="keys per timed call (default: 2^20)")
    parser.add_argument("--repeats", type=int, help="timed repeats per row (default: 5)")
    parser.add_argument("--dict-keys", type=int,
                        help="keys per timed dict call, a prefix of the batch (default: 2^18)")
    parser.add_argument("--policies", nargs="+", default=["lru", "lfu_lru"],
                        choices=["lru", "lfu_lru"],
                        help="score policies whose find_or_insert is timed (default: lru "
                             "lfu_lru; the tables themselves run LRU)")
    add_run_options(parser, "tiny smoke run (capacity 2^14, small batches); writes "
                            f"{FILE_STEM}_quick.*")
    cfg = parser.parse_args(argv)
    quick = {"capacities": [14], "batch": 1 << 12, "repeats": 2, "dict_keys": 1 << 10}
    full = {"capacities": [20, 22, 24], "batch": 1 << 20, "repeats": 5, "dict_keys": 1 << 18}
    fill_defaults(cfg, quick, full)
    if not all(0.0 < load < 1.0 for load in cfg.loads):
        parser.error("--loads must lie in (0, 1)")
    if min(cfg.batch, cfg.repeats, cfg.dict_keys) < 1:
        parser.error("--batch, --repeats and --dict-keys must be positive")
    return cfg


def main(argv: Optional[List[str]] = None) -> dict:
    """Run the benchmark, print the table and targets, write JSON and PNG; returns the report."""
    cfg = parse_args(argv)
    start, git = time.perf_counter(), git_state()
    rows = run_all(cfg)
    comps = comparisons(rows)
    goals = targets(comps)
    report = {
        "machine": machine_info(git),
        "config": config_of(cfg),
        "ops": OP_HELP,
        "notes": NOTES,
        "rows": [asdict(r) for r in rows],
        "comparisons": comps,
        "targets": goals,
        "runtime_s": time.perf_counter() - start,
        "peak_rss_gib": peak_rss_gib(),
    }
    print(format_table(comps))
    print()
    print(format_targets(goals))
    write_report(report, cfg.out_dir, report_stem(FILE_STEM, cfg.quick), plot)
    print(f"run time {report['runtime_s']:.0f} s, peak RSS {report['peak_rss_gib']:.1f} GiB")
    return report


if __name__ == "__main__":
    run_command(main)
