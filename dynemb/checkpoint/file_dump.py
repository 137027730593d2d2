"""``dump``: write a module's dynamic tables to checkpoint files, whole or as a delta
(the format: :mod:`dynemb.checkpoint.files`)."""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import torch

from dynemb.checkpoint.changes import TierChanges, start_tracking
from dynemb.checkpoint.files import (FORMAT, FORMAT_VERSION, DirectoryWriter, commit,
                                     rank_dir_name, remove_stale, temporary_dir, utc_now)
from dynemb.checkpoint.manifest import read_manifest
from dynemb.checkpoint.module_tables import ModuleTables, module_tables
from dynemb.checkpoint.table_state import signature
from dynemb.tables.checkpoint_tiers import TierParts
from dynemb.types import EMPTY_KEY, TOMBSTONE_KEY
from dynemb.foundations.validation import check_int

#: Entries per data file by default.
CHUNK_ROWS = 1 << 20
#: Characters of a table's key its data files' names keep (after the table's index).
STEM_NAME_CHARS = 120


@dataclasses.dataclass(frozen=True)
class DumpInfo:
    """What one rank wrote (:func:`dump`) or read (:func:`~dynemb.checkpoint.load`): the
    checkpoint directory ``path``, its ``id``, ``kind`` ("full" or "delta") and the id of
    the dump it follows (``previous``), the ``rows`` of table entries and the ``deleted``
    keys in its files, their ``bytes`` (manifest included) and number (``files``), and the
    ``seconds`` it took."""

    path: str
    id: str
    kind: str
    previous: Optional[str]
    rank: int
    world_size: int
    rows: int
    deleted: int
    bytes: int
    files: int
    seconds: float


def dump(module: torch.nn.Module, path: Union[str, os.PathLike], *,
         since: Union[DumpInfo, str, os.PathLike, None] = None,
         chunk_rows: int = CHUNK_ROWS) -> DumpInfo:
    """Write every dynamic table of ``module`` (a :class:`~dynemb.DynamicEmbCollection`, a
    sharded one, or any module holding them) to the checkpoint directory ``path``.

    The rows of each table (embedding and optimizer state), their keys, slots and scores,
    each tier's clock, the step and the counters go to ``path/rank<r>_of_<w>/`` (this
    rank's share; see :mod:`dynemb.checkpoint.files`), in data files of at most
    ``chunk_rows`` entries, streamed: the tables are never copied whole. The directory is
    written aside and renamed into place once complete: a dump that dies half-way leaves
    the checkpoint that was at ``path`` as it was.

    With ``since`` (the :class:`DumpInfo` or the path of this module's latest dump), only
    what changed since is written: the rows inserted, updated or rescored, the keys that
    left each tier, and the admission counter whole. :func:`~dynemb.checkpoint.load` of the
    full dump and the deltas after it, in order, gives back the tables as they were at the
    last one. Every dump (and load) starts tracking changes anew; ``since`` naming another
    dump, or a module loaded from a ``state_dict`` since, raises ``ValueError``.

    Example::

        >>> import tempfile
        >>> from dynemb.checkpoint import dump
        >>> ec = DynamicEmbCollection([EmbeddingConfig(name="t", embedding_dim=4,
        ...                                            num_embeddings=64, feature_names=["f"])])
        >>> def step(ids):
        ...     kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor(ids),
        ...                                               torch.tensor([len(ids)]))
        ...     ec(kjt)["f"].values().sum().backward()
        >>> step([1, 2, 3])
        >>> root = tempfile.mkdtemp()
        >>> full = dump(ec, f"{root}/full")
        >>> full.kind, full.rows
        ('full', 3)
        >>> step([3, 4])
        >>> delta = dump(ec, f"{root}/delta1", since=full)   # rows 3 and 4 changed
        >>> delta.kind, delta.rows, delta.previous == full.id
        ('delta', 2, True)
    """
    start = time.perf_counter()
    check_int(chunk_rows, "chunk_rows")
    scan = module_tables(module)
    final = Path(path) / rank_dir_name(scan.rank, scan.world_size)
    previous = None if since is None else _latest_dump(scan, since, final)
    dump_id = uuid.uuid4().hex
    remove_stale(final)
    tmp = temporary_dir(final, dump_id)
    try:
        writer = DirectoryWriter(tmp)
        tables = {}
        for index, (key, fqn, collection, name) in enumerate(scan.tables()):
            table = collection.tables[name]
            tables[key] = describe(table, fqn, name, collection.steps[name])
            # the index keeps stems apart: the name is cut so that any table name fits a
            # file name (255 bytes, with the tier, content and chunk after it)
            stem = f"{index:03d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', key)[:STEM_NAME_CHARS]}"
            tracker = table.changes if previous is not None else None
            tables[key]["tiers"] = _TableWriter(writer, stem, table, chunk_rows).write(tracker)
        writer.write_manifest({
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "kind": "full" if previous is None else "delta", "id": dump_id,
            "previous": previous, "created": utc_now(), "rank": scan.rank,
            "world_size": scan.world_size, "tables": tables})
        commit(tmp, final)
    except BaseException:
        wait_for_writes()  # nothing may land in tmp after it is removed
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for collection in scan.collections.values():
        start_tracking(collection.tables, dump_id, collection.generation)
    tiers = [t for table in tables.values() for t in table["tiers"].values()]
    return DumpInfo(str(path), dump_id, "full" if previous is None else "delta", previous,
                    scan.rank, scan.world_size, rows=sum(t["rows"] for t in tiers),
                    deleted=sum(t["deleted"] for t in tiers), bytes=writer.bytes,
                    files=writer.files + 1, seconds=time.perf_counter() - start)


