"""One dynamic table on one rank: resolve keys to slots, serve rows, apply gradients.

:class:`DynamicTable` implements the three storage modes behind one interface:

- ``prefetch(keys, training)`` -> :class:`TableBatch`: dedup; for HBM_DIRECT and CACHE also
  find or insert every key (admission, initializer, eviction, CACHE write-back and load) and
  pin its slot. DEFAULT only dedups here.
- ``lookup(batch)`` -> one row per unique key (DEFAULT does its hash lookups here).
- ``apply_gradients(batch, grads, lr, step)``: the fused optimizer update, then unpin.

Shapes follow the unique keys. On CUDA they are padded to the input length (``EMPTY_KEY``
entries, slot -1), so the HBM_DIRECT path never reads a data-dependent size on the host.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from dynemb.admission import AdmissionCounter
from dynemb.backends import backend_for_device
from dynemb.backing_store import BackingStore, default_store
from dynemb.counters import TableCounters
from dynemb.dedup import unique_keys
from dynemb.flat_table import FlatTable, RowLayout
from dynemb.hash_table import ScoredHashTable
from dynemb.kernels.table_cpu import claim_summary_cpu
from dynemb.optimizers import OptimizerConfig, fused_update
from dynemb.options import DynamicEmbTableOptions, StorageMode, TableLayout
from dynemb.types import EMPTY_KEY, TableFullError
from dynemb.validation import check_keys

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: spreads keys over the tiers


@dataclass
class TableBatch:
    """One table's part of a :class:`~dynemb.prefetch.PrefetchState`.

    ``keys`` / ``counts`` [U] are the unique keys and their occurrences, ``inverse`` [N] maps
    each input key to its unique index. ``slots`` [U] are device-tier slots (-1: no device row:
    padding, a key refused by admission, a key unseen in eval, or the host tier in DEFAULT);
    ``host_slots`` [U] the DEFAULT host-tier slots. ``fallback`` [U, dim] holds the rows used
    for keys without a slot (initializer, eval initializer or CACHE store rows). ``buffer``
    [U, dim + state] holds the rows DEFAULT mode gathered in forward.
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
    buffer: Optional[torch.Tensor] = None
    pinned: bool = False
    consumed: bool = False  # a forward looked it up (else: queued by prefetch)
    applied: bool = False   # its backward ran

    @property
    def num_keys(self) -> int:
        return self.inverse.numel()

    def tensors(self) -> List[torch.Tensor]:
        """Every tensor the batch holds (to mark them used by another CUDA stream)."""
        return [t for t in (self.keys, self.inverse, self.counts, self.num_unique, self.slots,
                            self.host_slots, self.fallback, self.buffer) if t is not None]


class _Tier:
    """A hash table and the flat table of its rows."""

    def __init__(self, layout: TableLayout, capacity: int, width_state: int, dim: int,
                 options: DynamicEmbTableOptions, device: torch.device, backend: Optional[str],
                 grow: bool):
        self.hash = ScoredHashTable(
            capacity, bucket_size=layout.bucket_size, policy=options.score_strategy,
            device=device, backend=backend,
            grow_at_load_factor=options.max_load_factor if grow else None,
            max_capacity=layout.max_capacity if grow else None)
        self.flat = FlatTable(capacity, dim, optimizer_state_dim=width_state, dtype=layout.dtype,
                              device=device, backend=backend)
        self.device = torch.device(device)


class _DeferredFailures:
    """Keys that found no slot on the sync-free path, reported at a later call.

    The count is copied to pinned host memory behind an event; a later ``check`` raises once
    the copy has landed, without ever waiting for the device.
    """

    def __init__(self, device: torch.device):
        self.total = torch.zeros(1, dtype=torch.int64, device=device)
        self._on_gpu = device.type == "cuda"
        self._host = torch.zeros(1, dtype=torch.int64, pin_memory=self._on_gpu)
        self._event = None

    def record(self, failed: torch.Tensor) -> None:
        self.total += failed.sum()
        self._host.copy_(self.total, non_blocking=self._on_gpu)
        if self._on_gpu:
            self._event = torch.cuda.Event()
            self._event.record()

    def check(self, table: str) -> None:
        if self._event is not None and not self._event.query():
            return
        count = int(self._host[0])
        if count:
            self.total.zero_()
            self._host.zero_()
            raise TableFullError(
                f"table {table!r}: {count} keys of earlier batches found no slot (buckets full "
                f"of pinned rows or NO_EVICTION) and were served zeros without being trained",
                torch.empty(0, dtype=torch.int64), None)


