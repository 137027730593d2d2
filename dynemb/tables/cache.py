"""CACHE: the device tier caches the hot rows of a backing store that holds every row.

Where rows move (all in its group's prefetch, so forward and backward are those of
HBM_DIRECT):

- **write-back**: a key inserted into a full bucket evicts the lowest-score unpinned slot;
  the evicted row (embedding + optimizer state) and its score go to the store
  (:meth:`CacheTable._write_back`);
- **load**: a key inserted into the cache takes its row and score from the store when the
  store has it, else the initializer's row (:meth:`CacheTable._load`);
- eval reads a key missing from the cache from the store, without loading it;
- **flush** (:meth:`CacheTable.flush`, on demand): every cached row is written to the store,
  and stays cached.
The store is inclusive: it may keep a stale copy of a cached row; the cached row wins, and is
written back when evicted.
"""
from __future__ import annotations

import torch

from dynemb.stores.backing_store import (BackingStore, HostBackingStore, default_store,
                                  default_store_slots)
from dynemb.options import DynamicEmbTableOptions, StorageMode, TableLayout
from dynemb.tables.checkpoint_tiers import TierParts
from dynemb.tables.hbm_direct import HbmDirectTable
from dynemb.tables.memory import MemoryBreakdown, PlannedRows
from dynemb.types import EMPTY_KEY, TableFullError


#: Rows :meth:`CacheTable.flush` gathers and writes at a time.
FLUSH_CHUNK_ROWS = 1 << 16


