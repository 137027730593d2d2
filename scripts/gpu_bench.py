"""First GPU numbers: ScoredHashTable throughput on the CUDA kernels, next to torch.searchsorted.

``benchmarks/bench_hash_table.py`` measures the CPU backend only (threads, a Python dict
baseline); this is its CUDA counterpart at one size, the same operations and the same
checks: the table is filled with random unique keys to ``--load``, then each operation is
timed with CUDA events (median of ``--repeats`` after a warm-up call) and every result is
checked before it is reported. Inserted keys are erased again after each call (not timed), so
every insert starts from the filled table (less the erased slots' tombstones).

| op | what is timed |
|----|---------------|
| ``find_hit`` | ``find`` of a batch of keys all in the table |
| ``find_miss50`` | ``find`` of a batch, half of it absent |
| ``insert_unique`` | ``find_or_insert(new_keys, assume_unique=True)`` |
| ``insert_dedup`` | the same keys through the default path (dedup by ``torch.unique``) |
| ``searchsorted`` | ``torch.searchsorted`` over the sorted table keys + gather + compare |

Usage::

    python -m scripts.gpu_bench [--capacity-log2 22] [--load 0.5] [--batch-log2 20]
    python -m scripts.gpu_bench --device cpu --backend cuda --capacity-log2 10 --batch-log2 6
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default=None, choices=[None, "cpu", "cuda"])
    parser.add_argument("--capacity-log2", type=int, default=22)
    parser.add_argument("--load", type=float, default=0.5)
    parser.add_argument("--batch-log2", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.device == "cpu" and args.backend == "cuda":
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    return args


class Timer:
    """Wall time of a call on the device: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device):
        import torch
        self.torch = torch
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        torch = self.torch
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / 1e3


def fill(args, device):
    """A table at ``--load`` with random unique keys; returns (table, keys, their slots)."""
    import torch
    from dynemb import ScorePolicy
    from dynemb.rows.hash_table import ScoredHashTable
    capacity = 1 << args.capacity_log2
    table = ScoredHashTable(capacity, policy=ScorePolicy.LRU, device=device, backend=args.backend)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    target = int(args.load * capacity)
    keys = torch.unique(torch.randint(0, 1 << 62, (target,), generator=gen, device=device))
    for chunk in keys.split(max(1, capacity // 8)):
        table.find_or_insert(chunk, assume_unique=True)
    slots = table.find(keys)
    live = slots >= 0  # a full bucket may have evicted a few of the fill's own keys
    return table, keys[live], slots[live]


def run(args):
    import torch
    device = torch.device(args.device)
    timer = Timer(device)
    table, keys, slots = fill(args, device)
    batch = 1 << args.batch_log2
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    hit_idx = torch.randint(0, keys.numel(), (batch,), generator=gen, device=device)
    hit_keys, hit_slots = keys[hit_idx], slots[hit_idx]
    absent = torch.randint(-(1 << 62), -1, (batch,), generator=gen, device=device)
    mixed = torch.where(torch.arange(batch, device=device) % 2 == 0, hit_keys, absent)
    expected_mixed = torch.where(torch.arange(batch, device=device) % 2 == 0, hit_slots, -1)
    free = table.capacity - table.size()
    new_keys = torch.unique(torch.randint(-(1 << 62), -1, (min(batch, free // 2),),
                                          generator=gen, device=device))
    sorted_keys, order = torch.sort(keys)
    rows = []

    def record(op, n, fn, check, after=lambda: None):
        times = []
        fn()  # warm-up: kernel compilation
        after()
        for _ in range(args.repeats):
            out = {}
            times.append(timer(lambda: out.setdefault("r", fn())))
            if not check(out["r"]):
                raise AssertionError(f"{op}: wrong result")
            after()
        med = statistics.median(times)
        rows.append({"op": op, "keys": n, "median_s": med, "mkeys_per_s": n / med / 1e6,
                     "times_s": times})
        print(f"{op:<14} {n:>9} keys  {n / med / 1e6:10.1f} M keys/s  ({med * 1e3:.3f} ms)",
              flush=True)

    record("find_hit", batch, lambda: table.find(hit_keys),
           lambda r: bool((r == hit_slots).all()))
    record("find_miss50", batch, lambda: table.find(mixed),
           lambda r: bool((r == expected_mixed).all()))
    for op, unique in (("insert_unique", True), ("insert_dedup", False)):
        # a bucket the fill left full evicts one of its keys: the load drifts down a little
        record(op, new_keys.numel(),
               lambda unique=unique: table.find_or_insert(new_keys, assume_unique=unique),
               lambda r: bool((table.find(new_keys) >= 0).all()) and not bool(r.failed.any()),
               after=lambda: table.erase(new_keys))
    record("searchsorted", batch,
           lambda: _searchsorted(sorted_keys, order, slots, hit_keys),
           lambda r: bool((r == hit_slots).all()))
    return {"device": str(device), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
            "capacity": table.capacity, "load": table.size() / table.capacity,
            "rows": rows}


def _searchsorted(sorted_keys, order, slots, queries):
    import torch
    pos = torch.searchsorted(sorted_keys, queries).clamp(max=sorted_keys.numel() - 1)
    found = sorted_keys[pos] == queries
    return torch.where(found, slots[order[pos]], -1)


def main(argv=None) -> int:
    args = parse_args(argv)
    report = run(args)
    print(f"capacity {report['capacity']}, load {report['load']:.2f}, on {report['device']}"
          f" ({report['gpu'] or 'no GPU'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
