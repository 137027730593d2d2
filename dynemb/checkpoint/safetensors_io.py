"""Safetensors files written and read without intermediate copies, hashed on the way.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header size
``N``, ``N`` bytes of JSON (``{"__metadata__": {...}, "<name>": {"dtype", "shape",
"data_offsets": [begin, end]}, ...}``, padded with spaces to a multiple of 8), then the
tensors' bytes. ``safetensors.torch.save`` builds the whole file in memory and ``load``
copies it out again; checkpoint files of a million rows are hundreds of MB, so here:

- :func:`write_file` writes the header, then each tensor straight from its memory, feeding
  the same bytes to sha256;
- :func:`read_file` reads the file into a buffer the caller may reuse, checks size and
  sha256, and returns views into that buffer.

Files written here load with ``safetensors.torch.load_file`` and the other way round (tested).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
          torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}
#: Largest JSON header accepted when reading (the format's own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000
#: Bytes read per call: each piece is hashed while the next one is read.
READ_PIECE_BYTES = 64 << 20
# sha256 and file I/O both release the GIL: hashing on this thread overlaps the I/O
_HASHER = ThreadPoolExecutor(1, thread_name_prefix="dynemb-sha256")


class SafetensorsError(ValueError):
    """A file is not a well-formed safetensors file (or not the one expected)."""


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _hash_beside(digest, data) -> Optional[Future]:
    """``digest.update(data)`` on the hashing thread (None: done here, at once, when the
    interpreter is exiting and takes no new thread work: a non-blocking dump still being
    written then is finished, not dropped)."""
    try:
        return _HASHER.submit(digest.update, data)
    except RuntimeError:
        digest.update(data)
        return None


def write_file(path: Path, tensors: Dict[str, torch.Tensor],
               metadata: Optional[Dict[str, str]] = None, *,
               sync: bool = True) -> Tuple[int, str]:
    """Write ``tensors`` to ``path`` as a safetensors file (fsynced unless ``sync`` is
    False: the caller syncs later); returns its size in bytes and its sha256 (hex).

    Example::

        >>> import tempfile, safetensors.torch
        >>> path = Path(tempfile.mkdtemp()) / "a.safetensors"
        >>> size, digest = write_file(path, {"keys": torch.arange(3)}, {"content": "demo"})
        >>> safetensors.torch.load_file(path)["keys"].tolist()
        [0, 1, 2]
    """
    header: Dict[str, object] = {"__metadata__": dict(metadata or {})}
    # widest items first: every tensor starts aligned to its own item size
    tensors = dict(sorted(tensors.items(), key=lambda kv: -kv[1].element_size()))
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _CODES:
            raise TypeError(f"{name}: dtype {tensor.dtype} has no safetensors code")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _CODES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for piece in (struct.pack("<Q", len(raw)), raw):
            f.write(piece)
            digest.update(piece)
        for tensor in tensors.values():
            data = _bytes_of(tensor)
            hashed = _hash_beside(digest, data)
            f.write(data)
            if hashed is not None:
                hashed.result()
        f.flush()
        if sync:
            os.fsync(f.fileno())
    return 8 + len(raw) + offset, digest.hexdigest()


def read_file(path: Path, size: int, sha256: str,
              buffer: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``path`` once its size is ``size`` and its
    sha256 ``sha256``: views into ``buffer`` (a uint8 tensor of at least ``size`` bytes,
    reused by the caller between files), or into a new buffer when None.

    Raises :class:`SafetensorsError` naming what is wrong, ``OSError`` if unreadable.

    Example::

        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "a.safetensors"
        >>> size, digest = write_file(path, {"rows": torch.ones(2, 3)})
        >>> read_file(path, size, digest)["rows"].shape
        torch.Size([2, 3])
    """
    if buffer is None or buffer.numel() < size:
        buffer = torch.empty(size, dtype=torch.uint8)
    data = buffer[:size]
    view = memoryview(data.numpy())
    digest, hashed = hashlib.sha256(), None
    with open(path, "rb") as f:
        got = 0
        while got < size:
            n = f.readinto(view[got:got + READ_PIECE_BYTES])
            if not n:
                break
            if hashed is not None:
                hashed.result()
            hashed = _HASHER.submit(digest.update, view[got:got + n])
            got += n
        extra = f.read(1)
    if hashed is not None:
        hashed.result()
    if got != size or extra:
        raise SafetensorsError(f"{path} is not {size} bytes long (truncated or replaced?)")
    if digest.hexdigest() != sha256:
        raise SafetensorsError(f"{path} is corrupted: its sha256 differs from the manifest's")
    return _parse(path, data)


def read_whole_file(path: Path) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """The tensors and the ``__metadata__`` of the safetensors file ``path``, for a file no
    manifest describes (its size and sha256 unknown beforehand: a file that carries its own
    checks in its metadata). Raises :class:`SafetensorsError` naming what is wrong,
    ``OSError`` if unreadable.

    Example::

        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "a.safetensors"
        >>> _ = write_file(path, {"keys": torch.arange(2)}, {"content": "demo"})
        >>> tensors, metadata = read_whole_file(path)
        >>> tensors["keys"].tolist(), metadata
        ([0, 1], {'content': 'demo'})
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = torch.empty(size, dtype=torch.uint8)
        got = f.readinto(memoryview(data.numpy())) if size else 0
    if got != size:
        raise SafetensorsError(f"{path} changed while it was read ({got} of {size} bytes)")
    metadata = _header(path, data)[1].get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
            isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError(f"{path}: its __metadata__ is not a map of strings")
    return _parse(path, data), metadata


def _header(path: Path, data: torch.Tensor) -> Tuple[int, Dict]:
    """(header bytes, header) of a safetensors file's bytes ``data``."""
    size = data.numel()
    if size < 8:
        raise SafetensorsError(f"{path} is not a safetensors file: {size} bytes")
    (n,) = struct.unpack("<Q", data[:8].numpy().tobytes())
    if n > min(MAX_HEADER_BYTES, size - 8):
        raise SafetensorsError(f"{path} is not a safetensors file: header of {n} bytes")
    try:
        header = json.loads(data[8:8 + n].numpy().tobytes())
    except ValueError as err:
        raise SafetensorsError(f"{path} is not a safetensors file: {err}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path} is not a safetensors file: the header is not a map")
    return n, header


def _parse(path: Path, data: torch.Tensor) -> Dict[str, torch.Tensor]:
    n, header = _header(path, data)
    body = data[8 + n:]
    out: Dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(v) for v in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: tensor {name!r} is described by {info!r}") from None
        numel = 1
        for d in shape:
            numel *= d
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= body.numel() or \
                end - begin != numel * itemsize:
            raise SafetensorsError(f"{path}: tensor {name!r} ({info['dtype']} {shape}) does "
                                   f"not fit bytes [{begin}, {end}) of {body.numel()}")
        raw = body[begin:end]
        if begin % itemsize:  # another writer's unaligned layout: copy to view it
            raw = raw.clone()
        out[name] = raw.view(dtype).reshape(shape)
    return out
