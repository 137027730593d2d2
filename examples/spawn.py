"""Run a function on every rank of a ``torch.distributed`` world: ranks spawned here, on this
machine (CPU, gloo), or the processes ``torchrun`` started.

:func:`run_on_ranks` starts the ranks as ``torchrun`` would (the same environment variables)
and hands back what each returned; :func:`run_in_process_group` is what each rank runs
inside, and what a process launched by ``torchrun`` calls itself::

    from spawn import run_on_ranks          # examples/ on sys.path

    def world_size_seen(rank, world_size):  # module level: the ranks import it
        return torch.distributed.get_world_size()

    run_on_ranks(2, world_size_seen)        # [2, 2]
"""
from __future__ import annotations

import contextlib
import argparse
import datetime
import multiprocessing.util
import os
import pickle
import queue as queue_module
import socket
import sys
import time
import traceback
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: Seconds between looks at the ranks while waiting for their results.
POLL_S = 1.0
#: After a rank fails, the others usually fail soon (a peer closed the connection) or hang in
#: a collective: their reports are awaited this long, then they are killed.
GRACE_S = 10.0
#: A rank leaves right after reporting; one that has not by then is killed (sooner when the
#: run failed: a rank stuck in a collective never leaves).
EXIT_S, EXIT_AFTER_FAILURE_S = 30.0, 5.0


#: How long a collective waits for its peers before it fails (torch's default is 30 minutes):
#: a rank stalled or out of step ends the run in minutes.
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0

#: What gloo says on a rank whose peer went away.
PEER_FAILURE = ("Connection closed", "Connection reset by peer")


class RankError(RuntimeError):
    """A rank failed, died or ran out of time; the message holds each rank's traceback."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for the ranks' rendezvous).

    >>> 0 < free_port() < 65536
    True
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(requested: str) -> torch.device:
    """This rank's GPU (``LOCAL_RANK``) when there is one and ``requested`` (a ``--device``
    option: "auto" or "cpu") allows it, else the CPU."""
    if torch.cuda.is_available() and requested != "cpu":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def add_device_argument(parser) -> None:
    """The examples' ``--device`` (what :func:`rank_device` reads): "auto" or "cpu"."""
    parser.add_argument("--device", choices=["auto", "cpu"], default="auto",
                        help="under torchrun: CUDA with NCCL when there is a GPU (auto), or "
                             "force CPU and gloo; spawned ranks always run on CPU")


def add_timeout_argument(parser) -> None:
    """The examples' ``--timeout``: seconds a collective waits for its peers before failing
    (``collective_timeout`` of :func:`run_on_ranks`); a value that is not > 0 is refused."""
    def seconds(text: str) -> float:
        value = float(text)
        if not value > 0:
            raise argparse.ArgumentTypeError("--timeout must be > 0")
        return value

    parser.add_argument("--timeout", type=seconds, default=DEFAULT_COLLECTIVE_TIMEOUT_S,
                        help="seconds a collective waits for its peers before failing "
                             "(default %(default)s)")


def require_positive(parser, args, *names: str) -> None:
    """Refuse (``parser.error``) any of the arguments ``names`` (their dests) given below 1;
    None (not given) passes."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")


def run_in_process_group(fn: Callable, *args: Any,
                         device: torch.device = torch.device("cpu"),
                         collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> Any:
    """``fn(rank, world_size, *args)`` inside the world the environment describes (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: set by ``torchrun`` or
    :func:`run_on_ranks`), with NCCL on a CUDA ``device`` and gloo on the CPU. A collective
    whose peers have not all joined after ``collective_timeout`` seconds fails. The ranks
    meet at a barrier before leaving the world, so none tears down while another still works
    (rank 0 writing the results, say).

    >>> run_in_process_group(train, config, device=torch.device("cuda", 0))  # doctest: +SKIP
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=collective_timeout))
    try:
        result = fn(dist.get_rank(), dist.get_world_size(), *args)
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


