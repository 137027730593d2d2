"""``TableBatch``: one table's part of a prefetched batch, for reading; and the checks of the
score a training batch of a CUSTOMIZED table writes."""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import List, Optional

import torch

from dynemb.options import StorageMode
from dynemb.types import ScorePolicy

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass
class TableBatch:
    """One table's part of a prefetched batch, for reading: what
    :meth:`LookupBatch.member <dynemb.tables.lookup_batch.LookupBatch.member>` and
    :meth:`~dynemb.modules.prefetch.PrefetchState.table_batch` give (a copy; the batch itself
    is its group's).

    ``keys`` / ``counts`` [U] are the unique keys and their occurrences, ``inverse`` [N] maps
    each input key to its unique index. ``slots`` [U] are device-tier slots (-1: no device row:
    padding, a key refused by admission, a key unseen in eval, or the host tier in DEFAULT);
    ``host_slots`` [U] the DEFAULT host-tier slots. ``fallback`` [U, dim] holds the rows used
    for keys without a slot (initializer, eval initializer or CACHE store rows).

    ``pinned`` while its slots hold a pin, ``consumed`` once a forward looked it up,
    ``applied`` once its backward ran.
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
    pinned: bool = False
    consumed: bool = False
    applied: bool = False

    @property
    def num_keys(self) -> int:
        return self.inverse.numel()

    def tensors(self) -> List[torch.Tensor]:
        """Every tensor the batch holds."""
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
