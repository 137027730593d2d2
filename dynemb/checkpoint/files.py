"""The on-disk format of checkpoint files, and how they are written and read safely.

A checkpoint is a directory holding one **rank directory** per rank that wrote it,
``rank<r>_of_<w>/`` (an unsharded module is ``rank0_of_1``), each with:

- ``manifest.json``::

    {"format": "dynemb-checkpoint", "format_version": 2,
     "kind": "full" | "delta", "id": "<uuid>", "previous": null | "<id of the dump before>",
     "created": "<UTC ISO 8601>", "rank": r, "world_size": w,
     "tables": {"<fqn>/<table>": {           # the table's name alone at the module's root
         "collection": "<fqn>", "name": "<table>", "dim", "row_width", "dtype",
         "optimizer", "storage_mode", "score_policy",
         "signature": [int, ...],            # table_state.signature: what must match,
                                             # then the sharding scheme
         "step": int, "counters": {name: int, ...},
         "tiers": {"device" | "host" | "admission": {
             "capacity", "bucket_size", "clock",  # capacity -1: a user backing store
             "live_rows": int,               # keys the tier held at the dump
             "write": "replace" | "patch",   # the whole tier / only what changed
             "rows": int, "deleted": int, "tombstones": int,   # entries in the files
             "files": [{"file", "content", "rows", "bytes", "sha256"}, ...]}}}},
     "manifest_sha256": "<hex>"}             # see manifest_checksum

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
replaces, which is removed only then). Reading (:mod:`dynemb.checkpoint.manifest`) checks
the manifest's checksum before anything else, then its fields, and resolves every data file
inside the rank directory (:func:`data_path`) before opening it; each file's size and
sha256 are checked against the manifest before its content is used.
"""
from __future__ import annotations

import ctypes
import datetime
import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Dict, List, Optional

import torch

from dynemb.checkpoint.safetensors_io import SafetensorsError, write_file
from dynemb.checkpoint.safetensors_io import read_file as read_safetensors

FORMAT = "dynemb-checkpoint"
#: Bumped when the meaning of the files changes (2: the manifest carries its checksum).
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
#: The manifest field holding :func:`manifest_checksum`.
CHECKSUM_FIELD = "manifest_sha256"
#: What a data file may be called: a plain name in the rank directory, as dumps write them.
DATA_FILE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*\.safetensors")


class CheckpointFileError(ValueError):
    """A checkpoint directory is missing, incomplete, corrupted or does not fit the module."""


def rank_dir_name(rank: int, world_size: int) -> str:
    return f"rank{rank}_of_{world_size}"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def manifest_checksum(manifest: Dict) -> str:
    """sha256 (hex) of the manifest without its ``manifest_sha256`` field, serialized
    canonically: JSON with sorted keys, no whitespace, ASCII only."""
    rest = {k: v for k, v in manifest.items() if k != CHECKSUM_FIELD}
    canonical = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                           allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def data_path(rank_dir: Path, name: object) -> Path:
    """Where data file ``name`` of a manifest is, refused (:class:`CheckpointFileError`)
    unless it is a plain file name of the format that resolves inside ``rank_dir``, links
    followed. Nothing is opened: the error is the same whether the path it names exists or
    not, and says nothing of what is there."""
    if isinstance(name, str) and DATA_FILE_NAME.fullmatch(name):
        home = os.path.realpath(rank_dir)
        resolved = os.path.realpath(os.path.join(home, name))
        if os.path.dirname(resolved) == home and resolved != home:
            return Path(resolved)
    raise CheckpointFileError(f"{rank_dir / MANIFEST} names data file {name!r}, which is not "
                              f"a file of {rank_dir}: data files are plain names ending in "
                              f".safetensors, inside the rank directory (links out of it are "
                              f"refused)")


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
        manifest = {**manifest, CHECKSUM_FIELD: manifest_checksum(manifest)}
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


# -- reading (the manifest: dynemb.checkpoint.manifest) ------------------------------------
def file_records(manifest: Dict) -> List[Dict]:
    return [f for t in manifest["tables"].values() for tier in t["tiers"].values()
            for f in tier["files"]]


def check_paths(rank_dir: Path, manifest: Dict) -> None:
    """Every data file of ``manifest`` is named inside ``rank_dir`` (see :func:`data_path`);
    nothing is opened."""
    for record in file_records(manifest):
        data_path(rank_dir, record["file"])


def check_sizes(rank_dir: Path, manifest: Dict) -> None:
    """Every data file of ``manifest`` (whose paths passed :func:`check_paths`) exists with
    its recorded size."""
    for record in file_records(manifest):
        path = rank_dir / record["file"]
        real = data_path(rank_dir, record["file"])
        if not real.is_file():
            raise CheckpointFileError(f"{path} is missing")
        size = real.stat().st_size
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
        data = read_safetensors(data_path(rank_dir, record["file"]), record["bytes"],
                                record["sha256"], buffer)
    except OSError as err:
        raise CheckpointFileError(f"{path} cannot be read: {err}") from None
    except SafetensorsError as err:
        raise CheckpointFileError(str(err)) from None
    return data
