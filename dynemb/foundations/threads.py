"""How many numba threads dynemb's CPU kernels use by default.

dynemb's CPU kernels run on numba's threads, torch's ops on torch's: two OpenMP runtimes
(numba's ``omp`` layer loads the system's libgomp, torch its bundled copy) in one process,
each sized to every core and each spinning for a while after a parallel region. A parallel
region ends only when all its threads have run, so on a machine with few cores and anything
else busy, a numba region that needs every core waits for threads that cannot get one:
steps of 20 ms spiked to 1-2 s (``benchmarks/README.md``, ``bench_threads.py``).

So numba gets one core less than the process may use (at least one): on 2 cores the kernels
run on one thread, which kept dynemb's steps as steady as TorchRec's under load. The cap is
set when the first CPU table is built (:class:`~dynemb.backends.numba_backends.CpuBackend`), for the thread
that builds it (numba's thread count is per thread). Whatever the user chose wins:

- ``NUMBA_NUM_THREADS`` in the environment: numba's count is left as it is;
- ``OMP_WAIT_POLICY=PASSIVE`` in the environment (set before Python starts, so both OpenMP
  runtimes sleep when idle): nothing spins, and numba keeps every core;
- ``DYNEMB_THREADS=off``: no default at all (numba uses every core, as before);
- ``numba.set_num_threads(n)`` after the first table is built: that count from then on.

Example::

    >>> default_numba_threads(environ={}, cores=2)
    1
    >>> default_numba_threads(environ={"NUMBA_NUM_THREADS": "2"}, cores=2) is None
    True
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

#: Environment variable that turns the default off (``DYNEMB_THREADS=off``).
SWITCH = "DYNEMB_THREADS"
_OFF = ("off", "0", "false", "no")


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


def default_numba_threads(environ: Optional[Mapping[str, str]] = None,
                          cores: Optional[int] = None) -> Optional[int]:
    """numba threads for dynemb's kernels: ``cores - 1`` (at least 1), or None to leave
    numba as it is (the user set ``NUMBA_NUM_THREADS``, ``OMP_WAIT_POLICY=PASSIVE`` or
    ``DYNEMB_THREADS=off``).
    ``environ`` defaults to ``os.environ``, ``cores`` to :func:`available_cores`.

    Example::

        >>> default_numba_threads(environ={}, cores=16)
        15
        >>> default_numba_threads(environ={"DYNEMB_THREADS": "off"}, cores=16) is None
        True
    """
    env = os.environ if environ is None else environ
    if env.get(SWITCH, "").strip().lower() in _OFF or "NUMBA_NUM_THREADS" in env:
        return None
    if env.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE":
        return None
    cores = available_cores() if cores is None else cores
    return max(1, cores - 1)


def apply_defaults(environ: Optional[Mapping[str, str]] = None,
                   cores: Optional[int] = None) -> Optional[int]:
    """Cap the calling thread's numba threads at :func:`default_numba_threads` (never
    raising them); return the count set, or None when nothing was changed.

    Example::

        >>> import numba
        >>> before = numba.get_num_threads()
        >>> apply_defaults(environ={"DYNEMB_THREADS": "off"}) is None
        True
        >>> numba.get_num_threads() == before
        True
    """
    import numba

    wanted = default_numba_threads(environ, cores)
    if wanted is None or wanted >= numba.get_num_threads():
        return None
    numba.set_num_threads(wanted)
    return wanted
