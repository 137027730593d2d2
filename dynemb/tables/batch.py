"""``TableBatch``: one table's share of a prefetched batch, from prefetch to backward; the
one-member case of :class:`~dynemb.tables.lookup_batch.LookupBatch`."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import torch

from dynemb.rows.optimizers import OccurrenceGrads
from dynemb.options import StorageMode
from dynemb.tables.lookup_batch import LookupBatch, PoolingRows
from dynemb.types import ScorePolicy

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass
class TableBatch(LookupBatch):
    """One table's part of a :class:`~dynemb.modules.prefetch.PrefetchState`.

    ``keys`` / ``counts`` [U] are the unique keys and their occurrences, ``inverse`` [N] maps
    each input key to its unique index. ``slots`` [U] are device-tier slots (-1: no device row:
    padding, a key refused by admission, a key unseen in eval, or the host tier in DEFAULT);
    ``host_slots`` [U] the DEFAULT host-tier slots. ``fallback`` [U, dim] holds the rows used
    for keys without a slot (initializer, eval initializer or CACHE store rows).

    Life cycle: ``pinned`` while its slots hold a pin, ``consumed`` once a forward looked it
    up, ``applied`` once its backward ran. ``score``: the score a training claim writes for
    the keys of a CUSTOMIZED table (None for the other policies). ``table``: the
    :class:`~dynemb.tables.base.DynamicTable` whose batch it is (None for a read-only copy,
    see :meth:`~dynemb.tables.group_batch.GroupBatch.member`).
    """

    name: str
    mode: StorageMode
    training: bool
    keys: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor
    num_unique: torch.Tensor
    slots: Optional[torch.Tensor] = None
    host_slots: Optional[torch.Tensor] = None
    fallback: Optional[torch.Tensor] = None
    score: Optional[int] = None
    pinned: bool = False
    consumed: bool = False
    applied: bool = False
    #: between :meth:`~dynemb.tables.DynamicTable.claim_batch` and ``finish_batch``: the
    #: claim whose rows are not yet filled, and the lookups not yet counted
    pending: Any = None
    lookups: Any = None
    table: Any = field(default=None, repr=False)

    @property
    def num_keys(self) -> int:
        return self.inverse.numel()

    # -- LookupBatch: a batch of one member ----------------------------------------------------
    @property
    def names(self) -> Tuple[str, ...]:
        return (self.name,)

    @property
    def key_bounds(self) -> List[int]:
        return [0, self.inverse.numel()]

    def member(self, name: str) -> "TableBatch":
        return self

    @property
    def dim(self) -> int:
        return self.table.dim

    @property
    def device(self) -> torch.device:
        return self.table.device

    @property
    def kernels(self):
        return self.table.kernels

    def lookup_occurrences(self, sizes: Optional[Sequence[int]] = None
                           ) -> Tuple[torch.Tensor, ...]:
        rows = self.table.lookup_occurrences(self)
        if sizes is None or len(sizes) == 1:
            return (rows,)
        return rows.split(list(sizes))

    def pooling_rows(self) -> PoolingRows:
        """In place where the table can be read where it is; else its looked-up unique rows:
        by the kernel on the CUDA kernels (as a table group there pools, so that the two sum
        alike), by ``embedding_bag`` on CPU (as TorchRec's EBC and a serving export pool)."""
        table = self.table
        in_place = table.rows_in_place(self)
        if in_place is not None:
            return PoolingRows(*in_place, by_kernel=True)
        if table.kernels.name == "cuda":
            return PoolingRows(table.lookup(self).to(torch.float32).contiguous(),
                               self.inverse.to(torch.int64).contiguous(), by_kernel=True)
        return PoolingRows(table.lookup(self), self.inverse, by_kernel=False)

    def applied_to(self, name: str) -> bool:
        return self.applied

    def apply_gradients(self, grads: OccurrenceGrads, taking: Sequence[bool], *, lr: float,
                        steps) -> None:
        if taking[0]:
            self.table.apply_gradients(self, grads, lr=lr, step=steps[self.name])

    def release(self) -> None:
        self.table.release(self)

    def table_remapped(self, name: str, remap: torch.Tensor) -> None:
        if self.slots is not None:
            self.slots = torch.where(self.slots >= 0, remap[self.slots.clamp(min=0)], -1)

    def table_tensors(self, name: str) -> List[torch.Tensor]:
        """The tensors of table ``name``'s part: all of them (the batch is one table's)."""
        return self.tensors()

    def tensors(self) -> List[torch.Tensor]:
        """Every tensor the batch holds (to mark them used by another CUDA stream)."""
        return [t for t in (self.keys, self.inverse, self.counts, self.num_unique, self.slots,
                            self.host_slots, self.fallback) if t is not None]


def check_score(table: str, score) -> int:
    """``score`` as an int, checked to be an integer (not a bool) in the int64 range."""
    if isinstance(score, torch.Tensor) and score.numel() == 1 and not score.is_floating_point():
        score = score.item()
    if isinstance(score, bool) or not isinstance(score, numbers.Integral) or not (
            INT64_MIN <= int(score) <= INT64_MAX):
        raise ValueError(f"table {table!r}: a score must be an int in the int64 range, got "
                         f"{score!r}")
    return int(score)


def check_batch_score(table: str, policy: ScorePolicy, training: bool,
                      score: Optional[int]) -> Optional[int]:
    """The score a batch of ``table`` carries: the checked ``score`` for a training batch of
    a CUSTOMIZED table, None otherwise (no other policy and no eval batch writes one).

    Example::

        >>> check_batch_score("t", ScorePolicy.CUSTOMIZED, True, 1234)
        1234
        >>> check_batch_score("t", ScorePolicy.LRU, True, 1234) is None
        True
        >>> check_batch_score("t", ScorePolicy.CUSTOMIZED, True, None)
        Traceback (most recent call last):
        ...
        ValueError: table 't' has score_strategy CUSTOMIZED: a training batch needs the score to write for its keys; call set_scores({'t': score}) on the module before the training step (nothing was changed)
    """
    if not training or policy is not ScorePolicy.CUSTOMIZED:
        return None
    if score is None:
        raise ValueError(f"table {table!r} has score_strategy CUSTOMIZED: a training batch "
                         f"needs the score to write for its keys; call "
                         f"set_scores({{{table!r}: score}}) on the module before the training "
                         f"step (nothing was changed)")
    return check_score(table, score)
