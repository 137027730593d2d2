"""The on-disk format of checkpoint files, and how they are written and read safely.

A checkpoint is a directory holding one **rank directory** per rank that wrote it,
``rank<r>_of_<w>/`` (an unsharded module is ``rank0_of_1``), each with:

- ``manifest.json``::

    {"format": "dynemb-checkpoint", "format_version": 1,
     "kind": "full" | "delta", "id": "<uuid>", "previous": null | "<id of the dump before>",
     "created": "<UTC ISO 8601>", "rank": r, "world_size": w,
     "tables": {"<fqn>/<table>": {           # the table's name alone at the module's root
         "collection": "<fqn>", "name": "<table>", "dim", "row_width", "dtype",
         "optimizer", "storage_mode", "score_policy",
         "signature": [int, ...],            # table_state.signature: what must match
         "step": int, "counters": {name: int, ...},
         "tiers": {"device" | "host" | "admission": {
             "capacity", "bucket_size", "clock",  # capacity -1: a user backing store
             "live_rows": int,               # keys the tier held at the dump
             "write": "replace" | "patch",   # the whole tier / only what changed
             "rows": int, "deleted": int, "tombstones": int,   # entries in the files
             "files": [{"file", "content", "rows", "bytes", "sha256"}, ...]}}}}}

- data files, safetensors, each of at most ``chunk_rows`` entries, by ``content``:
  ``entries``: ``keys`` [n] int64, ``scores`` [n] int64, ``slots`` [n] int64 (the slot
  the key held, -1 if unknown) and ``rows`` [n, row_width] in the table dtype (embedding
  then optimizer state, as the table stores them; none for ``admission``);
  ``deleted``: ``keys`` [n] that left the tier since the previous dump;
  ``tombstones``: ``slots`` [n] of erased slots (a full image needs them: lookups probe
  past them).

``host`` is the DEFAULT host tier or the CACHE backing store; ``admission`` the admission
counter. A ``replace`` tier holds every live entry; a ``patch`` tier (deltas) holds the
entries that changed and the keys deleted since the previous dump.

Writing is atomic: a rank directory is written under a temporary sibling name, every file
and the directory are fsynced, then it is renamed into place (exchanged with the one it
replaces, which is removed only then). Reading checks every file's size and sha256 against
the manifest before its content is used.
"""
from __future__ import annotations

import ctypes
import datetime
import errno
import json
import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional

import torch

from dynemb.checkpoint.safetensors_io import SafetensorsError, write_file
from dynemb.checkpoint.safetensors_io import read_file as read_safetensors

FORMAT = "dynemb-checkpoint"
#: Bumped when the meaning of the files changes.
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class CheckpointFileError(ValueError):
    """A checkpoint directory is missing, incomplete, corrupted or does not fit the module."""


def rank_dir_name(rank: int, world_size: int) -> str:
    return f"rank{rank}_of_{world_size}"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# -- writing ----------------------------------------------------------------------------------
