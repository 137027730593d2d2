"""What the benchmarks share: the record of the machine and the checkout, the Zipf id sampler,
the statistics of repeated timings, the command line's common options and the report files
(``<stem>.json`` and its plot ``<stem>.png``)."""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import json
import os
import platform
import pstats
import resource
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numba
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
ALL_THREADS = numba.config.NUMBA_NUM_THREADS


class BenchmarkError(RuntimeError):
    """A timed operation returned a wrong result: the run is not reported."""


def check(condition, message: str) -> None:
    """Raise :class:`BenchmarkError` with ``message`` unless ``condition`` holds.

    >>> check(2 + 2 == 4, "arithmetic is off")
    """
    if not bool(condition):
        raise BenchmarkError(message)


def set_numba_threads(count: int) -> None:
    """``numba.set_num_threads(count)`` without touching torch's thread count: numba's omp
    layer sets the process's OpenMP count, which torch reads as its own, so a rank that ran
    ``torch.set_num_threads(1)`` would otherwise run torch on ``count`` threads.

    Example::

        >>> torch_threads = torch.get_num_threads()
        >>> set_numba_threads(1)
        >>> torch.get_num_threads() == torch_threads
        True
    """
    torch_threads = torch.get_num_threads()
    numba.set_num_threads(count)
    torch.set_num_threads(torch_threads)


def run_command(main: Callable[[], object]) -> None:
    """Run a benchmark's ``main`` as a command: a broken run exits with its reason.

    Example, at the end of a benchmark module::

        if __name__ == "__main__":
            run_command(main)
    """
    try:
        main()
    except BenchmarkError as err:
        sys.exit(f"benchmark refused to report a broken run: {err}")


# -- machine and checkout --------------------------------------------------------------------
def machine_info(git: Optional[dict], packages: Sequence[str] = ()) -> dict:
    """What the numbers were measured on: CPU, threads, memory, versions (and those of
    ``packages``), the GPU where there is one, and ``git`` (:func:`git_state`, taken at the
    start of the run).

    >>> machine_info(git_state(), packages=["torchrec"])["torchrec"]   # doctest: +SKIP
    '1.8.0'
    """
    info = {
        "processor": platform.processor(), "cpu_model": _cpu_model(),
        "machine": platform.machine(),
        "nproc": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
        "numba_threads": ALL_THREADS, "numba_threading_layer": _threading_layer(),
        "env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS",
                                                "NUMBA_NUM_THREADS", "NUMBA_THREADING_LAYER")},
        "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
        "python": platform.python_version(), "torch": torch.__version__,
        "numba": numba.__version__, "numpy": np.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git": git,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    info.update({name: package_version(name) for name in packages})
    return info


def _threading_layer() -> Optional[str]:
    """numba's threading layer, None where no parallel CPU kernel ran (a CUDA-only run)."""
    try:
        return numba.threading_layer()
    except ValueError:  # "Threading layer is not initialized."
        return None


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return ""


def package_version(module: str) -> Optional[str]:
    """``module.__version__``, or None when it is not installed.

    >>> package_version("no_such_module") is None
    True
    """
    try:
        return getattr(__import__(module), "__version__", None)
    except ImportError:
        return None


def git_state() -> Optional[dict]:
    """Commit of the checkout and whether the library sources differ from it (None: no git).

    >>> sorted(git_state())   # doctest: +SKIP
    ['commit', 'library_modified']
    """
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"),
                "library_modified": bool(git("status", "--porcelain", "dynemb", "kernels"))}
    except (OSError, subprocess.CalledProcessError):
        return None


def load_before_run() -> Tuple[float, float, float]:
    """The load average, with a warning on stderr when other processes keep more than half
    the cores busy: they slow every method down, the parallel numba kernels most (their
    threads wait for each other).

    >>> load = load_before_run()   # doctest: +SKIP
    """
    load = os.getloadavg()
    cores = len(os.sched_getaffinity(0))
    if load[0] > 0.5 * cores:
        print(f"warning: load average {load[0]:.1f} on {cores} cores before the run; other "
              f"processes will slow every method down, unevenly (see benchmarks/README.md)",
              file=sys.stderr)
    return load


def peak_rss_gib() -> float:
    """Peak resident memory of this process so far, in GiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# -- workload --------------------------------------------------------------------------------
def zipf_ranks(rng: np.random.Generator, n: int, a: float, id_space: int) -> np.ndarray:
    """``n`` Zipf(``a``) ranks (1 = most frequent) truncated to ``[1, id_space]`` by rejection.

    >>> ranks = zipf_ranks(np.random.default_rng(0), 1000, 1.05, 100)
    >>> len(ranks), int(ranks.min()) >= 1, int(ranks.max()) <= 100
    (1000, True, True)
    """
    parts, got = [], 0
    while got < n:
        draw = rng.zipf(a, size=int((n - got) * 1.8) + 64)
        draw = draw[draw <= id_space]
        parts.append(draw)
        got += draw.size
    return np.concatenate(parts)[:n]


# -- statistics ------------------------------------------------------------------------------
def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (numpy's linear interpolation).

    >>> percentile([1.0, 2.0, 3.0, 4.0, 5.0], 10)
    1.4
    """
    return float(np.percentile(np.asarray(list(values)), q))


