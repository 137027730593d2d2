"""What the spawning examples (train_dlrm.py, train_sharded.py, two_tower_swap.py) set up on
each rank, and how they write numpy values to their JSON metrics::

    from rank_setup import jsonable, prepare_rank   # examples/ on sys.path

    def train_rank(rank, world_size):
        prepare_rank(torch.device("cpu"))
        ...
        json.dumps(metrics, default=jsonable)
"""
from __future__ import annotations

import logging
import warnings

import numpy as np
import torch


def prepare_rank(device: torch.device) -> None:
    """Ready this rank's process: on CPU, one intra-op thread (the dense ops are small:
    extra threads only add OpenMP barrier waits, and the ranks share the cores); TorchRec's
    notices hidden (:func:`quiet_torchrec`)."""
    if device.type == "cpu":
        torch.set_num_threads(1)
    quiet_torchrec()


def quiet_torchrec() -> None:
    """Hide TorchRec's and torch's notices about their own internals (planner defaults, a
    deprecated DDP argument TorchRec passes, a tracing helper), printed once per rank."""
    for name in ("torchrec.distributed.planner", "torch.fx._symbolic_trace"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torchrec\.")
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.\w+` is deprecated")


def jsonable(value):
    """``json.dumps``' ``default`` for numpy scalars.

    Example::

        >>> import json
        >>> json.dumps({"rows": np.int64(3)}, default=jsonable)
        '{"rows": 3}'
    """
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