class DirectoryWriter:
    """Writes data files into one (temporary) directory, fsynced, with their records."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.bytes = 0
        self.files = 0
        self._unsynced: List[Path] = []

    def write(self, name: str, tensors: Dict[str, torch.Tensor], content: str) -> Dict:
        """Write ``tensors`` as safetensors file ``name`` (streamed from their memory, hashed
        on the way); returns its manifest record."""
        rows = int(next(iter(tensors.values())).shape[0])
        # synced all together by write_manifest: the disk takes them in the background
        size, digest = write_file(self.directory / name, tensors, {"content": content},
                                  sync=False)
        self._unsynced.append(self.directory / name)
        self.bytes += size
        self.files += 1
        return {"file": name, "content": content, "rows": rows, "bytes": size,
                "sha256": digest}

    def write_manifest(self, manifest: Dict) -> None:
        """Write the manifest, last, once every data file is on the disk (fsynced)."""
        for path in self._unsynced:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self._unsynced = []
        data = json.dumps(manifest, indent=1, sort_keys=True).encode()
        _write_synced(self.directory / MANIFEST, data)
        self.bytes += len(data)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_dir(final: Path, token: str) -> Path:
    """A fresh sibling of ``final`` to write into (hidden: ``.<name>.tmp-<token>``)."""
    tmp = final.with_name(f".{final.name}.tmp-{token}")
    tmp.mkdir(parents=True)
    return tmp


def remove_stale(final: Path) -> None:
    """Clean up after dumps that died before committing: their temporary siblings of
    ``final`` are removed, and a previous directory left aside by an interrupted
    :func:`commit` (no atomic exchange) goes back in place."""
    if not final.parent.is_dir():
        return
    for aside in sorted(final.parent.glob(f".{final.name}.old-*")):
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(aside, final)
    for tmp in final.parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)


def commit(tmp: Path, final: Path) -> None:
    """Put the complete directory ``tmp`` in place of ``final`` (which may exist)."""
    _fsync_dir(tmp)
    if final.exists():
        if not _exchange(tmp, final):
            # no atomic exchange here: move the old one aside first (a crash between the two
            # renames leaves it as ``.<name>.old-*``)
            aside = final.with_name(f".{final.name}.old-{tmp.name.rsplit('-', 1)[-1]}")
            os.rename(final, aside)
            os.rename(tmp, final)
            tmp = aside
        _fsync_dir(final.parent)
        shutil.rmtree(tmp)  # the replaced directory
    else:
        os.rename(tmp, final)
        _fsync_dir(final.parent)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where that is not available."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


# -- reading ----------------------------------------------------------------------------------
def read_manifest(rank_dir: Path) -> Dict:
    """The manifest of ``rank_dir``, checked for format and version."""
    path = rank_dir / MANIFEST
    if not path.is_file():
        parent = rank_dir.parent
        aside = sorted(parent.glob(f".{rank_dir.name}.old-*")) if parent.is_dir() else []
        if aside:
            raise CheckpointFileError(f"no checkpoint at {rank_dir}: a dump interrupted while "
                                      f"replacing it left the previous one at {aside[0]} (the "
                                      f"next dump to {parent} puts it back)")
        others = sorted(p.name for p in parent.glob("rank*_of_*")) if parent.is_dir() else []
        if others:
            raise CheckpointFileError(
                f"{parent} holds {others}, not {rank_dir.name}: it was written by another "
                f"world size; files load into the same world size only (reshard through "
                f"torch.distributed.checkpoint and the module's state_dict)")
        raise CheckpointFileError(f"no checkpoint at {rank_dir} ({path} is missing)")
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError) as err:
        raise CheckpointFileError(f"{path} cannot be read: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointFileError(f"{path} is not a dynemb checkpoint manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointFileError(f"{path} has format version {manifest.get('format_version')}"
                                  f", this dynemb reads version {FORMAT_VERSION}")
    missing = _missing_fields(manifest)
    if missing:
        raise CheckpointFileError(f"{path} is incomplete: it lacks {missing}")
    return manifest


_FIELDS = ("kind", "id", "previous", "rank", "world_size", "tables")
_TABLE_FIELDS = ("signature", "step", "counters", "tiers")
_TIER_FIELDS = ("capacity", "bucket_size", "clock", "live_rows", "write", "files")
_FILE_FIELDS = ("file", "content", "rows", "bytes", "sha256")


def _missing_fields(manifest: Dict) -> List[str]:
    """Fields the manifest lacks, by path (``tables.t0.tiers.device.clock``)."""
    missing = [f for f in _FIELDS if f not in manifest]
    for key, table in manifest.get("tables", {}).items():
        missing += [f"tables.{key}.{f}" for f in _TABLE_FIELDS if f not in table]
        for name, tier in table.get("tiers", {}).items():
            where = f"tables.{key}.tiers.{name}"
            missing += [f"{where}.{f}" for f in _TIER_FIELDS if f not in tier]
            for i, record in enumerate(tier.get("files", [])):
                missing += [f"{where}.files[{i}].{f}" for f in _FILE_FIELDS if f not in record]
    return missing


def file_records(manifest: Dict) -> List[Dict]:
    return [f for t in manifest["tables"].values() for tier in t["tiers"].values()
            for f in tier["files"]]


def check_sizes(rank_dir: Path, manifest: Dict) -> None:
    """Every data file of ``manifest`` exists with its recorded size."""
    for record in file_records(manifest):
        path = rank_dir / record["file"]
        if not path.is_file():
            raise CheckpointFileError(f"{path} is missing")
        size = path.stat().st_size
        if size != record["bytes"]:
            raise CheckpointFileError(f"{path} has {size} bytes, the manifest says "
                                      f"{record['bytes']} (truncated or replaced?)")


def read_file(rank_dir: Path, record: Dict,
              buffer: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    """The tensors of one data file, after checking its size and sha256: views into
    ``buffer`` when given (reused between files by a caller that consumes each file before
    reading the next), else into a buffer of their own."""
    path = rank_dir / record["file"]
    try:
        return read_safetensors(path, record["bytes"], record["sha256"], buffer)
    except OSError as err:
        raise CheckpointFileError(f"{path} cannot be read: {err}") from None
    except SafetensorsError as err:
        raise CheckpointFileError(str(err)) from None
