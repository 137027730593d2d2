"""``DynamicTable``: what every storage mode shares (one table on one rank).

A table is what a user and the services see per table: its tiers (hash table and rows), its
options, counters, admission counter, ``read_rows``, ``stats``, ``memory_breakdown``,
checkpoints and growth. It does not run batches: every batch runs through the table's group
(:mod:`dynemb.tables.groups`; a table with no partner is a group of one), whose phases work
on the tables' arrays and ask the table only for what its mode decides (``admit``, a CACHE
table's ``fill_claimed_rows``, ``full_error``, ``grow``).

Subclasses (one per :class:`~dynemb.options.StorageMode`, see :func:`dynemb.tables.build_table`)
say where rows live and move.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from dynemb.rows.admission import AdmissionCounter
from dynemb.backends.numba_backends import backend_for_device
from dynemb.foundations.counters import COUNTER_NAMES, TableCounters
from dynemb.rows.flat_table import RowLayout
from dynemb.rows.initializers import Initializer
from dynemb.rows.optimizers import OptimizerConfig
from dynemb.options import DynamicEmbTableOptions, StorageMode, TableLayout
from dynemb.tables.checkpoint_tiers import CheckpointTiers
from dynemb.tables.expiry import plan_expiry
from dynemb.tables.memory import MemoryBreakdown, PlannedRows, storage_bytes
from dynemb.tables.tier import Tier
from dynemb.types import EMPTY_KEY, TableFullError
from dynemb.foundations.validation import canonical_device, check_keys


class HeldBatches:
    """Batches by identity, in the order they took their pins; adding and dropping one costs
    the same whatever their number.

    Example::

        >>> held = HeldBatches()
        >>> a, b = object(), object()
        >>> held.add(a), held.add(b), held.drop(a)
        (None, None, None)
        >>> list(held) == [b], len(held)
        (True, 1)
    """

    def __init__(self, batches: Iterable[Any] = ()):
        self._by_id = {id(b): b for b in batches}

    def add(self, batch: Any) -> None:
        self._by_id[id(batch)] = batch

    def drop(self, batch: Any) -> None:
        self._by_id.pop(id(batch), None)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._by_id.values())

    def __len__(self) -> int:
        return len(self._by_id)

    def describe(self) -> str:
        """Who holds the pins, for error messages."""
        if not self._by_id:
            return "no other batch: this batch alone has more keys than its buckets hold"
        queued = sum(1 for b in self if not b.consumed)
        return (f"{queued} prefetched batches not yet consumed by forward and "
                f"{len(self) - queued} looked-up batches waiting for their backward (their "
                f"pins end at their backward or at the next training forward)")

    # ids are not kept by pickling: the unpickled batches are keyed again
    def __getstate__(self):
        return list(self)

    def __setstate__(self, batches) -> None:
        self._by_id = {id(b): b for b in batches}


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
        self.admission = (AdmissionCounter(options.admission.threshold,
                                          options.admission.counter_capacity, self.device,
                                          self.kernels)
                          if options.admission is not None else None)
        self.counters = TableCounters(self.device)
        self._held = HeldBatches()
        #: a :class:`~dynemb.checkpoint.changes.ChangeTracker` once checkpoint files track
        #: this table for incremental dumps (told of every claim, growth and update)
        self.changes = None
        #: rows erased by expiry since the table was built (:mod:`dynemb.tables.expiry`)
        self.expired = 0
        #: keys that found no slot (their ``TableFullError`` raised) since the table was built
        self.refused = 0
        #: rows ``write_rows`` gave to keys the table did not hold, and rows it replaced,
        #: since the table was built (:mod:`dynemb.tables.row_writes`)
        self.write_inserts = 0
        self.write_overwrites = 0
        #: the table's clock at its latest ``ttl_steps`` sweep
        self.swept_at = 0

    _grows = False  # the device tier doubles up to max_capacity (HBM_DIRECT only)

    def _build_tier(self) -> Tier:
        """The table's own tier, ``self.tier`` (on the device but for HOST_ONLY)."""
        return Tier(self.layout, self.layout.init_capacity, self.dim, self.state_dim,
                    self.options, self.device, self.kernels, grow=self._grows)

    def empty_copy(self) -> "DynamicTable":
        """A new, empty table of the same configuration (name, layout, options, device)."""
        return type(self)(self.name, self.table_id, self.dim, self.layout, self.options,
                          self.optimizer, self.device, self.backend)

    # -- what a mode provides ------------------------------------------------------------------
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
        :data:`~dynemb.foundations.counters.COUNTER_NAMES`, on the device.

        Example::

            >>> fixed = DynamicTable.fixed_memory()
            >>> fixed.other_bytes, fixed.host_other_bytes
            (88, 0)
        """
        return MemoryBreakdown(other_bytes=len(COUNTER_NAMES) * torch.int64.itemsize)

    # -- what the table's group asks of it ------------------------------------------------------
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

    @property
    def rounds_with_noise(self) -> bool:
        """Whether the table's updates round float16 / bfloat16 rows with noise."""
        return self.tier.flat.weights.dtype != torch.float32 and self.options.stochastic_rounding

    def full_error(self, failed_keys: torch.Tensor, tier: Optional[Tier] = None,
                   remap: Optional[torch.Tensor] = None) -> TableFullError:
        """The error of a training claim whose ``failed_keys`` found no slot in ``tier``
        (default: the table's own), after the claim was undone; the keys count as
        ``stats()["refused"]``."""
        tier = self.tier if tier is None else tier
        self.refused += failed_keys.numel()
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
        ``grow_at_load_factor`` does: the rows move with their keys. A table whose tier lives
        in its part of a group's arrays (every table of a module) grows in its group
        (:meth:`GroupStorage.grow_tables
        <dynemb.tables.group_storage.GroupStorage.grow_tables>`), as in training: every
        batch of the group, queued, awaiting its backward or released, follows its rows.
        Returns the remap (old slot -> new, -1 for an empty one). On an error (a capacity
        that is not a larger multiple of the bucket size, or above ``max_capacity``) the
        table is unchanged.

        Example::

            >>> from dynemb import DynamicEmbCollection, DynamicEmbTableOptions
            >>> from torchrec.modules.embedding_configs import EmbeddingConfig
            >>> ec = DynamicEmbCollection(
            ...     [EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=64,
            ...                      feature_names=["f"])],
            ...     table_options=DynamicEmbTableOptions(init_capacity=64, max_capacity=256,
            ...                                          bucket_size=32))
            >>> remap = ec.tables["t"].grow(128)
            >>> remap.numel(), ec.stats()["t"]["device_capacity"]
            (64, 128)
        """
        record = self._record() if self._record is not None else None
        if record is not None and record.holds(self):
            return record.grow_tables([(record.position(self), new_capacity)])[0]
        return self.rehash(new_capacity)

    def rehash(self, new_capacity: int) -> torch.Tensor:
        """:meth:`grow` in the table's own arrays only: its rows, and the slots of every
        batch holding pins in it, move with their keys (a group growing the table calls it,
        then lays its tables out again). Returns the remap."""
        remap = self.tier.hash.grow(new_capacity)
        self._apply_remap(self.tier, remap)
        return remap

    #: a weak reference to the group record (:class:`~dynemb.tables.group_storage.GroupStorage`)
    #: whose arrays hold the table's tier, set by :meth:`placed_in`
    _record = None

    def placed_in(self, record) -> None:
        """The table's tier now lives in its part of ``record``'s arrays (a
        :class:`~dynemb.tables.group_storage.GroupStorage`, the group of the table's module):
        :meth:`grow` grows it there."""
        self._record = weakref.ref(record)

    def __getstate__(self) -> Dict:
        state = dict(self.__dict__)
        state.pop("_record", None)  # a weak reference: placed again by its group
        return state

    def hold_group_batch(self, batch) -> None:
        """A batch of the table's group (:mod:`dynemb.tables.groups`) pins rows of this
        table until :meth:`drop_group_batch`."""
        self._held.add(batch)

    def drop_group_batch(self, batch) -> None:
        self._held.drop(batch)

    def held_batches(self) -> List:
        """The batches of its group holding pins in the table."""
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
        out["expired"] = self.expired
        out["refused"] = self.refused
        out["write_inserts"] = self.write_inserts
        out["write_overwrites"] = self.write_overwrites
        return out

    def expire(self, *, older_than: Optional[int] = None, where=None) -> int:
        """Erase, from every tier, the rows not looked up in the last ``older_than`` steps,
        or those ``where(keys, scores)`` chooses; pinned rows stay. Returns the rows erased
        (counted in ``stats()["expired"]``). See :mod:`dynemb.tables.expiry`."""
        return plan_expiry(self, older_than=older_than, where=where).apply()

    def expire_if_due(self) -> int:
        """The ``ttl_steps`` sweep, when ``sweep_steps`` steps passed since the last one
        (0 rows, and nothing read, otherwise)."""
        ttl = self.options.ttl_steps
        if ttl is None or self.tier.hash.clock - self.swept_at < self.options.sweep_steps:
            return 0
        self.swept_at = self.tier.hash.clock
        return self.expire(older_than=ttl)

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
        out.other_bytes += self.counters.nbytes()
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