def spread(values: Sequence[float]) -> Dict[str, float]:
    """Median, p10 and p90 of ``values``.

    >>> spread([1.0, 2.0, 3.0, 4.0, 5.0])
    {'median': 3.0, 'p10': 1.4, 'p90': 4.6}
    """
    return {"median": statistics.median(values), "p10": percentile(values, 10),
            "p90": percentile(values, 90)}


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> Dict[str, float]:
    """:func:`spread` of the per-step ratios ``numerator[i] / denominator[i]`` (two methods
    timed on the same batch at the same moment: robust to load drifting during the run).

    >>> paired_ratios([2.0, 4.0, 6.0], [1.0, 2.0, 2.0])["median"]
    2.0
    """
    return spread([a / b for a, b in zip(numerator, denominator)])


def format_optional(value: Optional[float], spec: str, missing: str = "n/a") -> str:
    """``format(value, spec)``, or ``missing`` for a value that was not measured.

    >>> format_optional(1.234, ".2f"), format_optional(None, ".2f", "-")
    ('1.23', '-')
    """
    return missing if value is None else format(value, spec)


def verdict(passed: Optional[bool]) -> str:
    """PASS, FAIL, or SKIP for a target the run did not measure.

    >>> verdict(True), verdict(None)
    ('PASS', 'SKIP')
    """
    return "SKIP" if passed is None else ("PASS" if passed else "FAIL")


# -- command line ----------------------------------------------------------------------------
def new_parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of a benchmark's docstring.

    >>> new_parser(__doc__).description.startswith("What the benchmarks share")
    True
    """
    return argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_run_options(parser: argparse.ArgumentParser, quick_help: str) -> None:
    """The options every benchmark has: ``--seed``, ``--out-dir``, ``--quick``.

    >>> parser = new_parser("A benchmark.")
    >>> add_run_options(parser, "tiny smoke run")
    >>> parser.parse_args(["--quick"]).out_dir == RESULTS_DIR
    True
    """
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--quick", action="store_true", help=quick_help)


def fill_defaults(args: argparse.Namespace, quick: dict, full: dict) -> None:
    """Set each option left unset (None) to its ``quick`` or ``full`` default.

    >>> args = argparse.Namespace(quick=True, steps=None, batch=7)
    >>> fill_defaults(args, {"steps": 3, "batch": 64}, {"steps": 30, "batch": 2048})
    >>> args.steps, args.batch
    (3, 7)
    """
    for name, default in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def config_of(args: argparse.Namespace) -> dict:
    """The options as the report records them (paths as strings).

    >>> config_of(argparse.Namespace(out_dir=Path("out"), seed=0))
    {'out_dir': 'out', 'seed': 0}
    """
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def report_stem(name: str, quick: bool) -> str:
    """File name stem of a run's report: ``--quick`` runs leave the full results alone.

    >>> report_stem("sharded_cpu", quick=True)
    'sharded_cpu_quick'
    """
    return name + ("_quick" if quick else "")


# -- report files ----------------------------------------------------------------------------
def write_report(report: dict, out_dir: Path, stem: str,
                 plot: Callable[[dict, Path], None]) -> List[Path]:
    """Write ``<stem>.json`` (the report) and ``<stem>.png`` (``plot(report, png_path)``)
    under ``out_dir``, say so on stdout, and return both paths.

    >>> write_report({"rows": []}, Path("out"), "demo", plot)   # doctest: +SKIP
    [PosixPath('out/demo.json'), PosixPath('out/demo.png')]
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / f"{stem}.json", out_dir / f"{stem}.png"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, png_path)
    for path in (json_path, png_path):
        print(f"wrote {path}")
    return [json_path, png_path]


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed).

    >>> fig, ax = pyplot().subplots()   # doctest: +SKIP
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: Path, top: float = 1.0) -> None:
    """Lay ``fig`` out (its top ``1 - top`` of the height left free, for a legend above the
    panels), save it as a PNG at ``path`` and close it.

    >>> save_figure(fig, Path("out/demo.png"))   # doctest: +SKIP
    """
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


# -- profile ---------------------------------------------------------------------------------
def profile_tables(prof: cProfile.Profile, steps: int, limit: int = 30) -> dict:
    """``functions``: the library's functions (dynemb/, kernels/; a numba kernel is the call of
    its dispatcher) by cumulative ms per step; ``torch_ops``: own ms per step of the torch
    calls each library function makes.

    >>> prof = cProfile.Profile()
    >>> prof.runcall(sum, [1, 2])
    3
    >>> profile_tables(prof, steps=1)
    {'functions': [], 'torch_ops': []}
    """
    root = str(ROOT) + "/"

    def ours(path: str) -> bool:
        return path.startswith(root + "dynemb/") or path.startswith(root + "kernels/")

    functions, torch_ops = [], {}
    for (path, line, func), (_, calls, own, cum, callers) in pstats.Stats(prof).stats.items():
        if ours(path):
            functions.append({"function": f"{path[len(root):]}:{line}({func})",
                              "calls_per_step": calls / steps, "cum_ms": cum / steps * 1e3,
                              "own_ms": own / steps * 1e3})
        elif path == "~":  # a builtin: charge its own time to the library functions calling it
            for (c_path, c_line, c_func), c_stats in callers.items():
                if ours(c_path):
                    key = f"{func} <- {c_path[len(root):]}:{c_line}({c_func})"
                    torch_ops[key] = torch_ops.get(key, 0.0) + c_stats[2] / steps * 1e3
    functions.sort(key=lambda r: -r["cum_ms"])
    ops = sorted(({"call": k, "own_ms": v} for k, v in torch_ops.items()),
                 key=lambda r: -r["own_ms"])
    return {"functions": functions[:limit], "torch_ops": ops[:limit]}
