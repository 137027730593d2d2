"""A :class:`~dynemb.stores.backing_store.BackingStore` on local disk, in RocksDB (``rocksdict``,
the optional extra ``pip install dynemb[disk]``, imported on first use).

Each row is one RocksDB entry: the key, encoded so that byte order is key order (a chunked
export is a range scan), and the value, the row's raw bytes in the table's dtype followed by
its score (little-endian int64). Reads are multi-gets, writes one write batch per call (atomic:
a call that fails changes nothing). The store's own facts (format, width, dtype, the table
it belongs to, the number of keys) live in the same database, under keys that sort before
every row, and change in the same write batches as the rows.

A store is a cache's backing copy, not a checkpoint: :func:`dynemb.checkpoint.dump` is what
keeps a table (it streams a disk-backed table chunk by chunk). See docs/storage.md for when
the disk pays and how to choose its options.
"""
from __future__ import annotations

import json
import os
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from dynemb.stores.backing_store import check_store_rows
from dynemb.foundations.validation import canonical_device, check_index_tensor

#: Version of the on-disk layout (keys, values, facts).
FORMAT = 1
_ROW, _META = b"\x01", b"\x00"
_FACTS_KEY, _SIZE_KEY = _META + b"facts", _META + b"size"
_SIGN = np.uint64(1 << 63)


def _rocksdict():
    try:
        import rocksdict
    except ImportError as error:  # the optional extra
        raise ImportError("disk stores need rocksdict: pip install 'dynemb[disk]'") from error
    return rocksdict


