"""One :class:`~dynemb.rows.hash_table.ScoredHashTable` in a file: its live entries and its layout.

The file is a safetensors file written and read as checkpoint files are
(:mod:`dynemb.checkpoint.safetensors_io`); a file stands alone, so it carries its own checks:

- tensors (int64): ``keys`` [n], ``scores`` [n], ``slots`` [n] (the slot each key holds) and
  ``tombstones`` [t] (slots of erased keys: lookups probe past them, so an exact image keeps
  them);
- ``__metadata__`` (strings): ``format`` (``dynemb-hash-table``), ``format_version``,
  ``capacity``, ``bucket_size``, ``clock``, ``policy`` (a :class:`~dynemb.types.ScorePolicy`
  value), ``grow_at_load_factor`` and ``max_capacity`` (``none`` when unset), ``size`` (n),
  and ``content_sha256``: the sha256 of the four tensors' bytes in that order.

Pins are not saved: a loaded table has none. A load checks everything it reads before it
changes a table (a file that is not one, a field missing or out of range, a key outside its
bucket or past an empty slot of its probe, two keys in one slot) and raises
:class:`HashTableFileError` naming the file and the field.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Dict, Optional, Union

import torch

from dynemb.checkpoint.image_checks import check_slot_image
from dynemb.checkpoint.safetensors_io import SafetensorsError, read_whole_file, write_file
from dynemb.rows.hash_table import ScoredHashTable
from dynemb.types import EMPTY_KEY, TOMBSTONE_KEY, ScorePolicy

FORMAT = "dynemb-hash-table"
FORMAT_VERSION = 1
#: The tensors of a file, in the order ``content_sha256`` hashes them.
TENSORS = ("keys", "scores", "slots", "tombstones")

PathLike = Union[str, "os.PathLike[str]"]


class HashTableFileError(ValueError):
    """A hash table file is missing a field, corrupted, or does not fit the table."""


def dump_hash_table(table: ScoredHashTable, path: PathLike) -> int:
    """Write ``table``'s live keys, their scores and slots, its tombstones and its layout to
    ``path`` (replaced atomically: written beside it, fsynced, then renamed); returns how many
    keys it holds.

    Example::

        >>> import tempfile
        >>> table = ScoredHashTable(256, policy=ScorePolicy.LFU)
        >>> _ = table.find_or_insert(torch.tensor([7, 42, 7]))
        >>> path = Path(tempfile.mkdtemp()) / "table.safetensors"
        >>> dump_hash_table(table, path)
        2
        >>> copy = load_hash_table(path)
        >>> copy.find(torch.tensor([7, 42, 5])).tolist() == table.find(
        ...     torch.tensor([7, 42, 5])).tolist()
        True
        >>> copy.scores_at(copy.find(torch.tensor([7]))).tolist(), copy.clock == table.clock
        ([2], True)
    """
    chunk = table.export(0)
    image_keys, _ = table.image()
    tensors = {"keys": chunk.keys, "scores": chunk.scores, "slots": chunk.slots,
               "tombstones": (image_keys == TOMBSTONE_KEY).nonzero().reshape(-1)}
    tensors = {name: t.detach().to("cpu", torch.int64).contiguous()
               for name, t in tensors.items()}
    metadata = {"format": FORMAT, "format_version": str(FORMAT_VERSION),
                "capacity": str(table.capacity), "bucket_size": str(table.bucket_size),
                "clock": str(table.clock), "policy": table.policy.value,
                "grow_at_load_factor": _optional(table.grow_at_load_factor),
                "max_capacity": _optional(table.max_capacity),
                "size": str(tensors["keys"].numel()), "content_sha256": _content_sha256(tensors)}
    final = Path(path)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        write_file(tmp, tensors, metadata)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()
    return tensors["keys"].numel()


def load_hash_table(path: PathLike, table: Optional[ScoredHashTable] = None, *,
                    device=None, backend: Optional[str] = None) -> ScoredHashTable:
    """The table saved in ``path``: every key in its saved slot with its score, the saved
    clock, no pins.

    With ``table`` None a new table of the saved layout (capacity, bucket size, policy, growth
    settings) is built on ``device`` (``backend`` as :class:`ScoredHashTable` takes it).
    Given a ``table``, it is loaded in place and returned: its capacity, bucket size and
    policy must be the saved ones (a key's slot depends on the first two, a score's meaning
    on the third), else :class:`HashTableFileError` says which differs and nothing changes;
    its own growth settings stay.

    Example::

        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "table.safetensors"
        >>> _ = dump_hash_table(ScoredHashTable(256), path)
        >>> load_hash_table(path, ScoredHashTable(512))
        Traceback (most recent call last):
        ...
        dynemb.checkpoint.hash_table_files.HashTableFileError: ...table.safetensors: capacity is 256 but the table's is 512; a key's slot depends on it (load into a new table: table=None)
    """
    where = str(path)
    try:
        tensors, metadata = read_whole_file(Path(path))
    except SafetensorsError as err:
        raise HashTableFileError(str(err)) from None
    layout = _read_metadata(metadata, where)
    _check_tensors(tensors, layout, where)
    capacity, bucket_size, policy = (layout[k] for k in ("capacity", "bucket_size", "policy"))
    if table is None:
        try:
            table = ScoredHashTable(capacity, bucket_size=bucket_size, policy=policy,
                                    device=device, backend=backend,
                                    grow_at_load_factor=layout["grow_at_load_factor"],
                                    max_capacity=layout["max_capacity"])
        except (TypeError, ValueError) as err:
            raise HashTableFileError(f"{where}: its layout does not make a table: {err}") from None
    else:
        for field, mine in (("capacity", table.capacity), ("bucket_size", table.bucket_size),
                            ("policy", table.policy)):
            saved = layout[field]
            if saved != mine:
                raise HashTableFileError(
                    f"{where}: {field} is {_show(saved)} but the table's is {_show(mine)}; "
                    + ("a score means another thing under another policy"
                       if field == "policy" else "a key's slot depends on it")
                    + " (load into a new table: table=None)")
    keys = torch.full((capacity,), EMPTY_KEY, dtype=torch.int64)
    scores = torch.zeros(capacity, dtype=torch.int64)
    keys[tensors["tombstones"]] = TOMBSTONE_KEY
    keys[tensors["slots"]] = tensors["keys"]
    scores[tensors["slots"]] = tensors["scores"]
    try:
        check_slot_image(keys, bucket_size, where)
    except ValueError as err:
        raise HashTableFileError(str(err)) from None
    table.load_image(keys.to(table.device), scores.to(table.device), layout["clock"])
    return table


def _content_sha256(tensors: Dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in TENSORS:
        digest.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _optional(value) -> str:
    return "none" if value is None else repr(value)


def _show(value) -> str:
    return value.value if isinstance(value, ScorePolicy) else str(value)


def _read_metadata(metadata: Dict[str, str], where: str) -> Dict[str, object]:
    """The layout the metadata gives, checked field by field."""
    def field(name: str) -> str:
        if name not in metadata:
            raise HashTableFileError(f"{where}: metadata field {name!r} is missing")
        return metadata[name]

    def integer(name: str, low: int) -> int:
        text = field(name)
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise HashTableFileError(f"{where}: metadata field {name!r} must be an integer "
                                     f">= {low}, got {text!r}")
        return value

    if field("format") != FORMAT:
        raise HashTableFileError(f"{where}: metadata field 'format' is {metadata['format']!r}, "
                                 f"not {FORMAT!r}: not a hash table file")
    if field("format_version") != str(FORMAT_VERSION):
        raise HashTableFileError(f"{where}: metadata field 'format_version' is "
                                 f"{metadata['format_version']!r}; this version reads "
                                 f"{FORMAT_VERSION}")
    try:
        policy = ScorePolicy(field("policy"))
    except ValueError:
        raise HashTableFileError(f"{where}: metadata field 'policy' is {metadata['policy']!r}, "
                                 f"not one of {[p.value for p in ScorePolicy]}") from None
    layout: Dict[str, object] = {"policy": policy}
    for name, low in (("capacity", 1), ("bucket_size", 1), ("clock", 0), ("size", 0)):
        layout[name] = integer(name, low)
    for name, kind in (("grow_at_load_factor", float), ("max_capacity", int)):
        text = field(name)
        try:
            layout[name] = None if text == "none" else kind(text)
        except ValueError:
            raise HashTableFileError(f"{where}: metadata field {name!r} must be 'none' or a "
                                     f"{kind.__name__}, got {text!r}") from None
    layout["content_sha256"] = field("content_sha256")
    return layout


def _check_tensors(tensors: Dict[str, torch.Tensor], layout: Dict[str, object],
                   where: str) -> None:
    """The four tensors are there, of the saved size, in range, and hash as saved."""
    for name in TENSORS:
        t = tensors.get(name)
        if t is None:
            raise HashTableFileError(f"{where}: tensor {name!r} is missing")
        if t.dtype != torch.int64 or t.dim() != 1:
            raise HashTableFileError(f"{where}: tensor {name!r} must be 1-D int64, got "
                                     f"{t.dtype} {tuple(t.shape)}")
        if name != "tombstones" and t.numel() != layout["size"]:
            raise HashTableFileError(f"{where}: tensor {name!r} has {t.numel()} entries but "
                                     f"metadata field 'size' says {layout['size']}")
    extra = sorted(set(tensors) - set(TENSORS))
    if extra:
        raise HashTableFileError(f"{where}: unexpected tensor {extra[0]!r}")
    if _content_sha256(tensors) != layout["content_sha256"]:
        raise HashTableFileError(f"{where}: its tensors do not match metadata field "
                                 f"'content_sha256' (corrupted or edited)")
    capacity = layout["capacity"]
    for name in ("slots", "tombstones"):
        t = tensors[name]
        if t.numel() and not (0 <= int(t.min()) and int(t.max()) < capacity):
            raise HashTableFileError(f"{where}: tensor {name!r} holds a slot outside "
                                     f"[0, {capacity})")
    taken = torch.cat([tensors["slots"], tensors["tombstones"]])
    if torch.unique(taken).numel() != taken.numel():
        raise HashTableFileError(f"{where}: tensors 'slots' and 'tombstones' name a slot twice")
    keys = tensors["keys"]
    if bool(((keys == EMPTY_KEY) | (keys == TOMBSTONE_KEY)).any()):
        raise HashTableFileError(f"{where}: tensor 'keys' holds a reserved key (EMPTY_KEY or "
                                 f"TOMBSTONE_KEY)")
