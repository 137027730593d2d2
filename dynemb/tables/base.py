"""``DynamicTable``: what every storage mode shares (one table on one rank).

The life of a batch, whatever the mode:

- ``prefetch(keys, training)`` -> :class:`TableBatch`: dedup, count, then the mode's
  ``_resolve`` (HBM_DIRECT and CACHE find or insert and pin here; DEFAULT waits for forward);
- ``lookup(batch)`` -> one float32 row per unique key;
- ``apply_gradients(batch, grads, lr, step)``: the fused optimizer update, once, then unpin.

Subclasses (one per :class:`~dynemb.options.StorageMode`, see :func:`dynemb.tables.build_table`)
say where rows live and move. Shapes follow the unique keys; on CUDA they are padded to the
input length (``EMPTY_KEY`` entries, slot -1) so the hot path never reads a size on the host.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional, Tuple, Union

import torch

from dynemb.rows.admission import AdmissionCounter
from dynemb.backends.numba_backends import backend_for_device
from dynemb.foundations.counters import COUNTER_NAMES, TableCounters
from dynemb.rows.dedup import unique_keys
from dynemb.rows.flat_table import RowLayout
from dynemb.rows.initializers import Initializer
from dynemb.rows.optimizers import OccurrenceGrads, OptimizerConfig, fused_update
from dynemb.options import DynamicEmbTableOptions, StorageMode, TableLayout
from dynemb.tables.batch import TableBatch, check_batch_score
from dynemb.tables.checkpoint_tiers import CheckpointTiers
from dynemb.tables.held_batches import HeldBatches
from dynemb.tables.memory import MemoryBreakdown, PlannedRows, storage_bytes
from dynemb.tables.tier import DeferredFailures, Tier
from dynemb.types import EMPTY_KEY, TableFullError
from dynemb.foundations.validation import canonical_device, check_keys


class DynamicTable(CheckpointTiers):
    """The shared part of the storage-mode classes; built by
    :func:`dynemb.tables.build_table` (through :class:`~dynemb.DynamicEmbCollection`).

    The collections settle ``options.initializer`` from the table's config first
    (:func:`dynemb.options.resolve_initializer`); a table built from options whose
    initializer is still None (no config to read) starts its rows from ``Initializer()``.
    """

    mode: StorageMode

    def __init__(self, name: str, table_id: int, dim: int, layout: TableLayout,
                 options: DynamicEmbTableOptions, optimizer: OptimizerConfig,
                 device: torch.device, backend: Optional[str] = None):
        if layout.mode is not self.mode:
            raise ValueError(f"{type(self).__name__} stores {self.mode.name} tables, the layout "
                             f"of {name!r} is {layout.mode.name}")
        self.name = name
        self.table_id = table_id
        self.dim = dim
        self.layout = layout
        if options.initializer is None:
            options = dataclasses.replace(options, initializer=Initializer())
        self.options = options
        self.optimizer = optimizer
        self.device = canonical_device(device)
        self.backend = backend
        self.kernels = backend_for_device(self.device, backend)
        self.state_dim = optimizer.state_dim(dim)
        self.row_layout = RowLayout(dim, self.state_dim, layout.dtype)
        self.width = self.row_layout.width  # physical columns of a row, as stores hold them
        self.tier = self._build_tier()
        self.admission = (AdmissionCounter(options.admission, self.device, self.kernels)
                          if options.admission is not None else None)
        self.counters = TableCounters(self.device)
        self._held = HeldBatches()
        self._deferred = DeferredFailures(self.device)
        #: a :class:`~dynemb.checkpoint.changes.ChangeTracker` once checkpoint files track
        #: this table for incremental dumps (told of every claim, growth and update)
        self.changes = None

    _grows = False  # the device tier doubles up to max_capacity (HBM_DIRECT only)

    def _build_tier(self) -> Tier:
        """The table's own tier, ``self.tier`` (on the device but for HOST_ONLY)."""
        return Tier(self.layout, self.layout.init_capacity, self.dim, self.state_dim,
                    self.options, self.device, self.kernels, grow=self._grows)

    def __setstate__(self, state: Dict) -> None:
        self.__dict__.update(state)
        if isinstance(self._held, list):  # pickled by an earlier version
            self._held = HeldBatches(self._held)

    def empty_copy(self) -> "DynamicTable":
        """A new, empty table of the same configuration (name, layout, options, device)."""
        return type(self)(self.name, self.table_id, self.dim, self.layout, self.options,
                          self.optimizer, self.device, self.backend)

    # -- what a mode provides ------------------------------------------------------------------
    def _resolve(self, batch: TableBatch) -> None:
        """Prefetch's part of the mode: find or insert (training) or find (eval) and pin."""
        raise NotImplementedError

    def lookup(self, batch: TableBatch) -> torch.Tensor:
        """[U, dim] float32 rows of the batch's unique keys."""
        raise NotImplementedError

    def lookup_occurrences(self, batch: TableBatch) -> torch.Tensor:
        """[N, dim] float32 rows of the batch's input keys, one per occurrence (a table that
        can gather them straight from its rows overrides this)."""
        return self.lookup(batch).index_select(0, batch.inverse)

    def rows_in_place(self, batch: TableBatch):
        """(float32 rows, slot of each input key) to pool from in place, or None: see
        :meth:`HbmDirectTable.rows_in_place <dynemb.tables.hbm_direct.HbmDirectTable>`."""
        return None

    def _update(self, batch: TableBatch, grads: OccurrenceGrads, lr: float, step: int) -> None:
        """Apply the optimizer step ``grads`` (of U rows) to the batch's rows."""
        raise NotImplementedError

    def _row_sources(self) -> Iterable[Tuple[str, object]]:
        """Where rows live besides the device tier, for ``read_rows``: ("tier", Tier) or
        ("store", BackingStore) pairs, least authoritative first."""
        return ()

    def _rows_backing(self) -> int:
        """Rows held outside the device tier."""
        return 0

    def _host_memory(self) -> MemoryBreakdown:
        """Bytes of the host tier or backing store."""
        return MemoryBreakdown()

    @classmethod
    def planned_rows(cls, layout: TableLayout, options: DynamicEmbTableOptions) -> PlannedRows:
        """The rows a table of ``layout`` holds at its largest, before it is built."""
        raise NotImplementedError

    @staticmethod
    def fixed_memory() -> MemoryBreakdown:
        """Bytes every table holds whatever its size (``other_bytes`` and ``host_other_bytes``
        of :meth:`memory_breakdown`): one int64 per counter of
        :data:`~dynemb.foundations.counters.COUNTER_NAMES` and the int64 count of deferred slot
        failures on the device, that count's mirror on the host.

        Example::

            >>> DynamicTable.fixed_memory().other_bytes
            96
        """
        int64 = torch.int64.itemsize
        return MemoryBreakdown(other_bytes=(len(COUNTER_NAMES) + 1) * int64,
                               host_other_bytes=int64)

    # -- prefetch ------------------------------------------------------------------------------
    def prefetch(self, keys: torch.Tensor, training: bool,
                 occurrences: Optional[torch.Tensor] = None,
                 score: Optional[int] = None) -> TableBatch:
        """Dedup ``keys`` [N] and resolve them as the mode does at prefetch.

        ``occurrences`` [N] (int64), when given, says how many times each entry of ``keys``
        stands for (ids deduplicated upstream); counts and counters use it. ``score``: what
        a training batch of a CUSTOMIZED table writes as the score of each of its keys
        (required there, see :func:`check_batch_score`; ignored by the other policies).
        The same as :meth:`claim_batch` then :meth:`finish_batch`."""
        return self.finish_batch(self.claim_batch(keys, training, occurrences, score))

    def claims_apart(self, training: bool) -> bool:
        """Whether :meth:`claim_batch` of such a batch only claims (and :meth:`undo_batch`
        can take it back exactly); else it does all of the prefetch. A mode that says so
        provides ``_claim_training``, ``_finish_training`` and ``_undo_claim``."""
        return False

    def _claim_training(self, batch: TableBatch):
        """Where :meth:`claims_apart`: claim and pin the training ``batch``'s rows, neither
        filled nor counted; returns what :meth:`_finish_training` and :meth:`_undo_claim`
        take."""
        raise NotImplementedError

    def _finish_training(self, batch: TableBatch, result) -> None:
        """Fill and count the rows :meth:`_claim_training` claimed (``result``)."""
        raise NotImplementedError

    def _undo_claim(self, batch: TableBatch, result) -> None:
        """Take back :meth:`_claim_training`'s ``result``, whose rows were not filled."""
        raise NotImplementedError

    def claim_batch(self, keys: torch.Tensor, training: bool,
                    occurrences: Optional[torch.Tensor] = None,
                    score: Optional[int] = None) -> TableBatch:
        """The first half of :meth:`prefetch`. Where :meth:`claims_apart`, the batch's rows
        are claimed and pinned but neither filled nor counted: :meth:`finish_batch` does
        that, or :meth:`undo_batch` puts the table back as it was (a module whose other
        table refuses the batch changes no table). Else the whole prefetch runs here."""
        score = check_batch_score(self.name, self.options.score_strategy, training, score)
        self.check_failures()
        # in the bucket order of the device tier, where training claims them
        unique = unique_keys(keys, kernels=self.kernels, num_buckets=self.tier.hash.num_buckets)
        counts = unique.counts
        if occurrences is not None:
            counts = torch.zeros_like(counts).index_add_(0, unique.inverse, occurrences)
        batch = TableBatch(self.name, self.mode, training, unique.keys, unique.inverse,
                           counts, unique.num_unique, score=score, table=self)
        batch.lookups = keys.numel() if occurrences is None else occurrences.sum()
        try:
            if self.claims_apart(training):
                batch.pending = self._claim_training(batch)
            else:
                self._resolve(batch)
        except Exception:  # e.g. a user's backing store raised: the pins taken end
            self.release(batch)
            raise
        return batch

    def finish_batch(self, batch: TableBatch) -> TableBatch:
        """Fill the rows :meth:`claim_batch` claimed and count the batch (its lookups once)."""
        if batch.pending is not None:
            result, batch.pending = batch.pending, None
            try:
                self._finish_training(batch, result)
            except Exception:
                self.release(batch)
                raise
        self.counters.add("lookups", batch.lookups)
        self.counters.add("unique_keys", batch.num_unique.sum())
        batch.lookups = None
        return batch

    def undo_batch(self, batch: TableBatch) -> None:
        """Take back a :meth:`claim_batch` that :meth:`finish_batch` did not follow: keys,
        scores, size, clock and pins as before it (a growth during the claim stays)."""
        if batch.pending is not None:
            result, batch.pending = batch.pending, None
            self._undo_claim(batch, result)
        self.release(batch)

    def check_failures(self) -> None:
        """Raise the ``TableFullError`` of keys that found no slot in earlier batches on the
        sync-free (CUDA) path, if their count has reached the host."""
        self._deferred.check(self.name)

    def _hold(self, batch: TableBatch) -> None:
        batch.pinned = True
        self._held.add(batch)

    def _admit(self, batch: TableBatch, present: torch.Tensor) -> torch.Tensor:
        admitted, batch.fallback = self.admit(batch.keys, batch.counts, present)
        return admitted

    def admit(self, keys: torch.Tensor, counts: torch.Tensor,
              present: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Admission of a training batch's unique ``keys`` [U] (``counts`` occurrences each;
        ``present``: stored already): ``(admitted [U] bool, fallback [U, dim])``. Keys
        allowed a row are those already stored and those reaching the threshold (the
        others are counted as ``admission_rejects``); the rest read their ``fallback`` row,
        the admission initializer's (the table's initializer when it is None)."""
        valid = keys != EMPTY_KEY
        admitted = present | self.admission.admit(keys, counts, valid & ~present)
        self.counters.add("admission_rejects", (valid & ~admitted).sum())
        initializer = self.options.admission.initializer or self.options.initializer
        fallback = initializer.rows(keys, self.dim, seed=self.options.seed,
                                    table_id=self.table_id, kernels=self.kernels)
        return admitted, fallback

    def _claim(self, tier: Tier, keys: torch.Tensor, counts: torch.Tensor,
               score: Optional[int] = None):
        """find_or_insert with pins; growth remaps the rows and every held batch. Backends
        that must not wait for the device record failures for a later call instead.
        ``score``: the CUSTOMIZED score of every key (the batch's)."""
        keys = keys.to(tier.device)  # HOST_ONLY claims the module's keys in host memory
        on_failure = "defer" if tier.kernels.defers_failures else "raise"
        scores = None if score is None else torch.full_like(keys, score)
        try:
            result = tier.hash.find_or_insert(keys, scores, pin=True, assume_unique=True,
                                              counts=counts.to(tier.device), on_failure=on_failure)
        except TableFullError as err:
            if err.remap is not None:
                self._apply_remap(tier, err.remap)
            raise self.full_error(err.failed_keys, tier, err.remap) from None
        if result.remap is not None:
            self._apply_remap(tier, result.remap)
        if on_failure == "defer":
            self._deferred.record(result.failed)
        if self.changes is not None:
            self.changes.claimed(tier, result)
        return result

    def full_error(self, failed_keys: torch.Tensor, tier: Optional[Tier] = None,
                   remap: Optional[torch.Tensor] = None) -> TableFullError:
        """The error of a training claim whose ``failed_keys`` found no slot in ``tier``
        (default: the table's own), after the claim was undone."""
        tier = self.tier if tier is None else tier
        return TableFullError(
            f"table {self.name!r}: {failed_keys.numel()} keys found no slot in "
            f"{self._tier_name(tier)} ({tier.hash.capacity} rows, "
            f"{tier.hash.pinned_count()} pinned by {self._held.describe()}); prefetch fewer "
            f"batches ahead, raise the device budget, or use an evicting score_strategy. "
            f"Nothing was inserted.", failed_keys, remap)

    def _tier_name(self, tier: Tier) -> str:
        return "the cache" if self.mode is StorageMode.CACHE else f"the {self.mode.value} table"

    def _apply_remap(self, tier: Tier, remap: torch.Tensor) -> None:
        tier.flat.remap(remap, tier.hash.capacity)
        if self.changes is not None:
            self.changes.remapped(tier, remap)
        if tier is not self.tier:
            return
        for held in self._held:
            held.table_remapped(self.name, remap)

    def grow(self, new_capacity: int) -> torch.Tensor:
        """Rehash the table into ``new_capacity`` slots, as a claim that passes
        ``grow_at_load_factor`` does: the rows move with their keys, and so do the slots of
        every batch holding pins in the table. Returns the remap (old slot -> new, -1 for
        an empty one)."""
        remap = self.tier.hash.grow(new_capacity)
        self._apply_remap(self.tier, remap)
        return remap

    def _count_claim(self, tier: Tier, batch: TableBatch, result, *, misses: bool = True):
        """Add one claim's hits, inserts and evictions (and misses) to the counters; returns
        the hits."""
        hits, inserts, evictions = tier.kernels.claim_summary(
            result.slots, result.inserted, result.previous_keys)
        counts = dict(hits=hits, inserts=inserts, evictions=evictions)
        if misses:
            counts["misses"] = self._unique_count(batch) - hits
        self.counters.add_many(**counts)
        return hits

    def _unique_count(self, batch: TableBatch):
        """Distinct keys of the batch: an int where keys are exact, else a device count."""
        if self.kernels.defers_failures:  # padded keys: count on the device
            return batch.num_unique.sum()
        return batch.keys.numel()

    def _initialize(self, tier: Tier, result, keys: torch.Tensor) -> None:
        tier.flat.initialize_where(result.slots, keys, result.inserted, self.options.initializer,
                                   seed=self.options.seed, table_id=self.table_id)

    def _eval_rows(self, keys: torch.Tensor) -> torch.Tensor:
        return self.options.eval_initializer.rows(keys, self.dim, seed=self.options.seed,
                                                  table_id=self.table_id, kernels=self.kernels)

    def _with_fallback(self, rows, stored, fallback):
        if fallback is not None:
            return torch.where(stored[:, None], rows, fallback)
        if self.kernels.defers_failures:
            return rows * stored[:, None]  # padding and unplaced keys read zeros
        return rows  # exact unique keys, and failures raise: all are stored

    # -- backward ------------------------------------------------------------------------------
    def apply_gradients(self, batch: TableBatch, grads: Union[torch.Tensor, OccurrenceGrads],
                        *, lr: float, step: int) -> None:
        """Fused optimizer update of the batch's rows with ``grads`` [U, dim] (or the
        gradients of its occurrences, :class:`~dynemb.rows.optimizers.OccurrenceGrads`, summed per
        row by the kernel), then unpin.

        Once per batch: a second call raises (it would apply the update twice). A batch whose
        pins already ended (released before its backward) updates only the rows still stored
        under its keys; rows evicted since are counted in ``dropped_updates``, never written to
        another key's row."""
        if batch.applied:
            raise RuntimeError(
                f"table {self.name!r}: the backward of this lookup already ran and applied its "
                f"update; a second backward through the same forward (retain_graph=True) would "
                f"apply it twice. Sum the losses and call backward once, or run a new forward")
        batch.applied = True
        if not isinstance(grads, OccurrenceGrads):
            grads = OccurrenceGrads.of_rows(grads)
        self._update(batch, grads, lr, step)
        if self.changes is not None:
            self.changes.updated(batch)
        self.release(batch)

    def _live_slots(self, tier: Tier, slots: torch.Tensor, batch: TableBatch) -> torch.Tensor:
        """``slots`` if the batch is still pinned; else only those still holding the batch's
        keys (the others count as dropped updates). No host sync."""
        if batch.pinned:
            return slots
        kept = tier.still_stored(slots, batch.keys)
        self.counters.add("dropped_updates", ((slots >= 0) & ~kept).sum().to(self.device))
        return torch.where(kept, slots, -1)

    def _fused_update(self, weights, slots, grads, keys, lr, step) -> None:
        """The optimizer step of ``weights[slots[i]]``, the row of ``keys[i]`` (float16 /
        bfloat16 rows round with noise drawn from the key, so every storage mode agrees)."""
        fused_update(weights, slots, grads, dim=self.dim, config=self.optimizer, lr=lr,
                     step=step, kernels=self.kernels, keys=keys, seed=self.options.seed,
                     table_id=self.table_id,
                     stochastic_rounding=self.options.stochastic_rounding)

    def release(self, batch: TableBatch) -> None:
        """Drop the batch's pins (once)."""
        if not batch.pinned:
            return
        if batch.slots is not None:
            self.tier.hash.release(batch.slots)
        self._release_more(batch)
        batch.pinned = False
        self._held.drop(batch)

    def _release_more(self, batch: TableBatch) -> None:
        """Pins a mode holds besides the device tier's."""

    def hold_group_batch(self, batch) -> None:
        """A batch of the table's group (:mod:`dynemb.tables.groups`) pins rows of this
        table until :meth:`drop_group_batch`."""
        self._held.add(batch)

    def drop_group_batch(self, batch) -> None:
        self._held.drop(batch)

    def held_batches(self) -> List:
        """The batches holding pins in the table (its own and its group's)."""
        return list(self._held)

    def has_batches_in_flight(self) -> bool:
        """A prefetched or looked-up batch still holds pins (its backward or release has not
        run)."""
        return bool(self._held)

    def flush(self) -> Optional[int]:
        """Write the cached rows back to where the table keeps every row, returning how many
        were written; None for a mode that keeps no such copy (only CACHE does, see
        :meth:`CacheTable.flush <dynemb.tables.cache.CacheTable.flush>`)."""
        return None

    # -- direct reads --------------------------------------------------------------------------
    def read_rows(self, keys: torch.Tensor, *, with_state: bool = False):
        """Current rows of ``keys`` wherever they live (device, host tier or store), without
        touching scores, pins or counters. Returns ``(rows, found [N])``: rows [N, dim] in the
        table dtype, or ``with_state`` the logical rows ``[N, dim + state_dim]`` (float32 for
        float16 / bfloat16 tables: the embedding upcast, then the float32 optimizer state;
        see :meth:`~dynemb.rows.flat_table.RowLayout.to_logical`)."""
        check_keys(keys, self.device, kernels=self.kernels)
        width = self.width if with_state else self.dim
        rows = torch.zeros(keys.numel(), width, dtype=self.layout.dtype, device=self.device)
        found = torch.zeros(keys.numel(), dtype=torch.bool, device=self.device)
        for kind, source in (*self._row_sources(), ("tier", self.tier)):  # device tier last
            if kind == "store":
                stored_rows, hit, _ = source.find(keys)  # a user store may answer on the host
                stored_rows, hit = stored_rows.to(self.device), hit.to(self.device)
                rows[hit] = stored_rows[hit][:, :width]
            else:
                slots = source.hash.find(keys.to(source.device)).to(self.device)
                hit = slots >= 0
                rows[hit] = source.flat.weights[slots[hit].to(source.device)][:, :width].to(
                    self.device)
            found |= hit
        return (self.row_layout.to_logical(rows) if with_state else rows), found

    # -- observability -------------------------------------------------------------------------
    def stats(self) -> Dict[str, object]:
        """Counters plus current sizes (reads the device once)."""
        out: Dict[str, object] = dict(self.counters.snapshot())
        rows_device = self.tier.hash.size()
        out["storage_mode"] = self.mode.value
        out["rows_device"] = rows_device
        out["device_capacity"] = self.tier.hash.capacity
        out["load_factor"] = rows_device / self.tier.hash.capacity
        out["rows_backing"] = self._rows_backing()
        out["admission_pending"] = 0 if self.admission is None else self.admission.size()
        return out

    def memory_breakdown(self) -> MemoryBreakdown:
        """The bytes this table holds right now, by category (what the planner's estimate is
        checked against). Rows split into values and optimizer state by the row layout."""
        out = self._host_memory()
        values, state = tier_row_bytes(self.tier, self.row_layout)
        out.values_bytes += values
        out.optimizer_bytes += state
        out.hash_bytes += self.tier.hash.nbytes()
        if self.admission is not None:
            out.admission_bytes += self.admission.table.nbytes()
        out.other_bytes += self.counters.nbytes() + storage_bytes([self._deferred.total])
        out.host_other_bytes += storage_bytes([self._deferred.host])
        out.in_flight_bytes += storage_bytes(
            t for b in self._held for t in b.table_tensors(self.name))
        return out

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}, dim={self.dim}, "
                f"device_capacity={self.tier.hash.capacity}, optimizer={self.optimizer.type.name})")


def tier_row_bytes(tier: Tier, row: RowLayout) -> Tuple[int, int]:
    """(value bytes, optimizer-state bytes) of a tier's flat table."""
    nbytes = storage_bytes([tier.flat.weights], spans_only=True)
    values = nbytes * row.embedding_bytes // row.row_bytes
    return values, nbytes - values
