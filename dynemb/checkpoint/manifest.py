"""Reading a rank directory's manifest: nothing in it is used before it is checked.

:func:`read_manifest` checks, in order:

1. the manifest is a file of the rank directory (a link out of it is refused);
2. it is JSON (no duplicate keys, no NaN), of format ``dynemb-checkpoint`` version
   :data:`~dynemb.checkpoint.files.FORMAT_VERSION`;
3. its ``manifest_sha256`` is :func:`~dynemb.checkpoint.files.manifest_checksum` of the rest
   (an edited or damaged manifest is refused before any of its values is trusted);
4. every field has its type and range (:func:`check_fields`), and the counts agree with
   each other (a tier's ``rows`` are the rows of its files).

The format itself is documented in :mod:`dynemb.checkpoint.files`.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Dict, List

from dynemb.checkpoint.files import (CHECKSUM_FIELD, FORMAT, FORMAT_VERSION, MANIFEST,
                                     CheckpointFileError, manifest_checksum)
from dynemb.foundations.counters import COUNTER_NAMES

TIERS = ("device", "host", "admission")
_CONTENTS = {"replace": ("entries", "tombstones"), "patch": ("entries", "deleted")}
_COUNTS = {"entries": "rows", "deleted": "deleted", "tombstones": "tombstones"}
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: The fields a manifest must have, by level (checked before their values).
_FIELDS = ("kind", "id", "previous", "rank", "world_size", "tables")
_TABLE_FIELDS = ("signature", "step", "counters", "tiers")
_TIER_FIELDS = ("capacity", "bucket_size", "clock", "live_rows", "write", "files")
_FILE_FIELDS = ("file", "content", "rows", "bytes", "sha256")


def read_manifest(rank_dir: Path) -> Dict:
    """The manifest of ``rank_dir``, checked (see the module docstring); raises
    :class:`~dynemb.checkpoint.files.CheckpointFileError` naming the file and the field."""
    path = rank_dir / MANIFEST
    home = os.path.realpath(rank_dir)
    if os.path.dirname(os.path.realpath(path)) != home:
        raise CheckpointFileError(f"{path} links out of {rank_dir}: refused")
    if not path.is_file():
        raise CheckpointFileError(_missing(rank_dir))
    try:
        manifest = json.loads(path.read_bytes(), object_pairs_hook=_no_repeated_keys,
                              parse_constant=_no_constant)
    except (OSError, ValueError) as err:
        raise CheckpointFileError(f"{path} cannot be read: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointFileError(f"{path} is not a dynemb checkpoint manifest")
    version = manifest.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        older = " (written before manifests carried a checksum)" if version == 1 else ""
        raise CheckpointFileError(f"{path} has format version {version!r}{older}, this "
                                  f"dynemb reads version {FORMAT_VERSION}")
    if manifest.get(CHECKSUM_FIELD) != manifest_checksum(manifest):
        raise CheckpointFileError(f"{path}: the manifest does not match its checksum "
                                  f"{CHECKSUM_FIELD} (edited or damaged): refused")
    missing = _missing_fields(manifest)
    if missing:
        raise CheckpointFileError(f"{path} is incomplete: it lacks {missing}")
    check_fields(manifest, path)
    return manifest


def _missing(rank_dir: Path) -> str:
    """Why there is no manifest in ``rank_dir``, in words."""
    path = rank_dir / MANIFEST
    parent = rank_dir.parent
    aside = sorted(parent.glob(f".{rank_dir.name}.old-*")) if parent.is_dir() else []
    if aside:
        return (f"no checkpoint at {rank_dir}: a dump interrupted while replacing it left the "
                f"previous one at {aside[0]} (the next dump to {parent} puts it back)")
    if rank_dir.is_dir():
        return (f"no checkpoint at {rank_dir}: its manifest {path} is missing (deleted, or "
                f"the directory was not written by dump)")
    others = sorted(p.name for p in parent.glob("rank*_of_*")) if parent.is_dir() else []
    if others:
        return (f"{parent} holds {others}, not {rank_dir.name}: it was written by another "
                f"world size; files load into the same world size only (reshard through "
                f"torch.distributed.checkpoint and the module's state_dict)")
    return f"no checkpoint at {rank_dir} ({path} is missing)"


def _no_repeated_keys(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"a key is repeated in {sorted(keys)}")
    return dict(pairs)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _missing_fields(manifest: Dict) -> List[str]:
    """Fields the manifest lacks, by path (``tables.t0.tiers.device.clock``)."""
    missing = [f for f in _FIELDS if f not in manifest]
    tables = manifest.get("tables")
    for key, table in (tables.items() if isinstance(tables, dict) else ()):
        if not isinstance(table, dict):
            continue
        missing += [f"tables.{key}.{f}" for f in _TABLE_FIELDS if f not in table]
        tiers = table.get("tiers")
        for name, tier in (tiers.items() if isinstance(tiers, dict) else ()):
            if not isinstance(tier, dict):
                continue
            where = f"tables.{key}.tiers.{name}"
            missing += [f"{where}.{f}" for f in _TIER_FIELDS if f not in tier]
            files = tier.get("files")
            for i, record in enumerate(files if isinstance(files, list) else ()):
                if isinstance(record, dict):
                    missing += [f"{where}.files[{i}].{f}" for f in _FILE_FIELDS
                                if f not in record]
    return missing


# -- fields -----------------------------------------------------------------------------------
_INT64_MAX = (1 << 63) - 1
_TEXT_FIELDS = ("collection", "name", "dtype", "optimizer", "storage_mode", "score_policy")


def check_fields(manifest: Dict, path: Path) -> None:
    """Every field of ``manifest`` (which has them all) has its type and range; raises
    :class:`CheckpointFileError` naming ``path`` and the field."""
    fields = _Fields(path)
    kind = fields.choice(manifest["kind"], "kind", ("full", "delta"))
    fields.text(manifest["id"], "id")
    if kind == "delta":
        fields.text(manifest["previous"], "previous")
    elif manifest["previous"] is not None:
        fields.fail("previous", manifest["previous"], "null in a full dump")
    world_size = fields.integer(manifest["world_size"], "world_size", low=1)
    fields.integer(manifest["rank"], "rank", low=0, high=world_size - 1)
    seen: Dict[str, str] = {}
    for key, table in fields.mapping(manifest["tables"], "tables").items():
        where = f"tables.{key}"
        _check_table(fields, fields.mapping(table, where), where, kind)
        for name, tier in table["tiers"].items():
            for i, record in enumerate(tier["files"]):
                at = f"{where}.tiers.{name}.files[{i}].file"
                first = seen.setdefault(record["file"], at)
                if first != at:
                    fields.fail(at, record["file"], f"a file of its own, not {first}'s")


def _check_table(fields: "_Fields", table: Dict, where: str, kind: str) -> None:
    for name in _TEXT_FIELDS:
        if name in table:
            fields.text(table[name], f"{where}.{name}", empty=True)
    signature = table["signature"]
    if not isinstance(signature, list) or not all(
            _is_int(v) and -_INT64_MAX <= v <= _INT64_MAX for v in signature):
        fields.fail(f"{where}.signature", signature, "a list of int64s")
    for name, column in (("dim", 1), ("row_width", 2)):
        if name in table:
            value = fields.integer(table[name], f"{where}.{name}", low=1)
            if len(signature) > column and signature[column] != value:
                fields.fail(f"{where}.{name}", value, f"{signature[column]}, as in the signature")
    fields.integer(table["step"], f"{where}.step", low=0)
    counters = fields.mapping(table["counters"], f"{where}.counters")
    for name, value in counters.items():
        if name not in COUNTER_NAMES:
            fields.fail(f"{where}.counters", name, f"named one of {list(COUNTER_NAMES)}")
        fields.integer(value, f"{where}.counters.{name}", low=0)
    for name, tier in fields.mapping(table["tiers"], f"{where}.tiers").items():
        if name not in TIERS:
            fields.fail(f"{where}.tiers", name, f"named one of {list(TIERS)}")
        at = f"{where}.tiers.{name}"
        _check_tier(fields, fields.mapping(tier, at), at, kind, name)


def _check_tier(fields: "_Fields", tier: Dict, where: str, kind: str, name: str) -> None:
    capacity = fields.integer(tier["capacity"], f"{where}.capacity", low=-1)
    bucket = fields.integer(tier["bucket_size"], f"{where}.bucket_size", low=0)
    fields.integer(tier["clock"], f"{where}.clock", low=0)
    if capacity == -1:  # a user backing store
        if name != "host" or bucket != 0:
            fields.fail(f"{where}.capacity", capacity, "positive (-1: a user store, host only)")
    elif capacity == 0 or bucket == 0 or bucket & (bucket - 1) or capacity % bucket:
        fields.fail(f"{where}.bucket_size", bucket,
                    f"a power of two that divides the capacity {capacity}")
    live = fields.integer(tier["live_rows"], f"{where}.live_rows", low=0,
                          high=capacity if capacity >= 0 else _INT64_MAX)
    write = fields.choice(tier["write"], f"{where}.write",
                          ("replace",) if kind == "full" else ("replace", "patch"))
    files = tier["files"]
    if not isinstance(files, list):
        fields.fail(f"{where}.files", files, "a list")
    totals = dict.fromkeys(_COUNTS, 0)
    for i, record in enumerate(files):
        at = f"{where}.files[{i}]"
        fields.mapping(record, at)
        content = fields.choice(record["content"], f"{at}.content", _CONTENTS[write])
        fields.text(record["file"], f"{at}.file")
        totals[content] += fields.integer(record["rows"], f"{at}.rows", low=0)
        fields.integer(record["bytes"], f"{at}.bytes", low=8)
        if not isinstance(record["sha256"], str) or not _SHA256.fullmatch(record["sha256"]):
            fields.fail(f"{at}.sha256", record["sha256"], "64 lowercase hex digits")
    for content, total in totals.items():
        count = _COUNTS[content]
        if fields.integer(tier.get(count), f"{where}.{count}", low=0) != total:
            fields.fail(f"{where}.{count}", tier[count], f"{total}, the {content} of its files")
    if write == "replace" and capacity >= 0 and totals["entries"] != live:
        fields.fail(f"{where}.live_rows", live, f"{totals['entries']}, the entries of its files")


def _is_int(value) -> bool:
    return type(value) is int  # not bool, not float


class _Fields:
    """Checks values of one manifest; errors name the file and the field."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, field: str, value, expected: str):
        raise CheckpointFileError(f"{self.path}: {field} must be {expected}, got {value!r}")

    def integer(self, value, field: str, *, low: int, high: int = _INT64_MAX) -> int:
        if not _is_int(value) or not low <= value <= high:
            self.fail(field, value, f"an int in [{low}, {high}]")
        return value

    def text(self, value, field: str, *, empty: bool = False) -> str:
        if not isinstance(value, str) or not (value or empty):
            self.fail(field, value, "a string" if empty else "a non-empty string")
        return value

    def choice(self, value, field: str, allowed) -> str:
        if not isinstance(value, str) or value not in allowed:
            self.fail(field, value, f"one of {list(allowed)}")
        return value

    def mapping(self, value, field: str) -> Dict:
        if not isinstance(value, dict):
            self.fail(field, value, "an object")
        return value
