"""Rows written into a table by key (``write_rows``, HierarchicalKV's ``insert_or_assign``):
a key the table holds has its row replaced, a key it does not hold is inserted with the row
given, all or nothing.

A write is a :class:`RowWrite` in three steps, so that a sharded module can claim on every
rank before any rank writes: :meth:`RowWrite.claim` checks and claims (what can fail fails
here, and leaves the table as it was), then :meth:`RowWrite.commit` writes, or
:meth:`RowWrite.undo` takes the claim back. :func:`write_rows` does the three for one table.

Where the rows go, by storage mode (each through the kernels a training claim runs):

- HBM_DIRECT, HOST_ONLY: a claim of the keys in the table's tier (its group's
  ``find_or_insert``: growth, eviction by score of unpinned rows, as a training claim);
- DEFAULT: each key in the tier it routes to (device or host), claimed there;
- CACHE: keys the cache holds have their cached row replaced; the others go to the backing
  store (as a checkpoint load puts them), from which the cache loads them at their next
  lookup. A bulk write (a warm start) is usually larger than the cache: through the cache, it
  would write most rows twice and evict the hot ones. A default store that would have to
  forget rows to take the new ones refuses the write.

What a write does to the rest of the table:

- **scores**: ``scores`` given, each key's score becomes exactly that (whatever the policy,
  as a checkpoint load sets them). Otherwise a key the table held keeps its score (a write is
  not a use), and a new key gets the score of one use now (LRU / STEP: the table's clock,
  LFU: 1, LFU_LRU both; CUSTOMIZED: ``default_score``, the module's ``set_scores`` score,
  required when no ``scores`` are given);
- **optimizer state**: ``optimizer_state`` given (the logical layout ``read_rows(...,
  with_state=True)`` returns after the embedding), it is written; otherwise a key the table
  held keeps its state and a new key starts from a new row's (zeros);
- **evictions**: a new key whose bucket is full evicts the unpinned row with the lowest
  score (dropped, or written back to the store in CACHE), counted in ``evictions``; rows
  pinned by a batch in flight are never evicted;
- **batches in flight**: a key held by a prefetched batch keeps its slot and its row is
  replaced in place: that batch's forward reads the written row; a batch awaiting its
  backward applies its update on top of the written row (as to any row's current value);
- **admission** does not apply (a write is not a lookup): a written key is stored;
- **counts**: ``stats()["write_inserts"]`` (keys new to the table) and
  ``stats()["write_overwrites"]`` (keys it held, anywhere), kept on the host as
  ``stats()["expired"]`` is, and like it not saved in checkpoints;
- **checkpoints**: the slots written are marked for the next incremental dump (the store's
  keys logged, as its write-backs are).

Example::

    >>> from dynemb.options import DynamicEmbTableOptions, choose_storage_mode
    >>> from dynemb.rows.optimizers import OptimizerConfig
    >>> from dynemb.tables import build_table
    >>> layout = choose_storage_mode(DynamicEmbTableOptions(), name="t", num_embeddings=64,
    ...                              width=2, config_dtype=torch.float32)
    >>> table = build_table("t", 0, 2, layout, DynamicEmbTableOptions(), OptimizerConfig(),
    ...                     torch.device("cpu"))
    >>> write_rows(table, torch.tensor([7, 9]), torch.tensor([[1., 2.], [3., 4.]]))
    >>> table.read_rows(torch.tensor([9, 7, 5]))[0].tolist()
    [[3.0, 4.0], [1.0, 2.0], [0.0, 0.0]]
    >>> stats = table.stats(); stats["write_inserts"], stats["write_overwrites"]
    (2, 0)
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch

from dynemb.backends.protocol import Segments
from dynemb.foundations.key_mixing import routes_to_first
from dynemb.foundations.validation import check_keys
from dynemb.rows.row_moves import copy_rows
from dynemb.tables.base import DynamicTable
from dynemb.tables.grouping import group_of_one
from dynemb.tables.groups import Claim, TableGroup
from dynemb.tables.policies import storage_policy
from dynemb.types import (EMPTY_KEY, TOMBSTONE_KEY, FindOrInsertResult, ScorePolicy,
                          TableFullError, pack_lfu_lru)


class WriteInput(NamedTuple):
    """A write's checked inputs, on the table's device: ``keys`` [N] int64 distinct,
    ``rows`` [N, dim] in the table's dtype, ``state`` [N, state_dim] float32 or None,
    ``scores`` [N] int64 or None."""

    keys: torch.Tensor
    rows: torch.Tensor
    state: Optional[torch.Tensor]
    scores: Optional[torch.Tensor]


def check_write(table: DynamicTable, keys, rows, optimizer_state=None, scores=None,
                default_score: Optional[int] = None) -> WriteInput:
    """The inputs of a write into ``table`` checked (see :func:`write_rows`), on the table's
    device; ``ValueError`` / ``TypeError`` naming the table and the problem otherwise."""
    where = f"write_rows into table {table.name!r}"
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64 or keys.dim() != 1:
        raise ValueError(f"{where}: keys must be a 1-D int64 tensor, got "
                         f"{_describe(keys)}")
    n = keys.numel()
    keys = keys.to(table.device)
    try:
        check_keys(keys, table.device, kernels=table.kernels)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    if n:
        unique, _, counts = table.kernels.dedup(keys)  # the hash kernel, not a sort
        if unique.numel() != n:
            raise ValueError(f"{where}: keys must be distinct, key "
                             f"{int(unique[counts > 1][0])} appears {int(counts.max())} times "
                             f"(one row per key)")
    dtype = table.row_layout.dtype
    if not isinstance(rows, torch.Tensor) or rows.shape != (n, table.dim):
        raise ValueError(f"{where}: rows must have shape [{n}, {table.dim}] (one row of the "
                         f"table's dim per key), got {_describe(rows)}")
    if rows.dtype != dtype:
        raise ValueError(f"{where}: rows are {rows.dtype}, the table holds {dtype} (convert "
                         f"them first: rows are written bit for bit)")
    rows = rows.detach().to(table.device)  # (a parameter's rows: their values)
    state = None
    if optimizer_state is not None:
        if not isinstance(optimizer_state, torch.Tensor) or optimizer_state.shape != (
                n, table.state_dim):
            raise ValueError(f"{where}: optimizer_state must have shape [{n}, "
                             f"{table.state_dim}] (the {table.optimizer.type.name} state of "
                             f"a row of dim {table.dim}), got {_describe(optimizer_state)}")
        if optimizer_state.dtype != torch.float32:
            raise ValueError(f"{where}: optimizer_state must be float32, got "
                             f"{optimizer_state.dtype}")
        state = optimizer_state.detach().to(table.device)
    if scores is not None:
        if not isinstance(scores, torch.Tensor) or scores.dtype != torch.int64 or \
                scores.shape != (n,):
            raise ValueError(f"{where}: scores must be an int64 tensor of shape [{n}] (one "
                             f"per key), got {_describe(scores)}")
        scores = scores.to(table.device)
    elif table.tier.hash.policy is ScorePolicy.CUSTOMIZED and default_score is None:
        raise ValueError(f"{where}: the table has score_strategy CUSTOMIZED: pass scores= "
                         f"(or set the module's score with set_scores)")
    return WriteInput(keys, rows, state, scores)


class _TierClaim(NamedTuple):
    """One tier's part of a write: its group (a visitor over the table's arrays), the
    positions of the write's keys it holds, and its claim (pinned)."""

    group: TableGroup
    at: torch.Tensor
    segments: Segments
    claim: Claim


