"""Run one benchmark on two commits back to back, in interleaved rounds, and report every
time both runs measured as an after / before ratio.

Each commit is checked out into a temporary git worktree and imported from there (the
current virtual environment's packages, the commit's own ``dynemb`` and ``kernels/``), so a
rework can be compared with the code before it on one machine in one sitting: the rounds
alternate before, after, after, before... so that a drift of the machine weighs on both.

Example (the arguments after ``--`` go to the benchmark)::

    python benchmarks/before_after.py --before 46fabba --after HEAD --rounds 2 \\
        -- bench_tables.py --quick

writes ``benchmarks/results/before_after_<bench>.json``: the configuration, each round's
full reports, and per timing (any number whose key ends in ``ms`` or ``_s``, or is
``seconds``, found at the same place in both reports) the median of each side and their
ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"


def checkout(commit: str, where: Path) -> Tuple[str, Path]:
    """A detached worktree of ``commit`` under ``where``, with ``dynemb/kernels`` linked to
    its ``kernels/`` (what the editable install maps); returns (full hash, path)."""
    sha = subprocess.run(["git", "rev-parse", commit], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    path = where / sha[:10]
    subprocess.run(["git", "worktree", "add", "--detach", "-f", str(path), sha], cwd=ROOT,
                   check=True, capture_output=True)
    (path / "dynemb" / "kernels").symlink_to(path / "kernels", target_is_directory=True)
    return sha, path


def run_bench(tree: Path, bench: List[str], out_dir: Path) -> Dict:
    """Run ``benchmarks/<bench[0]>`` of ``tree`` with ``--out-dir out_dir``; return the one
    JSON report it writes."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    script = tree / "benchmarks" / bench[0]
    subprocess.run([sys.executable, str(script), *bench[1:], "--out-dir", str(out_dir)],
                   cwd=tree, env=env, check=True)
    reports = sorted(out_dir.glob("*.json"))
    if len(reports) != 1:
        raise RuntimeError(f"{bench[0]} wrote {len(reports)} JSON reports in {out_dir}, "
                           "expected one")
    return json.loads(reports[0].read_text())


def timings(report, path: str = "", timed: bool = False) -> Iterator[Tuple[str, float]]:
    """``(path, value)`` of every number in ``report`` whose key names a time (ends in
    ``ms`` or ``_s``, or is ``seconds``), or that sits under such a key.

    >>> dict(timings({"a": {"step_ms": 2.0, "n": 3}, "rows": [{"total_ms": 1.5}],
    ...               "load": {"seconds": 4.0, "run_s": 9}, "median_ms": {"ours": 3}}))
    {'a.step_ms': 2.0, 'rows.0.total_ms': 1.5, 'load.seconds': 4.0, 'load.run_s': 9.0, \
'median_ms.ours': 3.0}
    """
    if isinstance(report, dict):
        for key, value in report.items():
            inner = f"{path}.{key}" if path else str(key)
            yield from timings(value, inner, timed or _names_a_time(str(key)))
    elif isinstance(report, list):
        for index, value in enumerate(report):
            yield from timings(value, f"{path}.{index}" if path else str(index), timed)
    elif timed and isinstance(report, (int, float)) and not isinstance(report, bool):
        yield path, float(report)


def _names_a_time(key: str) -> bool:
    return key.endswith(("ms", "_s")) or key == "seconds"


def compare(before: List[Dict], after: List[Dict]) -> Dict[str, Dict[str, float]]:
    """Per timing found in every report of both sides: the medians and after / before.

    >>> compare([{"x_ms": 2.0}], [{"x_ms": 3.0}])
    {'x_ms': {'before': 2.0, 'after': 3.0, 'ratio': 1.5}}
    """
    sides = [[dict(timings(r)) for r in reports] for reports in (before, after)]
    common = set.intersection(*(set(t) for side in sides for t in side))
    out = {}
    for key in sorted(common):
        b, a = (statistics.median(t[key] for t in side) for side in sides)
        out[key] = {"before": b, "after": a, "ratio": round(a / b, 3) if b else float("nan")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the commit before the change")
    parser.add_argument("--after", default="HEAD", help="the commit after (default HEAD)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side (default 2)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("bench", nargs=argparse.REMAINDER,
                        help="-- bench_x.py [its options]")
    args = parser.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench or not (ROOT / "benchmarks" / bench[0]).exists():
        parser.error(f"name a benchmark script of benchmarks/ after --, got {bench!r}")
    with tempfile.TemporaryDirectory(prefix="before_after_") as tmp:
        tmp = Path(tmp)
        sides = {"before": checkout(args.before, tmp), "after": checkout(args.after, tmp)}
        reports: Dict[str, List[Dict]] = {"before": [], "after": []}
        try:
            order = [("before", "after") if r % 2 == 0 else ("after", "before")
                     for r in range(args.rounds)]
            runs = [(r, side) for r, pair in enumerate(order) for side in pair]
            for round_index, side in tqdm(runs, desc=bench[0], unit="run"):
                out = tmp / "out" / f"{side}_{round_index}"
                reports[side].append(run_bench(sides[side][1], bench, out))
        finally:
            for _, path in sides.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT,
                               capture_output=True)
    result = {"bench": bench, "rounds": args.rounds,
              "before": sides["before"][0], "after": sides["after"][0],
              "timings": compare(reports["before"], reports["after"]), "reports": reports}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"before_after_{Path(bench[0]).stem}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    for key, row in result["timings"].items():
        print(f"{key:60s} {row['before']:10.2f} {row['after']:10.2f} {row['ratio']:7.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