class CacheTable(HbmDirectTable):
    """See the module docstring. ``store`` is the table's :class:`BackingStore`."""

    mode = StorageMode.CACHE
    _grows = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        factory = self.options.backing_store or default_store(self.layout.target_rows)
        if hasattr(factory, "for_table"):  # a factory that records what its rows belong to
            factory = factory.for_table(name=self.name, dim=self.dim,
                                        optimizer=self.optimizer.type.name,
                                        width=self.width)
        self.store = factory(self.width, self.layout.dtype, self.device)
        if not isinstance(self.store, BackingStore) or self.store.width != self.width:
            raise TypeError(f"table {self.name!r}: backing_store must build a BackingStore of "
                            f"width {self.width}, got {self.store!r}")

    @classmethod
    def planned_rows(cls, layout: TableLayout, options: DynamicEmbTableOptions) -> PlannedRows:
        """The cache's rows, and the backing store at its largest: the default store's
        :func:`~dynemb.stores.backing_store.default_store_slots` (a row and a hash slot each), or
        the rows a user's store must hold (its own structures unknown): the rows the table is
        sized for, ``layout.target_rows`` (``num_embeddings``, or ``max_capacity`` when set).

        Example::

            >>> from dynemb.options import choose_storage_mode
            >>> options = DynamicEmbTableOptions(caching=True, global_hbm_for_values=512 * 32)
            >>> layout = choose_storage_mode(options, name="t", num_embeddings=5000, width=8,
            ...                              config_dtype=torch.float32)
            >>> CacheTable.planned_rows(layout, options)  # 512 cached, 2 x 5000 in the store
            PlannedRows(device_rows=512, host_rows=9984, host_hash_slots=9984, host_exact=True)
        """
        if options.backing_store is not None:
            return PlannedRows(layout.device_capacity, host_rows=layout.target_rows,
                               host_exact=False)
        slots = default_store_slots(layout.target_rows)
        return PlannedRows(layout.device_capacity, host_rows=slots, host_hash_slots=slots)

    def admit(self, keys: torch.Tensor, counts: torch.Tensor, present: torch.Tensor):
        """As every table admits (:meth:`DynamicTable.admit
        <dynemb.tables.base.DynamicTable.admit>`; ``present``: cached already), with the
        keys the store holds counted as stored: a key the cache evicted keeps its row. The
        same whether the table claims alone or in its group."""
        return super().admit(keys, counts, present | self._store_find(keys)[1])

    def _store_find(self, keys: torch.Tensor):
        """The store's ``find``, answered on the table's device: a user store may keep its
        rows, and answer, on the host. Padding (``EMPTY_KEY``, the CUDA kernels pad a
        batch's unique keys) is not asked for, and not found."""
        real = keys != EMPTY_KEY
        if bool(real.all()):  # (the store's find reads back anyway)
            rows, found, scores = self.store.find(keys)
            return rows.to(self.device), found.to(self.device), scores.to(self.device)
        some_rows, some_found, some_scores = self.store.find(keys[real])
        rows = torch.zeros(keys.numel(), self.width, dtype=some_rows.dtype, device=self.device)
        found = torch.zeros(keys.numel(), dtype=torch.bool, device=self.device)
        scores = torch.zeros(keys.numel(), dtype=some_scores.dtype, device=self.device)
        real = real.to(self.device)
        rows[real], found[real] = some_rows.to(self.device), some_found.to(self.device)
        scores[real] = some_scores.to(self.device)
        return rows, found, scores

    def fill_claimed_rows(self, keys: torch.Tensor, result) -> None:
        """After its group's claim of ``keys`` (``result``, a
        :class:`~dynemb.types.FindOrInsertResult` in the table's own slots), where the group
        cannot move the rows itself (:mod:`dynemb.tables.group_stores`): write the evicted
        rows back, then load the new keys' rows. A store other than the host store (a disk,
        a user's) is read first: if that read fails, nothing was written to the store or
        counted, and the claim is undone as for a failed write."""
        if isinstance(self.store, HostBackingStore):
            self._write_back(result)
            self._load(keys, result)
            return
        stored = self._read_new_rows(keys, result)
        self._write_back(result)
        self._load(keys, result, stored)

    def _write_back(self, result) -> None:
        """Evicted rows go to the store with their scores."""
        evicted = result.evicted
        if not bool(evicted.any()):
            return
        slots = result.slots[evicted]
        keys = result.previous_keys[evicted]
        scores = result.previous_scores[evicted]
        dropped = self.store.insert(keys, self.tier.flat.weights.index_select(0, slots), scores)
        if self.changes is not None:
            self.changes.written_back(keys)
        self.counters.add("write_backs", slots.numel())
        self.counters.add("store_evictions", dropped)

    def flush(self, chunk_rows: int = FLUSH_CHUNK_ROWS) -> int:
        """Write every cached row (embedding, optimizer state, score) to the store, so that
        the store holds the latest copy of every row, then call the store's own ``flush``
        if it has one (a disk store: every row durable on disk); returns how many rows were
        written.

        The rows stay cached (nothing is evicted, no pin or score changes). Rows go in slot
        order, ``chunk_rows`` at a time (the live slots of each chunk found by the table's
        export kernel). Rows of a lookup awaiting its backward are written as
        they are now: the backward then updates the cached row, which wins over the stored
        copy as always; flush again after it for a store that holds that update too. Rows
        the store evicts to take these count in ``store_evictions``.

        Example::

            >>> from dynemb.options import choose_storage_mode
            >>> from dynemb.rows.optimizers import OptimizerConfig
            >>> options = DynamicEmbTableOptions(caching=True, global_hbm_for_values=256 * 16)
            >>> layout = choose_storage_mode(options, name="t", num_embeddings=1024, width=4,
            ...                              config_dtype=torch.float32)
            >>> table = CacheTable("t", 0, 4, layout, options, OptimizerConfig(),
            ...                    torch.device("cpu"))
            >>> from dynemb.tables.grouping import group_of_one
            >>> keys = torch.tensor([3, 5, 8])
            >>> group_of_one(table).prefetch([keys], [None], [None]).release()  # 3 rows cached
            >>> table.store.size(), table.flush(), table.store.size()
            (0, 3, 3)
            >>> rows, found, _ = table.store.find(keys)
            >>> bool(found.all()) and torch.equal(rows, table.read_rows(keys, with_state=True)[0])
            True
        """
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
        hash_table, written, dropped, start = self.tier.hash, 0, 0, 0
        while start < hash_table.capacity:
            chunk = hash_table.export(start, chunk_rows)
            start = chunk.next_start
            if chunk.keys.numel() == 0:
                continue
            dropped += self.store.insert(
                chunk.keys, self.tier.flat.weights.index_select(0, chunk.slots), chunk.scores)
            if self.changes is not None:
                self.changes.written_back(chunk.keys)
            written += chunk.keys.numel()
        self.counters.add("store_evictions", dropped)
        flush_store = getattr(self.store, "flush", None)
        if callable(flush_store):  # a store with levels of its own writes them through
            flush_store()
        return written

    def _read_new_rows(self, keys: torch.Tensor, result):
        """The store's ``find`` of the keys ``result`` inserted (None when it inserted
        none)."""
        inserted = result.inserted
        return self._store_find(keys[inserted]) if bool(inserted.any()) else None

    def _load(self, keys: torch.Tensor, result, stored=None) -> None:
        """New slots take the store's row and score, or the initializer's row. ``stored``:
        the store's answer for the new keys, when it was read already."""
        inserted = result.inserted
        if not bool(inserted.any()):
            return
        new_keys, new_slots = keys[inserted], result.slots[inserted]
        rows, found, scores = stored if stored is not None else self._store_find(new_keys)
        if bool(found.any()):
            self.tier.flat.weights.index_copy_(0, new_slots[found], rows[found])
        if bool(found.any()):
            self.tier.hash.restore_scores(new_slots[found], scores[found])
            self.counters.add("loads", found.sum())
        self.tier.flat.initialize_where(new_slots, new_keys, ~found, self.options.initializer,
                                        seed=self.options.seed, table_id=self.table_id)

    def _row_sources(self):
        return (("store", self.store),)

    def _rows_backing(self) -> int:
        return self.store.size()

    def _host_memory(self) -> MemoryBreakdown:
        """The store's host bytes: its rows and hash table (``nbytes``) and what else it
        holds (``memory_bytes``: a disk store's RocksDB); a user store that cannot tell
        counts 0."""
        nbytes = getattr(self.store, "nbytes", None)
        other = getattr(self.store, "memory_bytes", None)
        rows, hash_bytes = (0, 0) if nbytes is None else nbytes()
        values = rows * self.row_layout.embedding_bytes // self.row_layout.row_bytes
        return MemoryBreakdown(host_values_bytes=values, host_optimizer_bytes=rows - values,
                               host_hash_bytes=hash_bytes,
                               host_other_bytes=0 if other is None else other())

    # -- checkpoint ----------------------------------------------------------------------------
    def _host_checkpoint_tier(self) -> TierParts:
        """The backing store: slot for slot (a :class:`HostBackingStore`'s hash and rows) or,
        a user store, through its ``export``."""
        if isinstance(self.store, HostBackingStore):
            return TierParts(self.store.hash_table, self.store.row_table, self.store)
        return TierParts(None, None, self.store)

    def _insert_saved_rows(self, keys: torch.Tensor, scores: torch.Tensor,
                           rows: torch.Tensor) -> None:
        """Every saved row, cached or stored, goes to the backing store (the cache refills
        from it); a store that evicts rows to take them raises :class:`TableFullError`."""
        dropped = self.store.insert(keys.to(self.device), rows.to(self.device),
                                    scores.to(self.device))
        if dropped:
            raise TableFullError(f"table {self.name!r}: the backing store evicted {dropped} "
                                 f"rows while loading the checkpoint: it cannot hold them all",
                                 keys[:0], None)

    def current_entries(self, tier: str, keys: torch.Tensor, scores: torch.Tensor,
                        rows: torch.Tensor):
        """The store (``host``) may keep a stale copy of a cached row: its entries whose key
        is cached are dropped, the cached row is the current one."""
        if tier != "host" or keys.numel() == 0:
            return keys, scores, rows
        cached = self.tier.hash.find(keys.to(self.device)).to(keys.device) >= 0
        return keys[~cached], scores[~cached], rows[~cached]