def describe(table, fqn: str, name: str, step: int) -> Dict:
    """A table's manifest entry, tiers aside."""
    return {"collection": fqn, "name": name, "dim": table.dim, "row_width": table.width,
            "dtype": str(table.layout.dtype).replace("torch.", ""),
            "optimizer": table.optimizer.type.value, "storage_mode": table.mode.value,
            "score_policy": table.options.score_strategy.value,
            "signature": signature(table).tolist(), "step": int(step),
            "counters": table.counters.snapshot()}


def _latest_dump(scan: ModuleTables, since, final: Path) -> str:
    """The id ``since`` names, checked to be the latest dump of every table."""
    trackers = {}
    for key, _, collection, name in scan.tables():
        tracker = trackers[key] = collection.tables[name].changes
        if tracker is None:
            raise ValueError(f"table {key!r} has not been dumped or loaded from checkpoint "
                             f"files since it was built or loaded otherwise: nothing says "
                             f"what changed since; write a full dump (since=None)")
        if tracker.generation != collection.generation:
            raise ValueError(f"table {key!r} was loaded from a checkpoint after dump "
                             f"{tracker.dump_id}: write a full dump (since=None)")
    if isinstance(since, DumpInfo):
        since_id, since_dir = since.id, Path(since.path) / final.name
    else:
        since_dir = Path(since) / final.name
        since_id = read_manifest(since_dir)["id"]
    if since_dir.resolve() == final.resolve():
        raise ValueError(f"a delta cannot be written over the dump it follows ({since_dir}): "
                         f"give it a path of its own")
    for key, tracker in trackers.items():
        if tracker.dump_id != since_id:
            raise ValueError(f"since names dump {since_id}, but the latest dump of table "
                             f"{key!r} is {tracker.dump_id}: a delta follows the latest dump")
    return since_id


# files are written on this thread while the next chunk is gathered (torch's gathers and
# file writes release the GIL); one thread: files land in order
_WRITER = ThreadPoolExecutor(1, thread_name_prefix="dynemb-dump")


def wait_for_writes() -> None:
    """Return once every file handed to the writer thread so far is written (or failed)."""
    _WRITER.submit(lambda: None).result()


