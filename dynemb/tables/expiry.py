"""Expiry: erase the rows nobody has looked up for a while, on every tier of a table.

Capacity eviction bounds a table's memory but keeps rows unseen for months; expiry erases
them. A table's age unit is its **step**: its clock, which moves by one at every training
claim of its keys (one per training batch). Which rows are old is read from their scores,
so what expiry means depends on the score policy (:class:`~dynemb.ScorePolicy`):

- ``LRU``: a row's score is the step of its latest training lookup: ``older_than=n`` erases
  the rows not looked up in the last ``n`` steps;
- ``LFU_LRU``: the same, from the step packed in the score's low bits;
- ``STEP``: the score is the step the row was inserted at: ``older_than=n`` erases the rows
  inserted ``n`` or more steps ago, looked up since or not;
- ``LFU``, ``CUSTOMIZED``, ``NO_EVICTION``: scores carry no step: ``older_than`` and the
  ``ttl_steps`` option are refused; :func:`plan_expiry` with a predicate over keys and
  scores (``where``) erases by any rule, as HierarchicalKV's ``erase_if`` does.

Every tier is swept: the device tier, a DEFAULT table's host tier, and a CACHE table's
backing store (whose rows keep the scores the cache gave them: their age is counted on the
cache's clock); a store must then have ``erase(keys)`` (the stores of :mod:`dynemb.stores` do).
The store may hold a stale copy of a cached row: the cached row decides (a key erased from
the cache goes from the store too, and a stale copy of a key still cached stays).
A pinned row (a batch prefetched, or awaiting its backward) is never erased. An expiry is
planned whole before anything is erased: a predicate that raises or answers wrongly leaves
every tier unchanged.

Example::

    >>> from dynemb.options import DynamicEmbTableOptions, choose_storage_mode
    >>> from dynemb.rows.optimizers import OptimizerConfig
    >>> from dynemb.tables import build_table
    >>> from dynemb.tables.grouping import group_of_one
    >>> layout = choose_storage_mode(DynamicEmbTableOptions(), name="t", num_embeddings=64,
    ...                              width=4, config_dtype=torch.float32)
    >>> table = build_table("t", 0, 4, layout, DynamicEmbTableOptions(), OptimizerConfig(),
    ...                     torch.device("cpu"))
    >>> group = group_of_one(table)
    >>> for keys in ([1, 2], [2], [2]):  # steps 1, 2, 3: key 1 last seen at step 1
    ...     group.prefetch([torch.tensor(keys)], [None], [None]).release()
    >>> plan_expiry(table, older_than=2).apply()  # key 1: 2 steps without a lookup
    1
    >>> table.read_rows(torch.tensor([1, 2]))[1].tolist()
    [False, True]
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from dynemb.options import TIMED_POLICIES
from dynemb.types import LFU_LRU_MAX_CLOCK, ScorePolicy

#: Entries read at a time by a sweep.
SWEEP_CHUNK_ROWS = 1 << 16

Predicate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_timed(name: str, policy: ScorePolicy) -> None:
    """Refuse an age for a table whose scores hold no step."""
    if policy not in TIMED_POLICIES:
        timed = ", ".join(p.name for p in TIMED_POLICIES)
        raise ValueError(f"table {name!r} has score_strategy {policy.name}, whose scores hold "
                         f"no step: expiry by age needs {timed}; expire it with a predicate "
                         f"over its scores (where=) instead")


def age_rule(policy: ScorePolicy, clock: int, steps: int) -> Predicate:
    """The predicate of rows last used (``STEP``: inserted) ``steps`` or more steps before
    ``clock``, for scores of ``policy``."""
    def old(keys: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        used = scores & LFU_LRU_MAX_CLOCK if policy is ScorePolicy.LFU_LRU else scores
        return clock - used >= steps
    return old


class ExpiryPlan:
    """What an expiry erases, found before anything is: per hash tier, the slots and keys;
    per store, the keys. :meth:`apply` erases them (pinned rows stay) and returns how many
    rows went."""

    def __init__(self, table):
        self.table = table
        self.tiers: List[Tuple[object, torch.Tensor, torch.Tensor]] = []  # (tier, slots, keys)
        #: keys the store alone holds that the rule chose (counted when erased)
        self.store_keys: Optional[torch.Tensor] = None

    def apply(self) -> int:
        """Erase the planned rows: the store's first, so that a store that fails (a full
        disk) leaves the cache as it was and no stale copy outlives its cached row."""
        table, erased = self.table, 0
        if self.store_keys is not None:
            stale = [keys.to(self.store_keys.device) for _, _, keys in self.tiers]
            table.store.erase(torch.cat([self.store_keys, *stale]))  # one write
            erased += self.store_keys.numel()  # (stored when planned; the stale copies: not)
            if table.changes is not None:
                table.changes.store_erased = True
        for tier, slots, keys in self.tiers:
            gone = tier.hash.erase(keys).erased
            if table.changes is not None:  # a slot erased is a key that left the tier
                table.changes.erased(tier, slots[gone], keys[gone])
            erased += int(gone.sum())
        table.expired += erased
        return erased


def plan_expiry(table, *, older_than: Optional[int] = None,
                where: Optional[Predicate] = None) -> ExpiryPlan:
    """The rows of ``table`` to erase: those ``older_than`` steps (see the module docstring),
    or those for which ``where(keys, scores)`` ([N] int64 each, on the tier's device) answers
    True ([N] bool). Raises, with nothing erased, on a wrong answer or a store without
    ``erase``."""
    if (older_than is None) == (where is None):
        raise ValueError("give one of older_than (steps) and where (a predicate)")
    policy, clock = table.tier.hash.policy, table.tier.hash.clock
    if older_than is not None:
        check_timed(table.name, policy)
        if isinstance(older_than, bool) or not isinstance(older_than, int) or older_than < 1:
            raise ValueError(f"older_than must be a positive int (steps), got {older_than!r}")
    elif not callable(where):
        raise TypeError(f"where must be a callable (keys, scores) -> bool mask, got {where!r}")
    plan = ExpiryPlan(table)
    for _, tier in table.tracked_tiers():
        rule = where or age_rule(policy, tier.hash.clock, older_than)
        slots, keys = _chosen(tier.hash, rule, table.name)
        plan.tiers.append((tier, slots, keys))
    store = getattr(table, "store", None)
    if store is not None:
        if not callable(getattr(store, "erase", None)):
            raise TypeError(f"table {table.name!r}: its backing store {store!r} has no "
                            f"erase(keys), so its rows cannot expire; nothing was erased")
        plan.store_keys = _chosen_stored(store, where or age_rule(policy, clock, older_than),
                                         table.name, table.tier.hash)
    return plan


def _checked(answer, keys: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(answer, torch.Tensor) or answer.dtype != torch.bool \
            or answer.shape != keys.shape:
        got = (f"{answer.dtype} {tuple(answer.shape)}" if isinstance(answer, torch.Tensor)
               else type(answer).__name__)
        raise TypeError(f"table {name!r}: where must answer a bool tensor of the keys' shape "
                        f"{tuple(keys.shape)}, got {got}; nothing was erased")
    return answer.to(keys.device)


def _chosen(hash_table, rule: Predicate, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(slots, keys) of the live entries of ``hash_table`` that ``rule`` chooses."""
    slots, keys, start = [], [], 0
    while start < hash_table.capacity:
        chunk = hash_table.export(start, SWEEP_CHUNK_ROWS)
        start = chunk.next_start
        if chunk.keys.numel():
            chosen = _checked(rule(chunk.keys, chunk.scores), chunk.keys, name)
            slots.append(chunk.slots[chosen])
            keys.append(chunk.keys[chosen])
    empty = torch.empty(0, dtype=torch.int64, device=hash_table.device)
    return (torch.cat(slots) if slots else empty), (torch.cat(keys) if keys else empty)


def _chosen_stored(store, rule: Predicate, name: str, cache) -> torch.Tensor:
    """The keys of ``store`` not in ``cache`` that ``rule`` chooses (their scores from the
    store's ``find`` where its ``export`` gives none)."""
    chosen, start = [], 0
    while start is not None:
        *parts, start = store.export(start, SWEEP_CHUNK_ROWS)
        keys = parts[0]
        if keys.numel() == 0:
            continue
        scores = parts[2] if len(parts) == 3 else store.find(keys)[2]
        keys = keys.to(cache.device)
        chosen_keys = _checked(rule(keys, scores.to(keys.device)), keys, name)
        chosen.append(keys[chosen_keys & (cache.find(keys) < 0)])
    return torch.cat(chosen) if chosen else torch.empty(0, dtype=torch.int64)