class RowWrite:
    """One write of rows into ``table`` (see the module docstring): built from checked
    inputs (:func:`check_write`); :meth:`claim`, then :meth:`commit` or :meth:`undo`."""

    def __init__(self, table: DynamicTable, data: WriteInput,
                 default_score: Optional[int] = None):
        self.table = table
        self.data = data
        self.default_score = default_score
        self._claims: List[_TierClaim] = []
        self._cache = None  # CACHE: (cached slots, cached mask, store's answer)
        self._claimed = False

    @property
    def _to_store(self) -> bool:
        return storage_policy(self.table.mode).backing_store

    # -- claim ---------------------------------------------------------------------------
    def claim(self) -> None:
        """Claim a slot for every key (pinned until :meth:`commit` or :meth:`undo`). A key
        that finds none raises :class:`TableFullError` with the table as it was (a table
        that grows may have grown)."""
        if self._claimed:
            raise RuntimeError("this write was claimed already")
        if self.data.keys.numel():
            if self._to_store:
                self._claim_cache()
            else:
                self._claim_tiers()
        self._claimed = True

    def _claim_tiers(self) -> None:
        keys = self.data.keys
        group = group_of_one(self.table)
        parts = getattr(group, "tiers", None)  # DEFAULT: (device tiers, host tiers)
        if parts is None:
            plan = [(group, torch.ones_like(keys, dtype=torch.bool))]
        else:
            device_cap = self.table.tier.hash.capacity
            host_cap = self.table.host_tier.hash.capacity
            on_device = routes_to_first(keys, device_cap, device_cap + host_cap)
            plan = [(parts[1], ~on_device), (parts[0], on_device)]
        try:
            for tier_group, mask in plan:
                at = mask.nonzero().flatten()
                if at.numel():
                    self._claims.append(self._claim_in(tier_group, at))
        except BaseException:
            self.undo()
            raise

    def _claim_in(self, group: TableGroup, at: torch.Tensor) -> _TierClaim:
        """Claim ``keys[at]`` in ``group``'s one table; on a refusal the claim is undone and
        ``TableFullError`` raised."""
        device = group.device
        keys = self.data.keys[at].to(device)
        storage = group.storage
        if storage.growing:  # as a training claim: grow first where the keys would pass
            capacity = storage.tier_of(self.table).hash.capacity_to_claim(keys)
            if capacity is not None:
                storage.grow_tables([(0, capacity)])
        segments = Segments.single(keys.numel(), device)
        score = 0 if self.default_score is None else self.default_score
        claim, _ = group.claim(segments, keys, keys.new_ones(1).expand(keys.shape), [score])
        failed = claim.slots < 0
        if bool(failed.any()):
            group.undo(claim, segments)
            tier = storage.tier_of(self.table)
            where = "host tier" if storage.tier_name == "host_tier" else "device tier"
            raise TableFullError(
                f"write_rows into table {self.table.name!r}: {int(failed.sum())} of "
                f"{keys.numel()} keys found no slot in its {where} "
                f"({tier.hash.capacity} rows, {tier.hash.pinned_count()} pinned by batches "
                f"in flight; policy {storage.policy.name}); nothing was written",
                keys[failed], None)
        return _TierClaim(group, at, segments, claim)

    def _claim_cache(self) -> None:
        table, keys = self.table, self.data.keys
        hash_table = table.tier.hash
        slots = hash_table.find(keys)
        hash_table.retain(slots)  # the cached rows stay put until the commit
        cached = slots >= 0
        away = keys[~cached]
        stored = table.store.find(away) if away.numel() else None
        if stored is not None:
            stored = tuple(t.to(table.device) for t in stored)
            new = int((~stored[1]).sum())
            room = getattr(table.store, "room", None)
            if callable(room) and room() is not None and new > room():
                hash_table.release(slots)
                raise TableFullError(
                    f"write_rows into table {table.name!r}: its backing store takes "
                    f"{room()} more rows without forgetting any, the write brings {new} new "
                    f"keys; give the store more room (max_capacity) or write fewer rows. "
                    f"Nothing was written", away[~stored[1]], None)
        self._cache = (slots, cached, stored)

    # -- commit / undo ----------------------------------------------------------------------
    def commit(self) -> None:
        """Write the rows, scores and optimizer state into the claimed slots (or the
        store), count them, mark them for the next incremental dump, and end the pins."""
        if not self._claimed:
            raise RuntimeError("claim the write before committing it")
        self._claimed = False
        if self._cache is not None:
            self._commit_cache()
            return
        table = self.table
        inserted = evicted = 0
        layout, data = table.row_layout, self.data
        whole = self._whole_rows()
        for part in self._claims:
            group, claim = part.group, part.claim
            storage = group.storage
            group.track_changes(claim)
            weights, slots = storage.weights, claim.slots
            if whole is not None:
                source, at = whole, part.at
            else:  # a held key keeps its state; a new one starts from a new row's: zeros
                source = weights.index_select(0, slots)
                layout.embeddings(source).copy_(data.rows[part.at].to(weights.device))
                layout.state(source)[claim.inserted] = 0.0
                at = torch.arange(slots.numel(), device=slots.device)
            copy_rows(source.to(weights.device), at.to(weights.device), weights, slots,
                      kernels=storage.kernels)
            scores = storage.arrays.scores
            if self.data.scores is not None:
                scores.index_copy_(0, slots, self.data.scores[part.at].to(scores.device))
            else:  # a key held keeps its score; a new one keeps the claim's (one use)
                found = ~claim.inserted
                scores.index_copy_(0, slots[found], claim.prev_scores[found])
            storage.kernels.add_refcounts(storage.arrays, slots, -1)
            inserted += int(claim.inserted.sum())
            evicted += int((claim.inserted & (claim.prev_keys != EMPTY_KEY)
                            & (claim.prev_keys != TOMBSTONE_KEY)).sum())
        self._claims = []
        n = self.data.keys.numel()
        table.write_inserts += inserted
        table.write_overwrites += n - inserted
        table.counters.add("evictions", evicted)

    def _whole_rows(self) -> Optional[torch.Tensor]:
        """Every key's physical row [N, width] where the write gives it whole (the state
        given, or none to keep), else None."""
        layout, data = self.table.row_layout, self.data
        if data.state is not None:  # (half rows upcast and back: exact)
            return layout.to_physical(torch.cat([data.rows.float(), data.state], 1))
        return data.rows if layout.state_dim == 0 else None

    def _commit_cache(self) -> None:
        table, (keys, rows, state, scores) = self.table, self.data
        slots, cached, stored = self._cache
        self._cache = None
        layout, hash_table = table.row_layout, table.tier.hash
        try:
            overwritten = int(cached.sum())
            if stored is not None:  # the keys not cached: into the store
                away = ~cached
                old_rows, found, old_scores = stored
                whole = self._whole_rows()
                if whole is not None:
                    physical = whole[away]
                else:  # a stored key keeps its state; a new one starts from zeros
                    physical = torch.zeros(int(away.sum()), layout.width, dtype=layout.dtype,
                                           device=rows.device)
                    layout.embeddings(physical).copy_(rows[away])
                    if bool(found.any()):
                        layout.state(physical)[found] = layout.state(
                            old_rows[found].to(layout.dtype))
                store_scores = (scores[away] if scores is not None else torch.where(
                    found, old_scores, self._new_score(hash_table)))
                dropped = table.store.insert(keys[away], physical, store_scores)
                table.counters.add("store_evictions", dropped)
                if table.changes is not None:
                    table.changes.written_back(keys[away])
                overwritten += int(found.sum())
            hit = slots[cached]
            weights = table.tier.flat.weights
            layout.embeddings(weights).index_copy_(0, hit, rows[cached])
            if state is not None:
                layout.state(weights).index_copy_(0, hit, state[cached])
            if scores is not None:
                hash_table.arrays.scores.index_copy_(0, hit, scores[cached])
            if table.changes is not None:
                held = keys[cached]
                table.changes.claimed(table.tier, FindOrInsertResult(
                    held, None, hit, torch.zeros_like(held, dtype=torch.bool), held, held,
                    None, None))
        finally:
            hash_table.release(slots)
        n = keys.numel()
        table.write_inserts += n - overwritten
        table.write_overwrites += overwritten

    def _new_score(self, hash_table) -> int:
        """The score of one use of a new key now, by the table's policy (a key sent to
        the store: what a claim now would give it)."""
        policy, clock = hash_table.policy, hash_table.clock
        if policy is ScorePolicy.CUSTOMIZED:
            return int(self.default_score)
        if policy is ScorePolicy.LFU:
            return 1
        if policy is ScorePolicy.LFU_LRU:
            return int(pack_lfu_lru(torch.tensor(1), torch.tensor(clock)))
        return clock if policy in (ScorePolicy.LRU, ScorePolicy.STEP) else 0

    def undo(self) -> None:
        """Take the claim back: the table as before it (a table that grew keeps its
        capacity)."""
        for part in reversed(self._claims):
            part.group.undo(part.claim, part.segments)
        self._claims = []
        if self._cache is not None:
            self.table.tier.hash.release(self._cache[0])
            self._cache = None
        self._claimed = False


def write_rows(table: DynamicTable, keys: torch.Tensor, rows: torch.Tensor, *,
               optimizer_state: Optional[torch.Tensor] = None,
               scores: Optional[torch.Tensor] = None,
               default_score: Optional[int] = None) -> None:
    """Write ``rows`` [N, dim] (the table's dtype) for ``keys`` [N] (int64, distinct) into
    ``table``, all or nothing (see the module docstring): bad input raises ``ValueError``, a
    key that finds no slot :class:`TableFullError`, and the table is unchanged.
    ``optimizer_state`` [N, state_dim] float32, ``scores`` [N] int64: see the module
    docstring; ``default_score``: a CUSTOMIZED table's score for new keys without
    ``scores``."""
    write = RowWrite(table, check_write(table, keys, rows, optimizer_state, scores,
                                        default_score), default_score)
    write.claim()
    write.commit()


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {list(value.shape)}"
    return type(value).__name__