class DynamicTable:
    """See the module docstring. Built by :class:`~dynemb.DynamicEmbCollection`."""

    def __init__(self, name: str, table_id: int, dim: int, layout: TableLayout,
                 options: DynamicEmbTableOptions, optimizer: OptimizerConfig,
                 device: torch.device, backend: Optional[str] = None):
        self.name = name
        self.table_id = table_id
        self.dim = dim
        self.layout = layout
        self.options = options
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.backend = backend
        self.state_dim = optimizer.state_dim(dim)
        self.row_layout = RowLayout(dim, self.state_dim, layout.dtype)
        self.width = self.row_layout.width  # physical columns of a row, as stores hold them
        self.mode = layout.mode
        self._cpu_kernels = backend_for_device(self.device, backend).name == "cpu"
        grow = layout.mode is StorageMode.HBM_DIRECT and layout.init_capacity < layout.max_capacity
        self.tier = _Tier(layout, layout.init_capacity, self.state_dim, dim, options, self.device,
                          backend, grow)
        self.host_tier: Optional[_Tier] = None
        self.store: Optional[BackingStore] = None
        if layout.mode is StorageMode.DEFAULT:
            host_rows = max(layout.bucket_size, layout.max_capacity - layout.device_capacity)
            host_rows = -(-host_rows // layout.bucket_size) * layout.bucket_size
            self.host_tier = _Tier(layout, host_rows, self.state_dim, dim, options,
                                   torch.device("cpu"), None, False)
        elif layout.mode is StorageMode.CACHE:
            factory = options.backing_store or default_store(layout.max_capacity)
            self.store = factory(self.width, layout.dtype, self.device)
            if not isinstance(self.store, BackingStore) or self.store.width != self.width:
                raise TypeError(f"table {name!r}: backing_store must build a BackingStore of "
                                f"width {self.width}, got {self.store!r}")
        self.admission = (AdmissionCounter(options.admission, self.device, backend)
                          if options.admission is not None else None)
        self.counters = TableCounters(self.device)
        self._held: List[TableBatch] = []
        self._deferred = _DeferredFailures(self.device)

    # -- prefetch ----------------------------------------------------------------------------
    def prefetch(self, keys: torch.Tensor, training: bool,
                 occurrences: Optional[torch.Tensor] = None) -> TableBatch:
        """Dedup ``keys`` [N] and, except in DEFAULT mode, resolve and pin their slots.

        ``occurrences`` [N] (int64), when given, says how many times each entry of ``keys``
        stands for (ids deduplicated upstream); counts and counters use it."""
        self._deferred.check(self.name)
        unique = unique_keys(keys, self.backend)
        counts = unique.counts
        if occurrences is not None:
            counts = torch.zeros_like(counts).index_add_(0, unique.inverse, occurrences)
        batch = TableBatch(self.name, self.mode, training, unique.keys, unique.inverse,
                           counts, unique.num_unique)
        self.counters.add("lookups", keys.numel() if occurrences is None else occurrences.sum())
        self.counters.add("unique_keys", unique.num_unique.sum())
        if self.mode is not StorageMode.DEFAULT:
            if training:
                self._resolve_training(batch)
            else:
                self._resolve_eval(batch)
        return batch

    def _resolve_training(self, batch: TableBatch) -> None:
        keys = batch.keys
        claim = keys
        if self.admission is not None:
            present = self.tier.hash.find(keys, allow_padding=True) >= 0
            if self.store is not None:
                present |= self.store.find(keys)[1]
            admitted = self._admit(batch, present)
            claim = torch.where(admitted, keys, EMPTY_KEY)
        result = self._claim(self.tier, claim, batch.counts, batch)
        slots, inserted = result.slots, result.inserted
        batch.slots, batch.pinned = slots, True
        self._held.append(batch)
        self._count_claim(batch, result)
        if self.store is None:
            self._initialize(self.tier, result, keys)
        else:
            self._write_back_and_load(keys, slots, inserted, result)

    def _admit(self, batch: TableBatch, present: torch.Tensor) -> torch.Tensor:
        """Keys allowed a row: those already stored and those reaching the threshold. The rest
        get the initializer's row in ``batch.fallback``."""
        valid = batch.keys != EMPTY_KEY
        admitted = present | self.admission.admit(batch.keys, batch.counts, valid & ~present)
        self.counters.add("admission_rejects", (valid & ~admitted).sum())
        batch.fallback = self.options.initializer.rows(
            batch.keys, self.dim, seed=self.options.seed, table_id=self.table_id,
            backend=self.backend)
        return admitted

    def _claim(self, tier: _Tier, keys: torch.Tensor, counts: torch.Tensor,
               batch: TableBatch):
        """find_or_insert with pins; growth remaps the rows and every held batch."""
        on_failure = "raise" if self._cpu_kernels or tier is self.host_tier else "defer"
        try:
            result = tier.hash.find_or_insert(keys, pin=True, assume_unique=True,
                                              counts=counts.to(tier.device), on_failure=on_failure)
        except TableFullError as err:
            if err.remap is not None:
                self._apply_remap(tier, err.remap)
            raise TableFullError(
                f"table {self.name!r}: {err.failed_keys.numel()} keys found no slot in "
                f"{self._tier_name(tier)} ({tier.hash.capacity} rows, "
                f"{tier.hash.pinned_count()} pinned by {self._pin_holders()}); prefetch fewer "
                f"batches ahead, raise the device budget, or use an evicting score_strategy. "
                f"Nothing was inserted.", err.failed_keys, err.remap) from None
        if result.remap is not None:
            self._apply_remap(tier, result.remap)
        if on_failure == "defer":
            self._deferred.record(result.failed)
        return result

    def _tier_name(self, tier: _Tier) -> str:
        if tier is self.host_tier:
            return "the host tier"
        return "the cache" if self.mode is StorageMode.CACHE else f"the {self.mode.value} table"

    def _pin_holders(self) -> str:
        """Who holds the pins, for error messages: queued prefetches, looked-up batches whose
        backward has not run yet, and this very batch."""
        queued = sum(1 for b in self._held if not b.consumed)
        looked_up = len(self._held) - queued
        if not self._held:
            return "no other batch: this batch alone has more keys than its buckets hold"
        return (f"{queued} prefetched batches not yet consumed by forward and {looked_up} "
                f"looked-up batches waiting for their backward (their pins end at their "
                f"backward or at the next training forward)")

    def _apply_remap(self, tier: _Tier, remap: torch.Tensor) -> None:
        tier.flat.remap(remap, tier.hash.capacity)
        for held in self._held:
            if tier is self.tier and held.slots is not None:
                held.slots = torch.where(held.slots >= 0, remap[held.slots.clamp(min=0)], -1)

    def _count_claim(self, batch, result) -> None:
        if self._cpu_kernels:  # one numba pass instead of several torch reductions
            placed, new, evicted = claim_summary_cpu(
                result.slots.numpy(), result.inserted.numpy(), result.previous_keys.numpy())
            hits, evicted = placed - new, int(evicted)
            unique = batch.keys.numel()
            new = int(new)
        else:
            hits = ((result.slots >= 0) & ~result.inserted).sum()
            new, evicted = result.inserted.sum(), result.evicted.sum()
            unique = batch.num_unique.sum()
        self.counters.add_many(hits=hits, misses=unique - hits, inserts=new, evictions=evicted)

    def _write_back_and_load(self, keys, slots, inserted, result) -> None:
        """CACHE: save the evicted rows to the store with their scores, then fill the new slots
        from it, scores included (or from the initializer for keys it has never seen)."""
        evicted = result.evicted
        if bool(evicted.any()):
            ev_slots = slots[evicted]
            rows = self.tier.flat.weights.index_select(0, ev_slots)
            dropped = self.store.insert(result.previous_keys[evicted], rows,
                                        result.previous_scores[evicted])
            self.counters.add("write_backs", ev_slots.numel())
            self.counters.add("store_evictions", dropped)
        if not bool(inserted.any()):
            return
        new_keys, new_slots = keys[inserted], slots[inserted]
        rows, found, scores = self.store.find(new_keys)
        if bool(found.any()):
            loaded = new_slots[found]
            self.tier.flat.weights.index_copy_(0, loaded, rows[found])
            self.tier.hash.restore_scores(loaded, scores[found])
            self.counters.add("loads", found.sum())
        self.tier.flat.initialize_where(new_slots, new_keys, ~found, self.options.initializer,
                                        seed=self.options.seed, table_id=self.table_id)

    def _resolve_eval(self, batch: TableBatch) -> None:
        """Eval: find without inserting or rescoring; unseen keys get the eval initializer
        (CACHE: the store's row when it has one). Found slots are pinned until forward."""
        slots = self.tier.hash.find(batch.keys, allow_padding=True)
        self.tier.hash.retain(slots)
        batch.slots, batch.pinned = slots, True
        self._held.append(batch)
        found = slots >= 0
        self.counters.add("hits", found.sum())
        self.counters.add("misses", batch.num_unique.sum() - found.sum())
        batch.fallback = self._eval_rows(batch.keys)
        if self.store is not None:
            rows, stored, _ = self.store.find(batch.keys)
            batch.fallback = torch.where(stored[:, None], rows[:, :self.dim].float(),
                                         batch.fallback)

    def _eval_rows(self, keys: torch.Tensor) -> torch.Tensor:
        return self.options.eval_initializer.rows(keys, self.dim, seed=self.options.seed,
                                                  table_id=self.table_id, backend=self.backend)

    # -- forward -----------------------------------------------------------------------------
    def lookup(self, batch: TableBatch) -> torch.Tensor:
        """[U, dim] float32 rows of the batch's unique keys (no hash lookup except DEFAULT)."""
        if batch.mode is StorageMode.DEFAULT:
            return self._lookup_tiers(batch)
        # read the embedding columns only, not the optimizer state behind them
        embeddings = self.tier.flat.weights[:, :self.dim]
        rows = embeddings.index_select(0, batch.slots.clamp(min=0)).float()
        return self._with_fallback(rows, batch.slots >= 0, batch.fallback)

    @staticmethod
    def _gather(tier: _Tier, slots: torch.Tensor) -> torch.Tensor:
        return tier.flat.weights.index_select(0, slots.clamp(min=0))

    def _with_fallback(self, rows, stored, fallback):
        if fallback is None:
            if self._cpu_kernels:  # exact unique keys, and failures raise: all are stored
                return rows
            return rows * stored[:, None]  # padding and unplaced keys read zeros
        return torch.where(stored[:, None], rows, fallback)

    def _lookup_tiers(self, batch: TableBatch) -> torch.Tensor:
        """DEFAULT: route each key to its tier by hash, find or insert it there, and gather the
        rows (with optimizer state) into ``batch.buffer``."""
        keys = batch.keys
        valid = keys != EMPTY_KEY
        on_device = valid & self._routes_to_device(keys)
        dev_keys = torch.where(on_device, keys, EMPTY_KEY)
        host_keys = torch.where(valid & ~on_device, keys, EMPTY_KEY).cpu()
        if batch.training:
            self._claim_tiers(batch, dev_keys, host_keys)
        else:
            batch.slots = self.tier.hash.find(dev_keys, allow_padding=True)
            batch.host_slots = self.host_tier.hash.find(host_keys, allow_padding=True)
            self.tier.hash.retain(batch.slots)
            self.host_tier.hash.retain(batch.host_slots)
            batch.pinned = True
            self._held.append(batch)
            stored = (batch.slots >= 0) | (batch.host_slots >= 0).to(self.device)
            self.counters.add("hits", stored.sum())
            self.counters.add("misses", batch.num_unique.sum() - stored.sum())
            batch.fallback = self._eval_rows(keys)
        host_rows = self._gather(self.host_tier, batch.host_slots).to(self.device)
        on_host = (batch.host_slots >= 0).to(self.device)
        batch.buffer = torch.where(on_host[:, None], host_rows,
                                   self._gather(self.tier, batch.slots))
        stored = on_host | (batch.slots >= 0)
        rows = self._with_fallback(batch.buffer[:, :self.dim].float(), stored, batch.fallback)
        if not batch.training:
            self.release(batch)
        return rows

    def _claim_tiers(self, batch: TableBatch, dev_keys, host_keys) -> None:
        if self.admission is not None:
            present = (self.tier.hash.find(dev_keys, allow_padding=True) >= 0) | (
                self.host_tier.hash.find(host_keys, allow_padding=True) >= 0).to(self.device)
            admitted = self._admit(batch, present)
            dev_keys = torch.where(admitted, dev_keys, EMPTY_KEY)
            host_keys = torch.where(admitted.cpu(), host_keys, EMPTY_KEY)
        # The host tier first: a failure there leaves nothing to undo, while a failure on the
        # device (which, on CUDA, records its failures instead of raising) undoes the host
        # claim. Rows are initialized only once both claims stand.
        host = self._claim(self.host_tier, host_keys, batch.counts, batch)
        try:
            dev = self._claim(self.tier, dev_keys, batch.counts, batch)
        except TableFullError:
            self.host_tier.hash.undo(host)
            raise
        self._initialize(self.tier, dev, dev_keys)
        self._initialize(self.host_tier, host, host_keys)
        batch.slots, batch.host_slots, batch.pinned = dev.slots, host.slots, True
        self._held.append(batch)
        for result in (dev, host):
            self._count_claim(batch, result)
        self.counters.add("misses", batch.num_unique.sum() * -1)  # each key counted once above

    def _initialize(self, tier: _Tier, result, keys) -> None:
        tier.flat.initialize_where(result.slots, keys, result.inserted, self.options.initializer,
                                   seed=self.options.seed, table_id=self.table_id)

    def _routes_to_device(self, keys: torch.Tensor) -> torch.Tensor:
        mixed = keys * _GOLDEN
        mixed = (mixed ^ (mixed >> 31)) & 0x7FFFFFFFFFFFFFFF
        total = self.tier.hash.capacity + self.host_tier.hash.capacity
        return mixed % total < self.tier.hash.capacity

    # -- backward ----------------------------------------------------------------------------
    def apply_gradients(self, batch: TableBatch, grads: torch.Tensor, *, lr: float,
                        step: int) -> None:
        """Fused optimizer update of the batch's rows with ``grads`` [U, dim], then unpin.

        Once per batch: a second call raises (it would apply the update twice). A batch whose
        pins already ended (released before its backward) updates only the rows still stored under its
        keys; rows evicted since are counted in ``dropped_updates``, never written to another
        key's row."""
        if batch.applied:
            raise RuntimeError(
                f"table {self.name!r}: the backward of this lookup already ran and applied its "
                f"update; a second backward through the same forward (retain_graph=True) would "
                f"apply it twice. Sum the losses and call backward once, or run a new forward")
        batch.applied = True
        grads = grads.to(torch.float32).contiguous()
        if batch.mode is StorageMode.DEFAULT:
            self._update_tiers(batch, grads, lr, step)
        else:
            slots = batch.slots if batch.pinned else self._still_stored(self.tier, batch.slots,
                                                                         batch.keys)
            self._fused_update(self.tier.flat.weights, slots, grads, batch.keys, lr, step)
        self.release(batch)

    def _still_stored(self, tier: _Tier, slots: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``slots`` where they still hold ``keys``, else -1 (counted as dropped updates).
        No host sync: one gather and a compare."""
        kept = (slots >= 0) & (tier.hash.keys_at(slots) == keys.to(tier.device))
        self.counters.add("dropped_updates", ((slots >= 0) & ~kept).sum().to(self.device))
        return torch.where(kept, slots, -1)

    def _update_tiers(self, batch: TableBatch, grads, lr, step) -> None:
        """DEFAULT: gather the rows as they are now (another lookup's backward may have
        updated them since this forward), update them, write them back to their tiers."""
        dev_slots, host_slots = batch.slots, batch.host_slots
        if not batch.pinned:
            dev_slots = self._still_stored(self.tier, dev_slots, batch.keys)
            host_slots = self._still_stored(self.host_tier, host_slots, batch.keys)
        on_host = (host_slots >= 0).to(self.device)
        stored = on_host | (dev_slots >= 0)
        local = torch.where(stored, torch.arange(stored.numel(), device=self.device), -1)
        buffer = torch.where(on_host[:, None],
                             self._gather(self.host_tier, host_slots).to(self.device),
                             self._gather(self.tier, dev_slots)).contiguous()
        self._fused_update(buffer, local, grads, batch.keys, lr, step)
        on_dev = dev_slots >= 0
        self.tier.flat.weights.index_copy_(0, dev_slots[on_dev], buffer[on_dev])
        host_pick = host_slots >= 0
        self.host_tier.flat.weights.index_copy_(0, host_slots[host_pick],
                                                buffer[on_host].cpu())

    def _fused_update(self, weights, slots, grads, keys, lr, step) -> None:
        """The optimizer step of ``weights[slots[i]]``, the row of ``keys[i]`` (float16 /
        bfloat16 rows round with noise drawn from the key, so every storage mode agrees)."""
        fused_update(weights, slots, grads, dim=self.dim, config=self.optimizer, lr=lr,
                     step=step, backend=self.backend, keys=keys, seed=self.options.seed,
                     table_id=self.table_id,
                     stochastic_rounding=self.options.stochastic_rounding)

    def release(self, batch: TableBatch) -> None:
        """Drop the batch's pins (once)."""
        if not batch.pinned:
            return
        if batch.slots is not None:
            self.tier.hash.release(batch.slots)
        if batch.host_slots is not None:
            self.host_tier.hash.release(batch.host_slots)
        batch.pinned = False
        self._held = [b for b in self._held if b is not batch]

    # -- direct reads ------------------------------------------------------------------------
    def read_rows(self, keys: torch.Tensor, *, with_state: bool = False):
        """Current rows of ``keys`` wherever they live (device, host tier or store), without
        touching scores, pins or counters. Returns ``(rows, found [N])``: rows [N, dim] in the
        table dtype, or ``with_state`` the logical rows ``[N, dim + state_dim]`` (float32 for
        float16 / bfloat16 tables: the embedding upcast, then the float32 optimizer state;
        see :meth:`~dynemb.flat_table.RowLayout.to_logical`)."""
        check_keys(keys, self.device)
        width = self.width if with_state else self.dim
        rows = torch.zeros(keys.numel(), width, dtype=self.layout.dtype, device=self.device)
        found = torch.zeros(keys.numel(), dtype=torch.bool, device=self.device)
        if self.store is not None:
            stored_rows, stored, _ = self.store.find(keys)
            rows[stored] = stored_rows[stored][:, :width]
            found |= stored
        for tier in (self.host_tier, self.tier):  # the device tier is authoritative: last
            if tier is None:
                continue
            slots = tier.hash.find(keys.to(tier.device)).to(self.device)
            hit = slots >= 0
            rows[hit] = tier.flat.weights[slots[hit].to(tier.device)][:, :width].to(self.device)
            found |= hit
        return (self.row_layout.to_logical(rows) if with_state else rows), found

    # -- observability -----------------------------------------------------------------------
    def stats(self) -> Dict[str, object]:
        """Counters plus current sizes (reads the device once)."""
        out: Dict[str, object] = dict(self.counters.snapshot())
        rows_device = self.tier.hash.size()
        out["storage_mode"] = self.mode.value
        out["rows_device"] = rows_device
        out["device_capacity"] = self.tier.hash.capacity
        out["load_factor"] = rows_device / self.tier.hash.capacity
        if self.host_tier is not None:
            out["rows_backing"] = self.host_tier.hash.size()
        elif self.store is not None:
            out["rows_backing"] = self.store.size()
        else:
            out["rows_backing"] = 0
        out["admission_pending"] = 0 if self.admission is None else self.admission.size()
        return out

    def __repr__(self) -> str:
        return (f"DynamicTable({self.name!r}, dim={self.dim}, mode={self.mode.name}, "
                f"device_capacity={self.tier.hash.capacity}, optimizer={self.optimizer.type.name})")
