"""``TensorBoardWriter``: metrics written as TensorBoard scalars (``torch.utils.tensorboard``).

TensorBoard is an optional dependency: ``pip install 'dynemb[metrics]'``. The writer takes
any object with ``add_scalar(tag, value, global_step)`` and ``flush()`` instead (a
``SummaryWriter`` of your own, or a test's fake), and needs no TensorBoard then.
"""
from __future__ import annotations

import math
import os
from typing import Mapping, Union

import torch

#: What to install when TensorBoard is missing.
EXTRA = "pip install 'dynemb[metrics]'"


class TensorBoardWriter:
    """Writes ``{name: value}`` (e.g. :meth:`DynamicTableMetrics.compute
    <dynemb.metrics.DynamicTableMetrics.compute>`) as scalars ``<prefix>/<name>`` at a step.

    ``log_dir``: a new ``torch.utils.tensorboard.SummaryWriter`` there (``ImportError``
    naming the ``metrics`` extra if the ``tensorboard`` package is missing); or ``writer``:
    any object with ``add_scalar(tag, value, global_step)``. NaN values (a hit rate of an
    interval without lookups) are left out, not written as points. In a sharded job, write
    on one rank (``compute()`` runs on all of them).

    Example::

        >>> from dynemb.metrics import TensorBoardWriter
        >>> class Recorder:                       # stands for a SummaryWriter here
        ...     def __init__(self): self.points = []
        ...     def add_scalar(self, tag, value, global_step): self.points.append(
        ...         (tag, value, global_step))
        ...     def flush(self): pass
        >>> board = TensorBoardWriter(writer=Recorder())
        >>> board.write({"items/hit_rate": torch.tensor(0.75), "items/evictions": 3}, step=100)
        >>> board.writer.points
        [('dynemb/items/hit_rate', 0.75, 100), ('dynemb/items/evictions', 3.0, 100)]
    """

    def __init__(self, log_dir: Union[str, os.PathLike, None] = None, *, writer=None,
                 prefix: str = "dynemb"):
        if (log_dir is None) == (writer is None):
            raise ValueError("give TensorBoardWriter either log_dir or writer (one of them)")
        if writer is None:
            writer = summary_writer(log_dir)
        elif not callable(getattr(writer, "add_scalar", None)):
            raise TypeError(f"writer must have add_scalar(tag, value, global_step); got "
                            f"{type(writer).__name__}")
        self.writer, self.prefix = writer, prefix

    def write(self, values: Mapping[str, Union[torch.Tensor, float, int]], step: int) -> None:
        """Write every value of ``values`` at ``step`` (NaNs left out), then flush."""
        for name, value in values.items():
            value = float(value)
            if not math.isnan(value):
                self.writer.add_scalar(f"{self.prefix}/{name}", value, global_step=step)
        flush = getattr(self.writer, "flush", None)
        if flush is not None:
            flush()

    def close(self) -> None:
        close = getattr(self.writer, "close", None)
        if close is not None:
            close()


def summary_writer(log_dir: Union[str, os.PathLike], **kwargs):
    """A ``torch.utils.tensorboard.SummaryWriter`` writing to ``log_dir``; ``ImportError``
    naming the extra to install when the ``tensorboard`` package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:  # torch raises it when the tensorboard package is missing
        raise ImportError(f"writing TensorBoard files needs the tensorboard package, which is "
                          f"not installed: {EXTRA} (or pip install tensorboard)") from err
    return SummaryWriter(log_dir=str(log_dir), **kwargs)

