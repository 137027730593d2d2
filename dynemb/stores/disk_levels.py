"""Tables larger than host memory: a CACHE table's backing store on local disk, with an
optional host-memory level in front of it (device -> host -> disk).

- :class:`HostCachedStore`: a :class:`~dynemb.stores.backing_store.HostBackingStore` of a fixed
  byte budget over a :class:`~dynemb.stores.disk_store.DiskBackingStore`. Rows the device cache
  evicts go to host memory; rows the host level evicts to make room (its lowest scores) go to
  disk, in the same call. A row moving up to the host level keeps its disk copy (the host
  level's row wins while it holds the key), so a key that reached disk stays there, and
  ``flush`` writes the host level through: after it the disk alone holds the latest row of
  every key, which survives a crash. ``size`` counts each key once.
- :func:`disk_store`: the one option that puts a table's rows on disk,
  ``DynamicEmbTableOptions(caching=True, backing_store=disk_store("/nvme/emb"))``.

docs/storage.md says when each level pays, and what it costs.
"""
from __future__ import annotations

import hashlib
import tempfile
from typing import Dict, Optional, Tuple

import torch

from dynemb.stores.backing_store import HostBackingStore
from dynemb.stores.disk_store import DiskBackingStore, DiskOptions, absolute_path, check_writable
from dynemb.rows.hash_table_checks import SLOT_BYTES
from dynemb.types import MAX_BUCKET_SIZE

#: Bytes RocksDB spends per entry beyond its key and value (index, bloom filter, block
#: trailers), as a planning estimate.
DISK_ENTRY_OVERHEAD = 32
#: Export cursors from here on are the disk level's (below: the host level's slots).
_DISK_CURSORS = 1 << 64


def host_level_slots(budget_bytes: int, width: int, dtype: torch.dtype) -> int:
    """Slots of a host level of ``budget_bytes``: each a row plus its hash slot, in whole
    buckets.

    Example::

        >>> host_level_slots(1 << 20, width=64, dtype=torch.float32)  # 1 MiB of 276-byte slots
        3712
    """
    slot = width * torch.empty(0, dtype=dtype).element_size() + SLOT_BYTES
    slots = budget_bytes // slot // MAX_BUCKET_SIZE * MAX_BUCKET_SIZE
    if slots < MAX_BUCKET_SIZE:
        raise ValueError(f"a host level of {budget_bytes} bytes holds less than one bucket "
                         f"({MAX_BUCKET_SIZE} rows of {slot} bytes): give it at least "
                         f"{MAX_BUCKET_SIZE * slot} bytes, or 0 for none")
    return slots


