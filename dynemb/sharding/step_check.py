"""Catch ranks that fall out of step before their collectives mix up.

Collectives pair up by their order on a process group, not by what they are. A rank that
skips a backward the others run (its loss raised, the error was caught, training went on)
sends its next batch's ids into the others' gradient exchange: the sizes disagree (gloo
aborts the process) or the bytes are read as the wrong thing (garbage rows, absurd batch
sizes). So every rank numbers the input dists of a sharded module (``batch``: how many it
ran since it was built, the same on every rank that runs the same steps) and says where it
is in a small header that every peer reads before any exchange whose size depends on it:

- input dist: the header rides in TorchRec's splits all-to-all (which already runs, and
  already has a fixed size), ahead of the splits;
- backward: one extra all-to-all of the same shape, before the gradients travel.

Both exchanges are ``CONTROL_ROWS`` int64 per peer, so whichever two of them meet, they pair
cleanly and both sides see the other's header: every rank raises
:class:`RankDesyncError`, naming the ranks and their batch numbers, before any table
changes. TorchRec's train pipelines replace the splits exchange by their own (fused over
modules, without the header): there only the backward is checked.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist
try:
    from torchrec.distributed.collective_utils import validate_collectives_enabled
except ImportError:  # TorchRec before 1.8 has no collective validation (and appends no tag)
    def validate_collectives_enabled() -> bool:
        return False

from dynemb.bridges.kjt_all_to_all import Head, KJTAllToAllWithHead

#: Header tags: what the sending rank is doing (arbitrary, unlikely as splits or sizes).
INPUT_DIST, BACKWARD = 0x44594E31, 0x44594E32
PHASES = {INPUT_DIST: "the input dist", BACKWARD: "the backward"}
#: int64 per peer of every exchange that carries a header: tag, batch, padding, then (input
#: dist) the KJT's splits and the batch size TorchRec sends.
CONTROL_ROWS = 8
HEADER_ROWS = 2


class RankDesyncError(RuntimeError):
    """Ranks of a sharded module run different steps (one skipped a forward or backward the
    others ran); their collectives no longer match."""


def header(phase: int, batch: int, rows: int, world_size: int) -> List[List[int]]:
    """``rows`` rows of ``world_size`` ints (one per peer): ``phase``, ``batch``, zeros."""
    return [[phase] * world_size, [batch] * world_size] + [[0] * world_size] * (rows - 2)


def check_header(received: Sequence[Sequence[int]], phase: int, batch: int, rank: int,
                 where: str) -> None:
    """Raise :class:`RankDesyncError` unless every peer's header (``received[0][r]``,
    ``received[1][r]``) says ``phase`` and ``batch``.

    Example::

        >>> check_header([[INPUT_DIST, BACKWARD], [3, 2]], INPUT_DIST, 3, 0, "module 'm'")
        Traceback (most recent call last):
        dynemb.sharding.step_check.RankDesyncError: ranks out of step in module 'm': rank 0 runs the input dist of batch 3 but rank 1 runs the backward of batch 2 ...
    """
    lagging = [(r, p, b) for r, (p, b) in enumerate(zip(received[0], received[1]))
               if (p, b) != (phase, batch)]
    if not lagging:
        return
    others = "; ".join(
        f"rank {r} runs {PHASES[p]} of batch {b}" if p in PHASES
        else f"rank {r} runs another collective (not a step of this module)"
        for r, p, b in lagging)
    raise RankDesyncError(
        f"ranks out of step in {where}: rank {rank} runs {PHASES[phase]} of batch {batch} but "
        f"{others} (batches count this module's input dists). A rank skipped a forward or "
        f"backward the others ran (an exception caught on one rank?): every rank must run "
        f"the same steps. Their collectives no longer match; restart from a checkpoint.")


def control_rows() -> int:
    """Ints per peer of a header exchange (TorchRec appends a tag of its own when its
    collective validation is on)."""
    return CONTROL_ROWS + (1 if validate_collectives_enabled() else 0)


class StepCheckedKJTAllToAll(KJTAllToAllWithHead):
    """TorchRec's :class:`KJTAllToAll` whose splits exchange also checks that every rank
    runs the input dist of the same :attr:`batch` (see the module docstring). Set
    :attr:`batch` before each call: TorchRec's train pipelines replace ``forward`` by their
    own, whose splits exchange is fused over modules and carries no header (there only the
    backward is checked).

    Args:
        pg, splits: as :class:`KJTAllToAll`'s.
        where: what to call the module in errors.
    """

    def __init__(self, pg: dist.ProcessGroup, splits: List[int], where: str) -> None:
        super().__init__(pg=pg, splits=splits)
        self._group, self._where = pg, where
        self.batch = 0

    def head(self, num_splits: int) -> Head:
        """This call's header, padding the exchange to ``CONTROL_ROWS`` ints per peer (the
        splits, then the batch size TorchRec sends, follow), and its check."""
        if num_splits + 1 + HEADER_ROWS > CONTROL_ROWS:
            raise ValueError(f"a KJT with {num_splits} tensors to send does not fit the "
                             f"{CONTROL_ROWS}-row step check")
        batch, rank, where = self.batch, self._group.rank(), self._where
        rows = header(INPUT_DIST, batch, CONTROL_ROWS - num_splits - 1, self._group.size())
        return rows, lambda received: check_header(received, INPUT_DIST, batch, rank, where)


class _BackwardCheck(torch.autograd.Function):
    """Identity forward; its backward checks every rank is in the backward of the same
    batch before the gradients go on to the collectives that return them to the owners."""

    @staticmethod
    def forward(ctx, checker: "BackwardStepCheck", *tensors: torch.Tensor):
        ctx.checker = checker
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.checker.exchange(grads[0].device)
        return (None, *grads)


class BackwardStepCheck:
    """The backward's header exchange for the ``batch``-th input dist of a module."""

    def __init__(self, pg: dist.ProcessGroup, batch: int, where: str) -> None:
        self.pg, self.batch, self.where = pg, batch, where

    def attach(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        """``tensors`` (the module's outputs, after the collectives that brought them) as
        they are, plus the check in their backward; unchanged without grad or peers."""
        if self.pg.size() == 1 or not any(t.requires_grad for t in tensors):
            return tensors
        return list(_BackwardCheck.apply(self, *tensors))

    def exchange(self, device: torch.device) -> None:
        world = self.pg.size()
        rows = header(BACKWARD, self.batch, control_rows(), world)
        sent = torch.tensor(rows, dtype=torch.int64, device=device).t().contiguous().flatten()
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self.pg)
        check_header(received.view(world, -1).t().tolist(), BACKWARD, self.batch,
                     self.pg.rank(), self.where)
