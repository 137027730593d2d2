"""``LookupBatch``: a prefetched batch as the layers above the tables see it, a table
group's (:class:`~dynemb.tables.group_batch.GroupBatch`; a DEFAULT group's
:class:`~dynemb.tables.group_tiers.TieredBatch`), whatever the number of its tables.

A batch serves one or more member tables, ``names``, whose input keys lie one after the
other in the order the module concatenated them: member ``t``'s are
``[key_bounds[t], key_bounds[t + 1])`` of ``inverse`` [N], the unique index of each input
key into ``keys`` [U]. A group of one is the batch of one member. The modules above
(:mod:`dynemb.modules.dynamic_core`, :mod:`dynemb.modules.collection`,
:mod:`dynemb.modules.pooling`,
:mod:`dynemb.modules.occurrence_lookup`) run one path over this interface and never ask which kind
of batch they hold:

- **forward, per occurrence**: :meth:`lookup_occurrences` (one gather, split into parts,
  e.g. one per feature of each member);
- **forward, pooled**: :meth:`pooling_rows` (the rows to pool from and the row of each
  input key, pooled by the pooling kernel of :attr:`kernels`);
- **backward**: :meth:`occurrence_grads` of the parts' gradients (or a pooled gradient built
  over ``inverse``, reading it strided where :attr:`reads_strided_grads`), then
  :meth:`apply_gradients` for the members ``taking`` a gradient, each at its own step, once
  per member (:meth:`applied_to` says which already took theirs);
- **pins**: :meth:`release` ends them for every member (once; a second call does nothing);
  after the module regrouped its tables, :meth:`rehome` moves the batch to the new groups,
  or, where it cannot, :meth:`end_pins_alone` ends its pins table by table;
- **reading one member**: :meth:`member` (that table's part as a :class:`TableBatch` of its
  own, a copy), :meth:`tensors` (every tensor held, for CUDA stream bookkeeping).

A training batch of a CUSTOMIZED table carries the score it writes, checked by
:func:`check_batch_score`.

What each kind does underneath (claims, fills, kernels, the storage mode) stays in its
group: :class:`~dynemb.tables.groups.TableGroup` or
:class:`~dynemb.tables.group_tiers.TieredGroup`.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from dynemb.options import StorageMode
from dynemb.rows.optimizers import OccurrenceGrads
from dynemb.types import ScorePolicy


class PoolingRows(NamedTuple):
    """Where a batch's bags pool from: ``rows`` and, for each input key, its row in them
    (``index`` [N]); the pooling kernel reads ``rows`` [R, W >= dim] in place (only their
    first ``dim`` columns)."""

    rows: torch.Tensor
    index: torch.Tensor


class LookupBatch:
    """The interface of the module docstring; subclasses provide the abstract parts."""

    keys: torch.Tensor  # [U] the unique keys of every member, member after member
    inverse: torch.Tensor  # [N] the unique index of each input key
    key_bounds: List[int]  # [members + 1] where each member's input keys start, and N
    consumed: bool  # a forward looked the batch up

    # -- members ---------------------------------------------------------------------------
    @property
    def names(self) -> Tuple[str, ...]:
        """The member tables, in the order of their input keys."""
        raise NotImplementedError

    def key_range(self, name: str) -> Tuple[int, int]:
        """``(start, end)`` of member ``name``'s input keys in ``inverse``."""
        t = self.names.index(name)
        bounds = self.key_bounds
        return bounds[t], bounds[t + 1]

    def table_remapped(self, name: str, remap: torch.Tensor) -> None:
        """Member ``name`` grew (:meth:`DynamicTable.grow <dynemb.tables.base.DynamicTable.grow>`):
        its slots move by ``remap`` (its old slot -> new)."""
        raise NotImplementedError

    def rows_moved(self, storage, old_offsets: Sequence[int]) -> None:
        """The table group of ``storage`` laid its tables out again (one of them grew); a
        batch of that group renumbers its slots from the parts that started at
        ``old_offsets``. Any other batch is unchanged."""

    def member(self, name: str):
        """Member ``name``'s part as a :class:`TableBatch` of its own
        (for reading)."""
        raise NotImplementedError

    def tensors(self) -> List[torch.Tensor]:
        """Every tensor the batch holds (to mark them used by another CUDA stream)."""
        raise NotImplementedError

    @property
    def dim(self) -> int:
        """The embedding dim of every member."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        """Where the module reads the rows."""
        raise NotImplementedError

    @property
    def kernels(self):
        """The kernel backend of the batch's rows (``pool_bags`` for :meth:`pooling_rows`)."""
        raise NotImplementedError

    # -- forward -----------------------------------------------------------------------------
    def lookup_occurrences(self, sizes: Optional[Sequence[int]] = None
                           ) -> Tuple[torch.Tensor, ...]:
        """Every input key's row (float32), split into parts of ``sizes`` (None: one part per
        member)."""
        raise NotImplementedError

    def pooling_rows(self) -> PoolingRows:
        """The rows to pool the batch's bags from (see :class:`PoolingRows`)."""
        raise NotImplementedError

    # -- backward ----------------------------------------------------------------------------
    @property
    def reads_strided_grads(self) -> bool:
        """Whether the update kernel may read the gradients through a strided view (the host
        kernels); else it takes contiguous rows."""
        return self.kernels.reads_strided_grads

    def occurrence_grads(self, grads: Sequence[Optional[torch.Tensor]], *,
                         clip: Optional[float],
                         sizes: Optional[Sequence[int]] = None) -> OccurrenceGrads:
        """The gradients of every input key's row, ``grads`` one per part of
        :meth:`lookup_occurrences` of the same ``sizes`` (None for a part that took none:
        zeros there), summed per row by the update."""
        if len(grads) == 1:
            occurrence = grads[0]
        else:
            sizes = self._part_sizes(sizes)
            occurrence = torch.cat([
                g if g is not None else torch.zeros(size, self.dim, device=self.device)
                for g, size in zip(grads, sizes)])
        return OccurrenceGrads.from_inverse(occurrence, self.inverse, self.keys.numel(),
                                            clip=clip, kernels=self.kernels)

    def applied_to(self, name: str) -> bool:
        """Whether member ``name``'s update of this batch already ran."""
        raise NotImplementedError

    def apply_gradients(self, grads: OccurrenceGrads, taking: Sequence[bool], *, lr: float,
                        steps) -> None:
        """The fused update of the rows of the members ``taking`` a gradient (one flag per
        member), each at its ``steps[name]``, from ``grads`` of the batch's unique keys; then
        those members' pins end."""
        raise NotImplementedError

    # -- pins --------------------------------------------------------------------------------
    def release(self) -> None:
        """End the batch's pins, for every member (once)."""
        raise NotImplementedError

    def rehome(self, groups: Sequence) -> bool:
        """After the module regrouped its tables: make the batch one of ``groups`` if its own
        group is gone. False where it cannot (its group had other tables)."""
        raise NotImplementedError

    def end_pins_alone(self) -> None:
        """End the batch's pins table by table, in each member's own arrays."""
        raise NotImplementedError

    def _part_sizes(self, sizes: Optional[Sequence[int]]) -> Sequence[int]:
        """``sizes``, or one part per member when None."""
        if sizes is not None:
            return sizes
        bounds = self.key_bounds
        return [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]


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