@dataclass(frozen=True)
class DiskOptions:
    """RocksDB settings of a :class:`DiskBackingStore` (docs/storage.md says how to pick them).

    - ``block_cache_bytes``: RocksDB's cache of recently read blocks (on top of the OS page
      cache); 0 turns it off.
    - ``compression``: ``"none"`` (the default: float rows barely compress), ``"lz4"`` or
      ``"zstd"``.
    - ``wal``: write-ahead log. Off by default: the store is a cache's backing copy, and a
      checkpoint, not the store, is what survives a crash; with it off a crash loses the
      writes since RocksDB's last flush (a table's ``flush`` makes one), and the store still
      opens (consistent: the row count is written in the same batches as the rows). With it
      on, a store also recovers from a failed write by itself
      (:meth:`DiskBackingStore.write`).
    - ``write_buffer_bytes``: memtable size before a flush to disk.

    Example::

        >>> DiskOptions(compression="lz4").compression
        'lz4'
    """

    block_cache_bytes: int = 64 << 20
    compression: str = "none"
    wal: bool = False
    write_buffer_bytes: int = 64 << 20

    def __post_init__(self):
        for name in ("block_cache_bytes", "write_buffer_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.compression not in ("none", "lz4", "zstd"):
            raise ValueError(f"compression must be 'none', 'lz4' or 'zstd', got "
                             f"{self.compression!r}")
        if not isinstance(self.wal, bool):
            raise TypeError(f"wal must be a bool, got {self.wal!r}")

    def memory_bytes(self) -> int:
        """Host memory these settings let RocksDB hold at most, as planned: two memtables and
        the block cache (indexes and filters come on top, a few bytes per row)."""
        return 2 * max(1 << 20, self.write_buffer_bytes) + self.block_cache_bytes

    def rocksdb(self):
        """``(rocksdict.Options, rocksdict.WriteOptions)`` of these settings."""
        rd = _rocksdict()
        options = rd.Options(raw_mode=True)
        options.create_if_missing(True)
        options.set_write_buffer_size(max(1 << 20, self.write_buffer_bytes))
        table = rd.BlockBasedOptions()
        if self.block_cache_bytes:
            table.set_block_cache(rd.Cache(self.block_cache_bytes))
        else:
            table.disable_cache()
        table.set_bloom_filter(10, False)  # a miss reads no block
        options.set_block_based_table_factory(table)
        kind = {"none": rd.DBCompressionType.none(), "lz4": rd.DBCompressionType.lz4(),
                "zstd": rd.DBCompressionType.zstd()}[self.compression]
        options.set_compression_type(kind)
        write = rd.WriteOptions()
        write.disable_wal = not self.wal
        return options, write


class StoreMismatchError(ValueError):
    """The directory holds a store written for another table (width, dtype or table facts
    differ); nothing was changed."""


class DiskBackingStore:
    """Rows of ``width`` values of ``dtype``, keyed by int64, in a RocksDB database at ``path``
    (``~`` expanded, a relative path taken against the working directory when the store is
    built; created if missing; an existing store opens again if it was written with the same
    width, dtype and ``table`` facts, else :class:`StoreMismatchError`). Rows come back on
    ``device``. Never forgets a key: ``insert`` returns 0.

    ``table``: what identifies the table the rows belong to (e.g. its name, dim and
    optimizer), checked when the store opens again.

    Example::

        >>> import tempfile
        >>> path = tempfile.mkdtemp()
        >>> store = DiskBackingStore(path, width=4, dtype=torch.float32,
        ...                          device=torch.device("cpu"), table={"dim": 4})
        >>> store.insert(torch.tensor([7, -9]), torch.ones(2, 4), scores=torch.tensor([3, 5]))
        0
        >>> rows, found, scores = store.find(torch.tensor([-9, 8]))
        >>> found.tolist(), scores[0].item(), store.size()
        ([True, False], 5, 2)
        >>> store.close()
        >>> DiskBackingStore(path, 4, torch.float32, torch.device("cpu"), table={"dim": 4}).size()
        2
    """

    #: Its rows are on disk: a state_dict, which holds a whole table in memory, refuses it.
    on_disk = True

    def __init__(self, path, width: int, dtype: torch.dtype, device: torch.device, *,
                 table: Optional[Dict] = None, options: Optional[DiskOptions] = None,
                 remove_on_close: bool = False):
        self.width = int(width)
        self.dtype = dtype
        self.device = canonical_device(device)
        self.path = absolute_path(path)
        self.options = options or DiskOptions()
        self._row_bytes = self.width * torch.empty(0, dtype=dtype).element_size()
        self._facts = {"format": FORMAT, "width": self.width, "dtype": str(dtype).split(".")[-1],
                       "table": table or {}}
        check_writable(self.path)
        self._rd_options, self._write_options = self.options.rocksdb()
        self._remove_on_close = remove_on_close
        self._failure: Optional[str] = None  # a failed write or flush, until reopened
        self._open()

    def _open(self) -> None:
        """Open the database and check or write its facts; on any error nothing is open."""
        rd = _rocksdict()
        try:
            self._db = rd.Rdict(str(self.path), self._rd_options)
        except Exception as error:  # rocksdict raises plain Exceptions
            self._db = _Unopened()
            raise OSError(f"cannot open the disk store at {str(self.path)!r}: {error}") from error
        try:
            self._size = self._open_facts()
        except BaseException as error:
            self._db.close()
            self._db = _Unopened()
            if isinstance(error, Exception) and not isinstance(error, (OSError, ValueError)):
                raise self._error("opening", error) from error  # rocksdict's plain ones
            raise
        # closed (and, for a store of its own directory, removed) when the store is freed
        self._closer = weakref.finalize(self, _close, self._db, self.path if
                                        self._remove_on_close else None)

    def _recover(self) -> None:
        """RocksDB refuses every write after one failed (its error is sticky). With the
        write-ahead log on, closing and opening the database again clears it and replays the
        log: nothing a write returned from is lost. With it off, the rows written since
        RocksDB's last flush are only in its memory, so the store stays open (it still
        reads) and refuses writes with an error that says how to keep its rows."""
        if self._failure is None:
            return
        if not self.options.wal:
            raise OSError(
                f"the disk store at {str(self.path)!r} refuses writes since one failed "
                f"({self._failure}): with the write-ahead log off its rows since RocksDB's "
                f"last flush are only in memory, and reopening it would lose them. It still "
                f"reads: save the module with dynemb.checkpoint.dump and load it into a new "
                f"one (DiskOptions(wal=True) stores recover by themselves)")
        self._closer.detach()
        try:
            self._db.close()
        except Exception:  # a database in error may fail to close cleanly: it reopens
            pass
        try:
            self._open()
        except BaseException:
            # still closed: the next call tries again; the directory goes when freed
            self._closer = weakref.finalize(self, _close, self._db, self.path if
                                            self._remove_on_close else None)
            raise
        self._failure = None

    def _open_facts(self) -> int:
        saved = self._db.get(_FACTS_KEY)
        if saved is None:
            if next(iter(self._db.keys()), None) is not None:
                raise StoreMismatchError(f"{str(self.path)!r} holds a RocksDB database that "
                                         f"is not a dynemb store; nothing was changed")
            self._write(facts=True)
            return 0
        facts = json.loads(saved.decode())
        diffs = [f"{k}: stored {facts.get(k)!r}, this table {v!r}"
                 for k, v in self._facts.items() if facts.get(k) != v]
        if diffs:
            raise StoreMismatchError(f"the disk store at {str(self.path)!r} was written for "
                                     f"another table ({'; '.join(diffs)}); nothing was "
                                     f"changed: give this table its own directory")
        return int.from_bytes(self._db.get(_SIZE_KEY), "little", signed=True)

    # -- the BackingStore protocol -------------------------------------------------------------
    def find(self, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows, found flags and scores of ``keys`` (zeros for keys not stored)."""
        check_index_tensor(keys, "keys", keys.device)
        values = self._get(keys)
        found = np.fromiter((v is not None for v in values), dtype=np.bool_, count=len(values))
        rows = torch.zeros(len(values), self.width, dtype=self.dtype)
        scores = torch.zeros(len(values), dtype=torch.int64)
        if found.any():
            stored_rows, stored_scores = self._decode([v for v in values if v is not None])
            at = torch.from_numpy(np.flatnonzero(found))
            rows[at] = stored_rows
            scores[at] = stored_scores
        return (rows.to(self.device), torch.from_numpy(found).to(self.device),
                scores.to(self.device))

    def insert(self, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor) -> int:
        """Insert or overwrite rows with their scores, in one atomic write; returns 0."""
        self.write(keys, rows, scores)
        return 0

    def export(self, start: int, batch: int):
        """``(keys, rows, scores, next_start)`` of at most ``batch`` stored keys in key order
        from cursor ``start`` (0: the first); ``next_start`` is None after the last."""
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be a positive int, got {batch!r}")
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < 1 << 64:
            raise ValueError(f"start must be a cursor in [0, 2**64), got {start!r}")
        encoded, values = [], []
        if isinstance(self._db, _Unopened):  # a reopening failed: it is tried again
            self._recover()
        try:
            for key, value in self._db.items(from_key=_ROW + start.to_bytes(8, "big")):
                if len(encoded) == batch:
                    break
                encoded.append(key[1:])
                values.append(value)
        except Exception as error:  # rocksdict raises plain Exceptions
            raise self._error("reading", error) from error
        keys = _decode_keys(encoded)
        rows, scores = self._decode(values)
        done = len(encoded) < batch or int(keys[-1]) == torch.iinfo(torch.int64).max
        nxt = None if done else int.from_bytes(encoded[-1], "big") + 1
        return keys.to(self.device), rows.to(self.device), scores.to(self.device), nxt

    def size(self) -> int:
        """Keys stored (kept in the database with the rows: no scan)."""
        return self._size

    def erase(self, keys: torch.Tensor) -> int:
        """Delete ``keys`` in one atomic write; returns how many were stored."""
        check_index_tensor(keys, "keys", keys.device)
        keys = keys.cpu()
        gone = int(self.contains(keys).sum())
        self._write(erase=keys, size=self._size - gone)
        return gone

    # -- beyond the protocol -----------------------------------------------------------------
    def contains(self, keys: torch.Tensor) -> torch.Tensor:
        """[N] bool on the CPU: which of ``keys`` are stored (one multi-get, no row decoded)."""
        check_index_tensor(keys, "keys", keys.device)
        values = self._get(keys)
        return torch.from_numpy(np.fromiter((v is not None for v in values), dtype=np.bool_,
                                            count=len(values)))

    def write(self, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor,
              erase: Optional[torch.Tensor] = None,
              stored: Optional[torch.Tensor] = None) -> None:
        """Put ``keys`` (rows, scores) and delete ``erase`` in one atomic write batch; a
        failed write (a full disk, say) raises ``OSError`` and changes nothing. ``stored``
        [N] bool: which of ``keys`` the caller knows are stored already (:meth:`contains`),
        so that they are not looked up again to keep the count.

        RocksDB refuses every write after a failed one: with the write-ahead log on, the
        next write opens the database again first, which clears that (and raises ``OSError``
        while it cannot open); with it off, every later write raises (the store still reads:
        see docs/storage.md)."""
        check_store_rows(keys, rows, scores, self.width)
        self._recover()
        erase = keys[:0] if erase is None else erase
        check_index_tensor(erase, "erase", erase.device)
        if stored is None:
            stored = self.contains(keys.cpu())
        if stored.shape != keys.shape or stored.dtype != torch.bool:
            raise ValueError(f"stored must be [{keys.numel()}] bool, got {stored.dtype} "
                             f"{tuple(stored.shape)}")
        gone = int(self.contains(erase.cpu()).sum())
        new = keys.numel() - int(stored.sum())
        self._write(keys, rows, scores, erase, size=self._size + new - gone)

    def flush(self) -> None:
        """Write what RocksDB holds in memory (its memtable) to the store's files: what was
        written survives a crash of the process even with the write-ahead log off."""
        self._recover()
        try:
            self._db.flush()
        except Exception as error:  # rocksdict raises plain Exceptions
            self._failure = f"flushing: {error}"
            raise self._error("flushing", error) from error

    def close(self) -> None:
        """Close the database (and remove its directory if the store was built with
        ``remove_on_close``); the store is unusable after."""
        self._closer()

    def memory_bytes(self) -> int:
        """Host memory RocksDB holds for the store now: its memtables, the block cache's
        use and the table readers (indexes and filters); 0 while it is not open (after a
        failure, see :meth:`write`)."""
        if isinstance(self._db, _Unopened):
            return 0
        return sum(self._db.property_int_value(f"rocksdb.{name}") or 0 for name in (
            "cur-size-all-mem-tables", "block-cache-usage", "estimate-table-readers-mem"))

    def nbytes_on_disk(self) -> int:
        """Bytes of the store's files now (RocksDB's live data files)."""
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())

    def __getstate__(self):
        raise TypeError(f"a disk store ({str(self.path)!r}) cannot be pickled: save its table "
                        f"with dynemb.checkpoint.dump, which streams it")

    def __repr__(self) -> str:
        return (f"DiskBackingStore({str(self.path)!r}, width={self.width}, "
                f"dtype={self._facts['dtype']}, size={self._size})")

    # -- encoding ----------------------------------------------------------------------------
    def _get(self, keys: torch.Tensor) -> List[Optional[bytes]]:
        if not keys.numel():
            return []
        if isinstance(self._db, _Unopened):  # a reopening failed: it is tried again
            self._recover()
        try:
            return self._db.get(_encode_keys(keys))
        except Exception as error:  # rocksdict raises plain Exceptions
            raise self._error("reading", error) from error

    def _error(self, doing: str, error: Exception) -> OSError:
        """What a failed RocksDB call raises: an ``OSError`` naming the store and what it did
        (a write changed nothing: each is one atomic batch)."""
        written = ", nothing was written" if doing == "writing" else ""
        return OSError(f"{doing} the disk store at {str(self.path)!r} failed{written}: "
                       f"{error}")

    def _decode(self, values: List[bytes]) -> Tuple[torch.Tensor, torch.Tensor]:
        n = len(values)
        if n == 0:
            return (torch.empty(0, self.width, dtype=self.dtype),
                    torch.empty(0, dtype=torch.int64))
        raw = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(n, self._row_bytes + 8)
        rows = torch.from_numpy(raw[:, :self._row_bytes].copy()).view(self.dtype)
        scores = torch.from_numpy(raw[:, self._row_bytes:].copy().view("<i8").reshape(n))
        return rows, scores

    def _write(self, keys=None, rows=None, scores=None, erase=None, *, size=None,
               facts=False) -> None:
        self._recover()
        rd = _rocksdict()
        batch = rd.WriteBatch(raw_mode=True)
        if facts:
            batch.put(_FACTS_KEY, json.dumps(self._facts).encode())
            batch.put(_SIZE_KEY, (0).to_bytes(8, "little", signed=True))
        if keys is not None and keys.numel():
            n = keys.numel()
            row_bytes = rows.detach().to("cpu", self.dtype).contiguous().view(torch.uint8)
            raw = np.concatenate([row_bytes.numpy(), scores.cpu().numpy().astype("<i8").view(
                np.uint8).reshape(n, 8)], axis=1)
            blob, width = raw.tobytes(), raw.shape[1]
            for i, key in enumerate(_encode_keys(keys)):
                batch.put(key, blob[i * width:(i + 1) * width])
        if erase is not None and erase.numel():
            for key in _encode_keys(erase):
                batch.delete(key)
        if size is not None:
            batch.put(_SIZE_KEY, int(size).to_bytes(8, "little", signed=True))
        try:
            self._db.write(batch, self._write_options)
        except Exception as error:  # rocksdict raises plain Exceptions
            self._failure = f"writing: {error}"
            raise self._error("writing", error) from error
        if size is not None:
            self._size = int(size)


class _Unopened:
    """The database of a store whose opening failed: every use raises (as rocksdict's
    errors do, a plain ``Exception``)."""

    def __getattr__(self, name):
        raise Exception("the database is not open: opening it again failed")

    def close(self) -> None:
        pass


def _close(db, remove: Optional[Path]) -> None:
    try:
        db.close()
    except Exception:  # a store about to be removed may have lost its files already
        if remove is None:
            raise
    if remove is not None:
        shutil.rmtree(remove, ignore_errors=True)


def _encode_keys(keys: torch.Tensor) -> List[bytes]:
    """Each key as 9 bytes: a row marker, then the key with its sign bit flipped, big-endian
    (so byte order is signed key order)."""
    flipped = keys.detach().cpu().contiguous().numpy().view(np.uint64) ^ _SIGN
    packed = np.empty((flipped.size, 9), dtype=np.uint8)
    packed[:, 0] = _ROW[0]
    packed[:, 1:] = flipped.astype(">u8").view(np.uint8).reshape(-1, 8)
    blob = packed.tobytes()
    return [blob[i:i + 9] for i in range(0, len(blob), 9)]


def _decode_keys(encoded: List[bytes]) -> torch.Tensor:
    flipped = np.frombuffer(b"".join(encoded), dtype=">u8").astype(np.uint64) ^ _SIGN
    return torch.from_numpy(flipped.view(np.int64).copy())


def absolute_path(path) -> Path:
    """``path`` with ``~`` expanded, made absolute against the working directory now: a store
    keeps working, and is removed from the right place, after an ``os.chdir``."""
    return Path(os.path.abspath(os.path.expanduser(os.fspath(path))))


def check_writable(path: Path) -> None:
    """A clear error, before anything is created, for a directory a store cannot use."""
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise NotADirectoryError(f"the disk store's path {str(path)!r} is under "
                                 f"{str(probe)!r}, which is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise PermissionError(f"the disk store's directory {str(path)!r} is not writable "
                              f"({str(probe)!r} does not let this process write)")