class HostCachedStore:
    """A :class:`~dynemb.stores.backing_store.BackingStore` in two levels: ``host`` (a
    :class:`HostBackingStore` with a ``max_capacity``) over ``disk``. See the module
    docstring.

    Example::

        >>> import tempfile
        >>> cpu = torch.device("cpu")
        >>> disk = DiskBackingStore(tempfile.mkdtemp(), 4, torch.float32, cpu)
        >>> store = HostCachedStore(HostBackingStore(4, torch.float32, cpu, initial_capacity=128,
        ...                                          max_capacity=128), disk)
        >>> keys = torch.arange(300)
        >>> store.insert(keys, torch.ones(300, 4), scores=keys)  # nothing is forgotten
        0
        >>> store.size(), disk.size() > 0, bool(store.find(keys)[1].all())
        (300, True, True)
    """

    #: Its rows are on disk: a state_dict, which holds a whole table in memory, refuses it.
    on_disk = True

    def __init__(self, host: HostBackingStore, disk: DiskBackingStore):
        if host.width != disk.width or host.row_table.weights.dtype != disk.dtype:
            raise ValueError(f"the host level ({host.width} x "
                             f"{host.row_table.weights.dtype}) and the disk level "
                             f"({disk.width} x {disk.dtype}) must hold the same rows")
        if host.max_capacity is None:
            raise ValueError("the host level needs a max_capacity (its budget)")
        self.host, self.disk = host, disk
        self.width = host.width
        self.device = host.device
        # keys the host level holds that the disk does not (size() counts each key once)
        self._host_only = host.size() - int(disk.contains(_all_keys(host)).sum())

    def find(self, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, found, scores = self.host.find(keys)
        missing = ~found
        if bool(missing.any()):
            at = missing.nonzero().flatten()
            disk_rows, disk_found, disk_scores = self.disk.find(keys[at])
            rows[at] = disk_rows.to(rows.dtype)
            found[at] = disk_found
            scores[at] = disk_scores
        return rows, found, scores

    def insert(self, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor) -> int:
        """Rows go to the host level; what it evicts for them goes to disk, in one atomic
        disk write (the disk keeps its copies of the keys new to the host level: stale until
        they come down again, or until :meth:`flush`). If that write fails (a full disk), both
        levels are as they were. Returns 0."""
        host_only = []

        def spill(out_keys, out_rows, out_scores, new_keys, evicted):
            on_disk = self.disk.contains(torch.cat([out_keys, new_keys]).cpu())
            out_on_disk, new_on_disk = on_disk[:out_keys.numel()], on_disk[out_keys.numel():]
            self.disk.write(out_keys, out_rows, out_scores, stored=out_on_disk)
            host_only.append(int((~new_on_disk).sum()) - int((~out_on_disk[:evicted]).sum()))
        self.host.insert_spilling(keys, rows, scores, spill)
        self._host_only += host_only[0]
        return 0

    def flush(self, chunk_rows: int = 1 << 16) -> None:
        """Write every row of the host level through to disk (it keeps them too), then flush
        RocksDB's memtable to its files: the disk alone then holds the latest row and score
        of every key, and they survive a crash of the process, write-ahead log or not. If a
        write fails (``OSError``), the chunks before it are on disk and the rest is as it
        was."""
        start = 0
        while start < self.host.capacity:
            chunk = self.host.hash_table.export(start, chunk_rows)
            start = chunk.next_start
            if chunk.keys.numel():
                stored = self.disk.contains(chunk.keys)
                rows = self.host.row_table.weights.index_select(0, chunk.slots)
                self.disk.write(chunk.keys, rows, chunk.scores, stored=stored)
                self._host_only -= int((~stored).sum())
        self.disk.flush()

    def export(self, start: int, batch: int):
        """The host level's rows (cursors below 2**64: its slots), then the disk's rows of the
        keys the host level does not hold (a chunk may then hold fewer than ``batch``)."""
        if start < _DISK_CURSORS:
            chunk = self.host.hash_table.export(start, batch)
            rows = self.host.row_table.weights.index_select(0, chunk.slots)
            nxt = chunk.next_start if chunk.next_start < self.host.capacity else _DISK_CURSORS
            return (chunk.keys.to(self.device), rows.to(self.device),
                    chunk.scores.to(self.device), nxt)
        keys, rows, scores, nxt = self.disk.export(start - _DISK_CURSORS, batch)
        fresh = self.host.hash_table.find(keys.cpu()).to(keys.device) < 0
        return (keys[fresh], rows[fresh], scores[fresh],
                None if nxt is None else _DISK_CURSORS + nxt)

    def size(self) -> int:
        return self.disk.size() + self._host_only

    def erase(self, keys: torch.Tensor) -> int:
        """Forget ``keys`` in both levels (the disk first: if its write fails, neither level
        changed); returns how many were stored in either."""
        keys = keys.cpu()
        in_host = self.host.hash_table.find(keys) >= 0
        on_disk = self.disk.contains(keys)
        self.disk.erase(keys[on_disk])
        self.host.erase(keys[in_host])
        self._host_only -= int((in_host & ~on_disk).sum())
        return int((in_host | on_disk).sum())

    def nbytes(self) -> Tuple[int, int]:
        """The host level's ``(row bytes, hash-table bytes)`` (its memory)."""
        return self.host.nbytes()

    def memory_bytes(self) -> int:
        """Host memory the disk level's RocksDB holds now."""
        return self.disk.memory_bytes()

    def close(self) -> None:
        self.disk.close()

    def __repr__(self) -> str:
        return f"HostCachedStore(host={self.host!r}, disk={self.disk!r})"


#: Bytes of a table's name its store directory's name keeps; a longer name is cut there
#: and followed by a hash of the whole name (a file name holds at most 255 bytes).
NAME_BYTES_IN_DIRECTORY = 100


def directory_prefix(name: str) -> str:
    """The start of the name of a store directory of table ``name``: the name (``/`` made
    ``_``), or for a name longer than :data:`NAME_BYTES_IN_DIRECTORY` bytes its first bytes
    and 16 hex digits of a hash of the whole name, so that names that differ only further
    on get directories of their own names.

    Example::

        >>> directory_prefix("user/clicks")
        'user_clicks'
        >>> prefix = directory_prefix("t" * 300)
        >>> len(prefix), prefix[-17:]
        (117, '~0afa5eb0871c38e7')
    """
    safe = name.replace("/", "_").replace("\0", "_")
    encoded = safe.encode("utf-8", "surrogatepass")
    if len(encoded) <= NAME_BYTES_IN_DIRECTORY:
        return safe
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    kept = encoded[:NAME_BYTES_IN_DIRECTORY].decode("utf-8", "ignore")  # whole characters
    return f"{kept}~{digest}"


def _all_keys(host: HostBackingStore) -> torch.Tensor:
    return host.hash_table.export(0).keys


class disk_store:  # noqa: N801 - used like a function: backing_store=disk_store(...)
    """The ``backing_store`` factory that keeps a CACHE table's rows on disk under
    ``directory``, behind a host level of ``host_cache_bytes`` (0: none). ``~`` in
    ``directory`` is expanded, and a relative directory is taken against the working
    directory when the factory is made (a later ``os.chdir`` changes nothing).

    Each table gets a directory of its own, ``<directory>/<table>-<random>``, made when it is
    built and removed when it is freed: the store is the cache's backing copy, and
    :func:`dynemb.checkpoint.dump` what keeps the table (a process that is killed leaves its
    directory behind; :class:`~dynemb.stores.disk_store.DiskBackingStore` opens it again).
    ``options``: RocksDB's settings (:class:`~dynemb.stores.disk_store.DiskOptions`).

    Example::

        >>> import tempfile
        >>> from dynemb import DynamicEmbTableOptions
        >>> options = DynamicEmbTableOptions(caching=True, backing_store=disk_store(
        ...     tempfile.mkdtemp(), host_cache_bytes=64 << 20))
    """

    def __init__(self, directory, *, host_cache_bytes: int = 0,
                 options: Optional[DiskOptions] = None, table: Optional[Dict] = None):
        if isinstance(host_cache_bytes, bool) or not isinstance(host_cache_bytes, int) or (
                host_cache_bytes < 0):
            raise ValueError(f"host_cache_bytes must be an int >= 0, got {host_cache_bytes!r}")
        self.directory = absolute_path(directory)
        self.host_cache_bytes = host_cache_bytes
        self.options = options or DiskOptions()
        self.table = table or {}

    def for_table(self, **facts) -> "disk_store":
        """This factory for one table, whose ``facts`` (name, dim, optimizer...) its store
        records."""
        return disk_store(self.directory, host_cache_bytes=self.host_cache_bytes,
                          options=self.options, table={**self.table, **facts})

    def planned_levels(self, rows: int, row_bytes: int) -> Tuple[int, int, int, int]:
        """``(host rows, disk rows, disk bytes, RocksDB's host bytes)`` of a table of
        ``rows`` rows of ``row_bytes`` bytes at its largest (what the planner reserves:
        every row on disk, the host level's rows and RocksDB's memtables and block cache in
        host memory). A disk entry is its row, its score and its key, plus
        :data:`DISK_ENTRY_OVERHEAD` of RocksDB's own.

        Example::

            >>> disk_store("/tmp", host_cache_bytes=1 << 20).planned_levels(10_000, 256)
            (3712, 10000, 3050000, 201326592)
        """
        host = 0
        if self.host_cache_bytes:
            slot = row_bytes + SLOT_BYTES
            host = self.host_cache_bytes // slot // MAX_BUCKET_SIZE * MAX_BUCKET_SIZE
        entry = row_bytes + 8 + 9 + DISK_ENTRY_OVERHEAD
        return host, rows, rows * entry, self.options.memory_bytes()

    def __call__(self, width: int, dtype: torch.dtype, device: torch.device):
        if self.host_cache_bytes:  # a budget too small raises before any directory is made
            host_slots = host_level_slots(self.host_cache_bytes, width, dtype)
        check_writable(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        name = directory_prefix(str(self.table.get("name", "table")))
        path = tempfile.mkdtemp(prefix=f"{name}-", dir=self.directory)
        disk = DiskBackingStore(path, width, dtype, device, table=self.table,
                                options=self.options, remove_on_close=True)
        if not self.host_cache_bytes:
            return disk
        host = HostBackingStore(width, dtype, device,
                                initial_capacity=min(host_slots, 1 << 12),
                                max_capacity=host_slots)
        return HostCachedStore(host, disk)

    def __repr__(self) -> str:
        return (f"disk_store({str(self.directory)!r}, host_cache_bytes="
                f"{self.host_cache_bytes})")
