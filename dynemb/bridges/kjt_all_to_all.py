"""TorchRec's ``KJTAllToAll`` with rows of the caller's ahead of the splits it exchanges.

TorchRec's KJT all-to-all starts with a small exchange of per-peer ints (the splits of each
tensor the KJT sends, then the batch size). :class:`KJTAllToAllWithHead` puts rows of its own
(:meth:`KJTAllToAllWithHead.head`) ahead of those splits in that same exchange, and hands the
rows every peer sent to :meth:`KJTAllToAllWithHead.head`'s check before TorchRec reads the
splits, so a per-step header costs no extra collective (:mod:`dynemb.sharding.step_check`).

It relies on TorchRec internals (``torchrec.distributed.dist_data``):
``KJTAllToAll._pg``, ``_splits``, ``_splits_cumsum``, ``_stagger``, and, in
``KJTAllToAllSplitsAwaitable``, ``_input_splits``, ``_output_splits``, ``_workers`` and
``_splits_awaitable`` (the awaitable of the splits exchange, waited on before the tensors'
exchange starts).
"""
from __future__ import annotations

from typing import Callable, List, Tuple

import torch
import torch.distributed as dist
from torchrec.distributed.dist_data import KJTAllToAll, KJTAllToAllSplitsAwaitable
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

#: rows of one int per peer, and what reads the rows every peer sent (one column per peer)
Head = Tuple[List[List[int]], Callable[[List[List[int]]], None]]


class _SplitsAwaitableWithHead(KJTAllToAllSplitsAwaitable):
    """TorchRec's splits all-to-all with ``head`` rows ahead of the splits; ``check`` reads
    the peers' head rows on wait."""

    def __init__(self, *, head: Head, **kwargs) -> None:
        rows, self._check = head
        splits = kwargs.pop("tensor_splits")
        super().__init__(tensor_splits=rows + list(splits), **kwargs)
        self._head_rows = len(rows)
        self._input_splits = self._input_splits[self._head_rows:]
        self._output_splits = self._input_splits
        if self._workers > 1:
            self._splits_awaitable = _HeadStripped(self._splits_awaitable, self.strip)

    def strip(self, rows: List[List[int]]) -> List[List[int]]:
        self._check(rows[:self._head_rows])
        return rows[self._head_rows:]


class _HeadStripped(Awaitable[List[List[int]]]):
    """The splits exchange's rows after the head was checked and dropped."""

    def __init__(self, inner: Awaitable, strip: Callable[[List[List[int]]], List[List[int]]]
                 ) -> None:
        super().__init__()
        self._inner, self._strip = inner, strip

    def _wait_impl(self) -> List[List[int]]:
        return self._strip(self._inner.wait())


class KJTAllToAllWithHead(KJTAllToAll):
    """TorchRec's :class:`KJTAllToAll` (same arguments) whose splits exchange also carries
    the rows :meth:`head` gives for each call; a subclass says what they are.

    Example::

        >>> class Tagged(KJTAllToAllWithHead):  # doctest: +SKIP
        ...     def head(self, num_splits):
        ...         return [[7] * self.world_size], lambda rows: print(rows)
    """

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self._pg)

    def head(self, num_splits: int) -> Head:
        """The rows to send ahead of ``num_splits`` splits (one int per peer each), and the
        check of the rows received (row ``i``, column ``r``: peer ``r``'s row ``i``)."""
        raise NotImplementedError

    def forward(self, input: KeyedJaggedTensor) -> Awaitable:  # noqa: A002
        """Start the all-to-all of ``input``, with this call's :meth:`head`."""
        with torch.no_grad():
            rank = dist.get_rank(self._pg)
            tensor_splits = input.dist_splits(self._splits)
            return _SplitsAwaitableWithHead(
                head=self.head(len(tensor_splits)), pg=self._pg, input=input,
                splits=self._splits, labels=input.dist_labels(), tensor_splits=tensor_splits,
                input_tensors=input.dist_tensors(),
                keys=input.keys()[self._splits_cumsum[rank]:self._splits_cumsum[rank + 1]],
                device=input.device(), stagger=self._stagger)
