"""Paired before/after of one training (or eval) step: two worker processes
(``ab_worker.py``), one importing each checkout, take turns step by step on the same batches
(the order flips every step, both pinned to the same cores), so that whatever else runs on
the machine falls on both alike. Prints one JSON line: the medians of each side and the
median (and quartiles) of the per-step ratios after / before.

    python ab_pair.py BEFORE_TREE AFTER_TREE MODE TABLES THREADS WARMUP STEPS

A tree is a checkout with ``dynemb/kernels`` linked to its ``kernels/`` (as
``benchmarks/before_after.py`` makes them)."""
import json, statistics, subprocess, sys
from pathlib import Path
before, after, mode, T, threads, warm, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
py = sys.executable
worker = str(Path(__file__).resolve().parent / "ab_worker.py")
def spawn(tree):
    p = subprocess.Popen([py, worker, mode, str(T), str(threads)], cwd=tree,
                         env={"PYTHONPATH": tree, "PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "AB_STEPS": str(warm + n)},
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    while True:
        line = p.stdout.readline()
        if not line: raise RuntimeError(f"{tree} died")
        if line.startswith("ready"): return p
sides = {"before": spawn(before), "after": spawn(after)}
res = {"before": [], "after": []}
cmd = "eval" if mode == "eval" else "step"
for i in range(warm + n):
    order = ("before", "after") if i % 2 == 0 else ("after", "before")
    probes = {}
    for s in order:
        c = "step" if (mode == "eval" and i < warm) else cmd
        sides[s].stdin.write(f"{c} {i}\n"); sides[s].stdin.flush()
        vals = sides[s].stdout.readline().split()
        probes[s] = float(vals[3])
        if i >= warm: res[s].append([float(v) for v in vals[:3]])
    if abs(probes["before"] - probes["after"]) > 1e-3 * max(1.0, abs(probes["before"])):
        print("WARNING: outputs differ", i, probes)
for p in sides.values(): p.stdin.close(); p.wait()
tot = {s: [sum(x) for x in res[s]] for s in res}
ratios = [a / b for a, b in zip(tot["after"], tot["before"])]
out = {"mode": mode, "tables": T, "threads": threads, "steps": n,
       "before_ms": statistics.median(tot["before"]), "after_ms": statistics.median(tot["after"]),
       "paired_ratio_median": statistics.median(ratios),
       "paired_ratio_p25_p75": [statistics.quantiles(ratios, n=4)[0], statistics.quantiles(ratios, n=4)[2]],
       "phases_before_ms": [statistics.median(x[k] for x in res["before"]) for k in range(3)],
       "phases_after_ms": [statistics.median(x[k] for x in res["after"]) for k in range(3)]}
print(json.dumps(out))