def run_on_ranks(world_size: int, fn: Callable, *args: Any,
                 timeout: Optional[float] = None,
                 collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> List[Any]:
    """``[fn(rank, world_size, *args) for each rank]``, each rank a spawned process of one
    gloo world on this machine, with one torch thread. ``fn`` must be importable (defined at
    module level) and return something picklable. A rank that fails, dies without a result
    or is still working after ``timeout`` seconds (None: no limit) raises :class:`RankError`
    with what went wrong on every rank, the root cause first. ``collective_timeout``: as
    :func:`run_in_process_group`'s.

    >>> run_on_ranks(2, world_size_seen, timeout=60)   # doctest: +SKIP
    [2, 2]
    """
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
             "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
             # numba's and torch's OpenMP pools of several processes otherwise spin against
             # each other on a small machine; read when a pool starts, so set from birth
             "OMP_WAIT_POLICY": "PASSIVE"}
    procs, patience = [], EXIT_AFTER_FAILURE_S
    try:
        for rank in range(world_size):
            with _environment(world, RANK=str(rank), LOCAL_RANK=str(rank)):
                procs.append(ctx.Process(target=_rank_process,
                                         args=(fn, args, reports, collective_timeout),
                                         name=f"rank {rank}"))
                procs[-1].start()
        results = _collect(procs, reports, timeout)
        patience = EXIT_S
    finally:
        _stop(procs, patience)
    return [results[rank] for rank in range(world_size)]


@contextlib.contextmanager
def _environment(values: Dict[str, str], **more: str) -> Iterator[None]:
    """``os.environ`` with ``values`` and ``more`` inside the block (what a child started
    there inherits), as it was after."""
    saved = {k: os.environ.get(k) for k in {**values, **more}}
    os.environ.update(values, **more)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rank_process(fn: Callable, args: tuple, reports, collective_timeout: float) -> None:
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)  # the ranks share this machine's cores
    try:
        # pickled here, not by the queue's feeder thread: a result that cannot be pickled
        # is this rank's error, and tensors travel by value, not as shared memory that
        # goes with this process
        report = (rank, "ok", pickle.dumps(run_in_process_group(
            fn, *args, collective_timeout=collective_timeout)))
    except BaseException:
        report = (rank, "error", traceback.format_exc())
    reports.put(report)
    reports.close()
    reports.join_thread()
    # What a returning process runs (it joins the queue and releases the semaphores this
    # rank made, tqdm's for one), then skip the interpreter's teardown: destroying the C++
    # thread pools of torch, gloo and numba's OpenMP at exit intermittently aborts a
    # finished rank ("terminate called without an active exception").
    multiprocessing.util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if report[1] == "ok" else 1)


def _collect(procs: List, reports, timeout: Optional[float]) -> Dict[int, Any]:
    """Each rank's result by rank; raises :class:`RankError` when any rank has none."""
    start = time.monotonic()
    results: Dict[int, Any] = {}
    errors: Dict[int, str] = {}
    first_error: Optional[float] = None
    dead: set = set()
    while len(results) + len(errors) < len(procs):
        try:
            rank, status, payload = reports.get(timeout=POLL_S)
        except queue_module.Empty:
            # dead for a whole poll with nothing sent: it will not report
            for rank in dead - results.keys() - errors.keys():
                errors[rank] = (f"exited with code {procs[rank].exitcode} without a result "
                                f"(killed, or out of memory?)")
            dead = {r for r, p in enumerate(procs) if p.exitcode is not None}
        else:
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
        now = time.monotonic()
        if errors and first_error is None:
            first_error = now
        waited_out = timeout is not None and now - start > timeout
        if waited_out or (first_error is not None and now - first_error > GRACE_S):
            for rank in set(range(len(procs))) - results.keys() - errors.keys():
                errors[rank] = ("no result after a peer failed" if first_error is not None
                                else f"no result after {timeout} s")
    if errors:
        raise RankError(_error_report(errors))
    return results


def _error_report(errors: Dict[int, str]) -> str:
    """Every failed rank's story, the root cause first: a peer's crash only shows up as a
    closed or reset connection (or as no result) on the others."""
    def consequence(item):
        return item[1].startswith("no result") or any(m in item[1] for m in PEER_FAILURE)
    ordered = sorted(errors.items(), key=lambda item: (consequence(item), item[0]))
    return "\n".join(f"rank {rank}:\n{message}" for rank, message in ordered)


def _stop(procs: List, patience: float) -> None:
    """Wait up to ``patience`` seconds for the ranks to leave, then kill what is left."""
    deadline = time.monotonic() + patience
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
