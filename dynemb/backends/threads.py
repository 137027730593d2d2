"""One pool of CPU threads: dynemb's numba kernels and torch's ops share torch's OpenMP pool,
and that pool's idle threads sleep instead of spinning.

numba's ``omp`` threading layer and torch's intra-op parallelism run on the same OpenMP runtime:
torch loads its bundled libgomp into the process's global symbol scope (``import torch``, which
dynemb does before any kernel runs), and numba's OpenMP pool binds its ``GOMP_*`` calls to that
copy. So a parallel kernel and a parallel torch op on one Python thread use the same worker
threads, one after the other. What made them slow is what those workers do between regions:
libgomp's default (no ``OMP_WAIT_POLICY``) spins each idle worker for 300,000 polls (a few ms)
before it sleeps. A training step runs hundreds of small parallel regions, so the workers spin
through all of it, and on a machine with few cores anything else that needs a core (a second
process, the data loader, other jobs) waits behind them, and they behind it: steps of 20 ms
spiked to 1-2 s (``benchmarks/README.md``, ``bench_threads.py``).

``OMP_WAIT_POLICY=PASSIVE`` cures it, but libgomp reads it once, when torch loads it, before
any library can set it. libgomp documents a second rule that needs no environment: while it
manages more threads than the process has cores, an idle thread spins only 1,000 polls (tens
of microseconds) and then sleeps (``GOMP_SPINCOUNT`` in the libgomp manual). So the first CPU
table built in a process (:class:`~dynemb.backends.numba_backends.CpuBackend`) starts one idle team
(:func:`park_idle_team`): a daemon thread runs one parallel torch op, which gives it a team of
torch's thread count, and then waits forever; its workers sleep in libgomp and use no CPU.
From then on libgomp counts more threads than cores whenever torch's or numba's pool has a
worker, and every idle worker in the process sleeps almost at once, as under ``PASSIVE``.
With nothing spinning, numba keeps every core, as torch does. The rule is libgomp's: with a
torch built on another OpenMP runtime, or numba's pool started on the system libgomp before
torch was imported, the team is harmless and changes nothing.

numba starting its pool sets OpenMP's thread count (``omp_set_num_threads``) to its own
(``NUMBA_NUM_THREADS``, every core by default), and torch, unless told otherwise with
``torch.set_num_threads``, runs on that count: ``OMP_NUM_THREADS=1`` left torch on one thread
only until the first kernel ran. :func:`apply_defaults` starts numba's pool and puts torch's
count back to what it was.

Where idle threads are not made to sleep, numba's kernels keep the older cap, one core less
than the process may use (at least 1): on 2 cores they then run on one thread and steps stay
steady under load. The user's settings win:

- ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` in the environment (set before Python starts; both
  OpenMP users read them): no idle team, libgomp waits as told; under ``PASSIVE`` numba keeps
  every core, under anything else the cap applies;
- ``NUMBA_NUM_THREADS`` in the environment: numba's count is left as it is;
- ``DYNEMB_THREADS=off``: no default at all (no idle team, numba on every core, torch's
  count as numba's pool start leaves it);
- ``numba.set_num_threads(n)`` / ``torch.set_num_threads(n)`` after the first table is built:
  those counts from then on.

Example::

    >>> default_numba_threads(environ={}, cores=2, idle_threads_sleep=True) is None
    True
    >>> default_numba_threads(environ={"OMP_WAIT_POLICY": "ACTIVE"}, cores=2)
    1
    >>> idle_team_wanted(environ={"GOMP_SPINCOUNT": "0"})
    False
"""
from __future__ import annotations

import os
import threading
from typing import Mapping, Optional

#: Environment variable that turns the defaults off (``DYNEMB_THREADS=off``).
SWITCH = "DYNEMB_THREADS"
_OFF = ("off", "0", "false", "no")
#: How libgomp waits, when the user chose (read by libgomp when it loads).
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
#: Elements per thread of the idle team's one op: above torch's grain size (32,768), so the
#: op runs on a full team.
_ELEMENTS_PER_THREAD = 1 << 16