class _Stream:
    """Entries of one kind for one tier, written in files of exactly ``chunk_rows`` entries
    (the last one fewer). Entries are gathered straight into a chunk-sized staging buffer
    per field; a full buffer is written by the writer thread while the other of two fills:
    the memory held is two chunks, and no freshly allocated memory is touched per file."""

    def __init__(self, writer: DirectoryWriter, stem: str, content: str, chunk_rows: int,
                 record: Dict, counter: str):
        self.writer, self.stem, self.content = writer, stem, content
        self.chunk_rows, self.record, self.counter = chunk_rows, record, counter
        self.buffers: List[Dict[str, torch.Tensor]] = [{}, {}]
        self.in_flight: List[Optional[Future]] = [None, None]
        self.current = 0
        self.written: List[Tuple[Future, int]] = []
        self.pending = 0
        self.count = 0

    def add(self, **tensors: torch.Tensor) -> None:
        """Append entries given whole (one tensor per field, equal first dims)."""
        n = next(iter(tensors.values())).shape[0]
        self._append(n, lambda field, lo, hi, out: out.copy_(tensors[field][lo:hi]),
                     tensors)

    def add_gathered(self, index: torch.Tensor, direct: Dict[str, torch.Tensor],
                     **sources: torch.Tensor) -> None:
        """Append ``sources[f][index]`` for every field ``f`` (gathered into the staging
        buffers, not into new tensors) and the ``direct`` fields as given."""
        def fill(field, lo, hi, out):
            if field in direct:
                out.copy_(direct[field][lo:hi])
                return
            src = sources[field]
            idx = index[lo:hi].to(src.device)
            if src.device.type == "cpu":
                torch.index_select(src, 0, idx, out=out)
            else:
                out.copy_(src.index_select(0, idx))
        self._append(index.numel(), fill, {**sources, **direct})

    def _append(self, n: int, fill, like: Dict[str, torch.Tensor]) -> None:
        done = 0
        while done < n:
            take = min(n - done, self.chunk_rows - self.pending)
            for field, t in like.items():
                fill(field, done, done + take,
                     self._buffer(field, t)[self.pending:self.pending + take])
            self.pending += take
            done += take
            if self.pending == self.chunk_rows:
                self._flush()

    def _buffer(self, field: str, like: torch.Tensor) -> torch.Tensor:
        staging = self.buffers[self.current]
        buf = staging.get(field)
        if buf is None:
            buf = staging[field] = torch.empty((self.chunk_rows, *like.shape[1:]),
                                               dtype=like.dtype)
        return buf

    def close(self) -> None:
        if self.pending:
            self._flush()
        for future, n in self.written:
            self.record["files"].append(future.result())
            self.record[self.counter] += n
        self.written, self.buffers = [], [{}, {}]

    def _flush(self) -> None:
        n, self.pending = self.pending, 0
        name = f"{self.stem}.{self.content}.{self.count:05d}.safetensors"
        self.count += 1
        views = {k: v[:n] for k, v in self.buffers[self.current].items()}
        future = _WRITER.submit(self.writer.write, name, views, self.content)
        self.in_flight[self.current] = future
        self.written.append((future, n))
        self.current ^= 1
        if self.in_flight[self.current] is not None:  # its buffers are free once written
            self.in_flight[self.current].result()


