"""Run a function on N spawned CPU ranks (gloo) and collect what each rank returns."""
from __future__ import annotations

import os
import socket
import traceback
from typing import Any, Callable, List

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_WAIT_POLICY="PASSIVE")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # report every failure to the parent, then exit non-zero
        queue.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 300) -> List[Any]:
    """``[fn(rank, world_size, *args) for each rank]``, each in its own spawned process with
    a gloo process group. ``fn`` must be importable (module level) and return picklable
    values (numpy arrays, not tensors). A failure on any rank raises with its traceback."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            try:  # after a failure, the others fail soon (or hang in a collective)
                rank, status, payload = queue.get(timeout=10 if errors else timeout)
            except Exception:
                if errors:
                    break
                raise
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=5 if errors else timeout)
            if p.is_alive():
                p.kill()
    if errors:  # the root cause first: a peer's crash shows up as "Connection closed"
        errors.sort(key=lambda e: "Connection closed" in e)
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