_lock = threading.Lock()
_idle_team: Optional[threading.Thread] = None


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask).

    Example::

        >>> available_cores() >= 1
        True
    """
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks on this platform
        return os.cpu_count() or 1


def _environ(environ: Optional[Mapping[str, str]]) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def defaults_off(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when ``DYNEMB_THREADS`` turns every default off.

    Example::

        >>> defaults_off({"DYNEMB_THREADS": "OFF"}), defaults_off({})
        (True, False)
    """
    return _environ(environ).get(SWITCH, "").strip().lower() in _OFF


def idle_team_wanted(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether dynemb should make idle OpenMP threads sleep (:func:`park_idle_team`): not when
    the user chose how OpenMP waits (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``) or turned the
    defaults off.

    Example::

        >>> idle_team_wanted({}), idle_team_wanted({"OMP_WAIT_POLICY": "PASSIVE"})
        (True, False)
    """
    env = _environ(environ)
    return not defaults_off(env) and not any(name in env for name in WAIT_VARIABLES)


def default_numba_threads(environ: Optional[Mapping[str, str]] = None,
                          cores: Optional[int] = None,
                          idle_threads_sleep: bool = False) -> Optional[int]:
    """numba threads for dynemb's kernels, or None to leave numba as it is: None when the
    user set ``NUMBA_NUM_THREADS``, ``OMP_WAIT_POLICY=PASSIVE`` or ``DYNEMB_THREADS=off``, or
    when ``idle_threads_sleep`` (the idle team is parked: nothing spins, numba keeps every
    core); else ``cores - 1`` (at least 1). ``environ`` defaults to ``os.environ``, ``cores``
    to :func:`available_cores`.

    Example::

        >>> default_numba_threads(environ={}, cores=16)
        15
        >>> default_numba_threads(environ={"DYNEMB_THREADS": "off"}, cores=16) is None
        True
    """
    env = _environ(environ)
    if defaults_off(env) or "NUMBA_NUM_THREADS" in env or idle_threads_sleep:
        return None
    if env.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE":
        return None
    cores = available_cores() if cores is None else cores
    return max(1, cores - 1)


def park_idle_team() -> bool:
    """Start, once per process, a daemon thread that runs one parallel torch op and then
    waits forever, its OpenMP team asleep: libgomp then manages more threads than there are
    cores and makes every idle worker sleep after a short spin (see the module's docstring).
    Returns whether the team is parked (False when torch runs on one thread: no team forms,
    and a single thread has no workers to spin).

    Example::

        >>> park_idle_team() in (True, False)
        True
    """
    global _idle_team
    import torch

    with _lock:
        if _idle_team is not None:
            return True
        threads = torch.get_num_threads()
        if threads < 2:
            return False
        started = threading.Event()

        def run() -> None:
            try:
                torch.ones(threads * _ELEMENTS_PER_THREAD).add_(1)  # one parallel region
            finally:
                started.set()
            threading.Event().wait()  # keep the thread, and so its team, for good

        _idle_team = threading.Thread(target=run, name="dynemb-idle-openmp-team", daemon=True)
        _idle_team.start()
        started.wait()
        return True


def apply_defaults(environ: Optional[Mapping[str, str]] = None,
                   cores: Optional[int] = None) -> Optional[int]:
    """The process's thread defaults, for the calling thread: start numba's pool without
    changing torch's thread count, park the idle team (:func:`park_idle_team`, when
    :func:`idle_team_wanted`), and cap numba's threads at
    :func:`default_numba_threads` (never raising them). Returns the numba count set, or None when numba's was left as it
    was.

    Example::

        >>> import numba
        >>> before = numba.get_num_threads()
        >>> apply_defaults(environ={"DYNEMB_THREADS": "off"}) is None
        True
        >>> numba.get_num_threads() == before
        True
    """
    import numba
    import torch

    env = _environ(environ)
    if not defaults_off(env):
        torch_threads = torch.get_num_threads()
        numba.get_num_threads()  # starts numba's pool, which sets OpenMP's thread count
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
    parked = idle_team_wanted(env) and park_idle_team()
    wanted = default_numba_threads(env, cores, idle_threads_sleep=parked)
    if wanted is None or wanted >= numba.get_num_threads():
        return None
    numba.set_num_threads(wanted)
    return wanted