class _TableWriter:
    """Writes the tiers of one table: whole (a full dump, the admission counter, a CACHE
    store that evicted rows since the last dump) or what changed (a delta)."""

    def __init__(self, writer: DirectoryWriter, stem: str, table, chunk_rows: int):
        self.writer, self.stem, self.table, self.chunk_rows = writer, stem, table, chunk_rows

    def write(self, tracker) -> Dict[str, Dict]:
        """The tiers' manifest records; ``tracker`` None: everything, else what it saw."""
        out = {}
        for name, part in self.table.checkpoint_tiers().items():
            record = self._record(part)
            if tracker is None or name == "admission":
                self._whole(name, part, record)
            elif part.store is not None:  # a CACHE backing store: changes logged by key
                evicted = self.table.counters.snapshot()["store_evictions"]
                if evicted == tracker.store_evictions and not tracker.store_erased:
                    self._stored(name, part, tracker.stored.keys(), record)
                else:  # keys the store dropped or expired were not logged: write it whole
                    self._whole(name, part, record)
            else:
                self._changed(name, part, tracker.tier(name), record)
            out[name] = record
        return out

    def _record(self, part: TierParts) -> Dict:
        if part.hash is None:
            layout = dict(capacity=-1, bucket_size=0, clock=0, live_rows=part.store.size())
        else:
            h = part.hash
            layout = dict(capacity=h.capacity, bucket_size=h.bucket_size, clock=h.clock,
                          live_rows=h.size())
        return dict(layout, write="replace", rows=0, deleted=0, tombstones=0, files=[])

    def _stream(self, name: str, content: str, record: Dict, counter: str) -> _Stream:
        return _Stream(self.writer, f"{self.stem}.{name}", content, self.chunk_rows, record,
                       counter)

    def _slot_ranges(self, part: TierParts):
        """``(slots, keys, live)`` of successive slot ranges of ``chunk_rows``."""
        keys, _ = part.hash.image()
        for lo in range(0, part.hash.capacity, self.chunk_rows):
            k = keys[lo:lo + self.chunk_rows]
            slots = torch.arange(lo, lo + k.numel(), device=k.device)
            yield slots, k, (k != EMPTY_KEY) & (k != TOMBSTONE_KEY)

    def _entries(self, stream: _Stream, part: TierParts, slots, keep) -> None:
        keys, scores = part.hash.image()
        picked = slots[keep]
        sources = dict(keys=keys, scores=scores)
        if part.rows is not None:
            sources["rows"] = part.rows
        stream.add_gathered(picked, {"slots": picked}, **sources)

    def _whole(self, name: str, part: TierParts, record: Dict) -> None:
        entries = self._stream(name, "entries", record, "rows")
        if part.hash is None:  # a user backing store: what it exports
            start = 0
            while start is not None:
                chunk = part.store.export(start, self.chunk_rows)
                keys, rows, start = chunk[0], chunk[1], chunk[-1]
                scores = chunk[2] if len(chunk) == 4 else torch.zeros_like(keys)
                entries.add(keys=keys, scores=scores, slots=torch.full_like(keys, -1),
                            rows=rows.reshape(-1, self.table.width))
        else:
            tombstones = self._stream(name, "tombstones", record, "tombstones")
            for slots, keys, live in self._slot_ranges(part):
                self._entries(entries, part, slots, live)
                tombstones.add(slots=slots[keys == TOMBSTONE_KEY])
            tombstones.close()
        entries.close()

    def _changed(self, name: str, part: TierParts, changes: TierChanges, record: Dict) -> None:
        """Live entries of touched slots; the keys that left the tier."""
        record["write"] = "patch"
        entries = self._stream(name, "entries", record, "rows")
        # the touched slots straight from the mask (a delta is small: no scan of every slot)
        touched = changes.touched.nonzero().squeeze(1).to(part.hash.device)
        keys, _ = part.hash.image()
        for lo in range(0, touched.numel(), self.chunk_rows):
            slots = touched[lo:lo + self.chunk_rows]
            held = keys[slots]
            self._entries(entries, part, slots, (held != EMPTY_KEY) & (held != TOMBSTONE_KEY))
        entries.close()
        deleted = self._stream(name, "deleted", record, "deleted")
        left = changes.left_keys()
        for lo in range(0, left.numel(), self.chunk_rows):
            keys = left[lo:lo + self.chunk_rows].to(part.hash.device)
            deleted.add(keys=keys[part.hash.find(keys) < 0])
        deleted.close()

    def _stored(self, name: str, part: TierParts, keys: torch.Tensor, record: Dict) -> None:
        """CACHE store rows written since the last dump, read back from the store."""
        record["write"] = "patch"
        entries = self._stream(name, "entries", record, "rows")
        store = part.store
        for lo in range(0, keys.numel(), self.chunk_rows):
            chunk = keys[lo:lo + self.chunk_rows].to(self.table.device)
            rows, found, scores = store.find(chunk)
            slots = (part.hash.find(chunk.to(part.hash.device)).to(chunk.device)
                     if part.hash is not None else torch.full_like(chunk, -1))
            entries.add(keys=chunk[found], scores=scores[found], slots=slots[found],
                        rows=rows[found])
        entries.close()
