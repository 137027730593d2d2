"""Click-log data for a DLRM: a streaming reader of Criteo- and MovieLens-format files into
batches of (labels, dense features, ``KeyedJaggedTensor``), and a synthetic Criteo-format
file whose labels depend on its features.

Formats
-------
**Criteo** (``DataFormat.CRITEO``): one example per line, 40 tab-separated fields::

    label \\t I1 ... I13 \\t C1 ... C26

- ``label``: ``0`` or ``1``.
- ``I1..I13``: integers (``-?[0-9]+``, at most 18 digits), possibly negative, possibly empty
  (missing). The dense features are ``log(1 + max(x, 0))`` with a missing value read as 0,
  the transform of the DLRM reference: counts spread over orders of magnitude, the few
  negatives of the data clamp to 0.
- ``C1..C26``: hex strings of 1 to 16 digits (``[0-9a-fA-F]``; Criteo writes 8), possibly empty
  (missing). Each becomes one raw int64 id, :func:`hash_strings` of the string exactly as
  written: the 64-bit FNV-1a of its bytes (so ``"0a"``, ``"a"`` and ``"A"`` are three ids),
  with the two values the tables reserve (``-2**63``, ``-2**63 + 1``) moved up by 2. No
  vocabulary and no modulo: the tables are hash tables. A missing value is an empty bag.
  Features ``cat_0 .. cat_25``.

**MovieLens** (``DataFormat.MOVIELENS``): one rating per line, either the ``ratings.dat`` form
``user::item::rating::timestamp`` (ML-1M/10M) or the CSV form ``userId,movieId,rating,timestamp``
(ML-20M/25M/latest; a header line is skipped). ``label = rating >= 4``; the sparse features
``user`` and ``item`` carry the integer ids themselves (one id per bag); the two dense features
are derived from the timestamp alone (the rating would leak the label): the UTC hour of day
/ 23 and the UTC day of week / 6 (Monday 0), both in [0, 1].

Reading
-------
:class:`BatchReader` streams a file in chunks of lines (one chunk in memory at a time, parsed
with numpy column by column; a ``.gz`` file through gzip), so files larger than memory are
fine (about 50,000 Criteo lines a second on a 2-core VM). The held-out split is a
fixed function of the 1-based line number: line ``n`` is held out when
``splitmix64(n) mod 2**24 < eval_fraction * 2**24`` (:func:`held_out_mask`), so the split does not
depend on the chunk or batch size, and the same lines are held out on every run and machine.

Malformed lines (a wrong field count, a dense value that is not an integer, a categorical
value that is not hex, a label that is not 0/1; for MovieLens, ids or a timestamp that are not
integers, a rating that is not a finite number) raise :class:`MalformedLineError` naming the
file and line; with ``skip_malformed=True`` they are skipped and counted
(``reader.skipped_lines``, the first few kept in ``reader.skipped_examples`` with their
reasons, and a warning logged at the end of the pass). A row is never read half-valid. A pass
parses only the lines of its split, so it reports only the malformed lines of that split.

Example::

    from dlrm_data import BatchReader, write_synthetic_criteo     # examples/ on sys.path

    summary = write_synthetic_criteo("train.tsv", rows=100_000, seed=0)
    print(summary.bayes_auc)            # the best AUC any model can reach on this file
    for batch in BatchReader("train.tsv", batch_size=512, split="train"):
        batch.labels   # [B] float32
        batch.dense    # [B, 13] float32
        batch.sparse   # KeyedJaggedTensor, keys cat_0..cat_25, int64 values

Synthetic data
--------------
:func:`write_synthetic_criteo` writes exactly the Criteo format: each categorical feature has
its own id space (3 to 50 million values; 32-bit ids written as 8 hex digits for most
features, 64-bit ids as 16 for a few) with Zipf popularity and some missing values; the dense
features are log-normal counts (one may be negative), some missing. A label is drawn from
``sigmoid(bias + sum_k w_k * effect_k(value_k) + w_d * (t_0 - c))``: hidden per-value effects
of four categorical features and the transformed first dense feature. The summary returns the
Bayes-optimal AUC (the AUC of those true probabilities on the file's labels, torchmetrics):
about 0.845 with the default settings (0.8455 on 300,000 rows, seed 0; 27% positive), what a
model can approach but, by construction, not beat. Popular values are seen often enough to
learn their effects; the tail is not: on that file a plain logistic regression over the ids
(one weight per feature and id, ids folded into 2**20 buckets a feature) and the dense
features, one pass of (sparse) Adam over the training split, reaches 0.789 AUC on the
held-out split.

From the command line::

    python examples/dlrm_data.py synthetic.tsv --rows 1000000      # write a synthetic file
    python examples/dlrm_data.py day_0.gz --read                    # count a file's rows
"""
from __future__ import annotations

import enum
import gzip
import itertools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

log = logging.getLogger(__name__)

CRITEO_DENSE = 13
CRITEO_CATEGORICAL = 26
CRITEO_SPARSE_NAMES: Tuple[str, ...] = tuple(f"cat_{i}" for i in range(CRITEO_CATEGORICAL))
MOVIELENS_SPARSE_NAMES: Tuple[str, ...] = ("user", "item")
MOVIELENS_DENSE = 2

#: Ids the hash never returns (dynemb's tables reserve them for empty and erased slots).
RESERVED_IDS = (-(2 ** 63), -(2 ** 63) + 1)

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)
_MAX_HEX_DIGITS = 16
_MAX_INT_DIGITS = 18           # any such integer fits in int64
_EXAMPLES_KEPT = 20            # skipped lines whose reasons are kept for the report
_SPLIT_BITS = 24

PathLike = Union[str, os.PathLike]


class DataFormat(str, enum.Enum):
    CRITEO = "criteo"
    MOVIELENS = "movielens"


class MalformedLineError(ValueError):
    """A line of a data file that does not parse; ``path``, ``line`` (1-based) and ``reason``."""

    def __init__(self, path: PathLike, line: int, reason: str):
        super().__init__(f"{path}:{line}: malformed line: {reason}")
        self.path, self.line, self.reason = str(path), line, reason


# -- hashing ---------------------------------------------------------------------------------
def _avoid_reserved(ids: np.ndarray) -> np.ndarray:
    """Map the two reserved int64 values to the two just above them (``-2**63 + 2`` and
    ``-2**63 + 3``), in place; ``ids`` is int64."""
    low = ids <= RESERVED_IDS[1]
    ids[low] += 2
    return ids


def hash_strings(strings: np.ndarray) -> np.ndarray:
    """Raw int64 ids of byte strings: 64-bit FNV-1a of the bytes as written, read as two's
    complement int64, with the reserved values ``-2**63`` and ``-2**63 + 1`` moved to
    ``-2**63 + 2`` and ``-2**63 + 3``. Fixed (not Python's salted ``hash``), the same on every
    run and machine, vectorised over the strings (a loop over the at most 16 byte positions).

    Args:
        strings: numpy ``bytes_`` array (``S`` dtype) of any shape; no value may contain a NUL
            byte (numpy strips trailing NULs).
    Returns:
        int64 array of the same shape.

    Example::

        >>> int(hash_strings(np.array([b"68fd1e64"]))[0])
        1938573664431018461
    """
    strings = np.ascontiguousarray(strings)
    if strings.dtype.kind != "S":
        raise ValueError(f"hash_strings wants a bytes (S) array, got {strings.dtype}")
    flat = strings.reshape(-1)
    width = strings.dtype.itemsize
    digits = flat.view(np.uint8).reshape(flat.size, width).astype(np.uint64)
    lengths = np.char.str_len(flat)
    h = np.full(flat.size, _FNV_OFFSET, dtype=np.uint64)
    for j in range(width):
        mixed = (h ^ digits[:, j]) * _FNV_PRIME
        h = np.where(j < lengths, mixed, h)
    return _avoid_reserved(h.view(np.int64)).reshape(strings.shape)


def hash_string(value: str) -> int:
    """:func:`hash_strings` of one ASCII string."""
    return int(hash_strings(np.array([value.encode("ascii")]))[0])


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser of uint64 values (a bijection with full avalanche)."""
    z = np.asarray(x, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def held_out_mask(line_numbers: np.ndarray, eval_fraction: float) -> np.ndarray:
    """Whether each 1-based line number belongs to the held-out split:
    ``splitmix64(n) mod 2**24 < eval_fraction * 2**24``."""
    mask = np.uint64((1 << _SPLIT_BITS) - 1)
    buckets = splitmix64(np.asarray(line_numbers, dtype=np.uint64)) & mask
    return buckets < np.uint64(round(eval_fraction * (1 << _SPLIT_BITS)))


# -- batches ---------------------------------------------------------------------------------
@dataclass
class Batch(Pipelineable):
    """One batch: ``labels [B] float32``, ``dense [B, D] float32`` and ``sparse``, a
    ``KeyedJaggedTensor`` of int64 ids (one id per present value, an empty bag for a missing
    one) and int32 lengths, keyed by the format's feature names."""

    labels: torch.Tensor
    dense: torch.Tensor
    sparse: KeyedJaggedTensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        return Batch(self.labels.to(device=device, non_blocking=non_blocking),
                     self.dense.to(device=device, non_blocking=non_blocking),
                     self.sparse.to(device=device, non_blocking=non_blocking))

    def record_stream(self, stream) -> None:
        self.labels.record_stream(stream)
        self.dense.record_stream(stream)
        self.sparse.record_stream(stream)

    def pin_memory(self) -> "Batch":
        return Batch(self.labels.pin_memory(), self.dense.pin_memory(), self.sparse.pin_memory())


class _Rows(NamedTuple):
    """Parsed rows of one chunk: ``labels [N]``, ``dense [N, D]`` float32, ``ids [N, F]`` int64
    and ``present [N, F]`` bool (a missing value has ``present`` False)."""

    labels: np.ndarray
    dense: np.ndarray
    ids: np.ndarray
    present: np.ndarray

    def select(self, index) -> "_Rows":
        return _Rows(*(a[index] for a in self))

    @staticmethod
    def concat(parts: Sequence["_Rows"]) -> "_Rows":
        return _Rows(*(np.concatenate(arrays) for arrays in zip(*parts)))


def _to_batch(rows: _Rows, names: Sequence[str]) -> Batch:
    present = rows.present.T                                    # [F, B]: KJT order is feature-major
    values = rows.ids.T[present]
    lengths = present.reshape(-1).astype(np.int32)
    sparse = KeyedJaggedTensor(keys=list(names),
                               values=torch.from_numpy(np.ascontiguousarray(values)),
                               lengths=torch.from_numpy(lengths))
    return Batch(torch.from_numpy(rows.labels.astype(np.float32)),
                 torch.from_numpy(np.ascontiguousarray(rows.dense, dtype=np.float32)), sparse)


# -- column parsing --------------------------------------------------------------------------
def _show(value) -> str:
    """A field of a line as the error message quotes it."""
    return repr(bytes(value).decode("utf-8", errors="replace"))


def _byte_table(chars: bytes) -> np.ndarray:
    table = np.zeros(256, dtype=bool)
    table[np.frombuffer(chars, dtype=np.uint8)] = True
    return table


_HEX = _byte_table(b"0123456789abcdefABCDEF")
_DIGIT = _byte_table(b"0123456789")


def _bytes_matrix(values: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """``values [...]`` of S dtype -> its bytes ``[..., W]`` uint8 and lengths ``[...]``."""
    width = values.dtype.itemsize
    values = np.ascontiguousarray(values)
    return values.view(np.uint8).reshape(*values.shape, width), np.char.str_len(values)


def _parse_ints(values: np.ndarray, allow_empty: bool) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Integers ``-?[0-9]{1,18}`` of an S array. Returns (int64 values, 0 where empty or bad;
    present mask; bad mask)."""
    digits, lengths = _bytes_matrix(values)
    position = np.arange(digits.shape[-1])
    signed = digits[..., 0] == ord("-")
    first_digit = signed[..., None] & (position == 0)
    inside = position < lengths[..., None]
    ok_bytes = np.where(inside & ~first_digit, _DIGIT[digits], True).all(axis=-1)
    n_digits = lengths - signed
    present = lengths > 0
    bad = present & (~ok_bytes | (n_digits < 1) | (n_digits > _MAX_INT_DIGITS))
    if not allow_empty:
        bad |= ~present
    good = present & ~bad
    parsed = np.zeros(values.shape, dtype=np.int64)
    parsed[good] = values[good].astype(np.int64)
    return parsed, good, bad


def _parse_hex(values: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hex strings of 1..16 digits of an S array. Returns (hashed ids, present mask, bad mask)."""
    digits, lengths = _bytes_matrix(values)
    inside = np.arange(digits.shape[-1]) < lengths[..., None]
    ok = np.where(inside, _HEX[digits], digits == 0).all(axis=-1)   # a NUL inside is bad too
    present = lengths > 0
    bad = present & (~ok | (lengths > _MAX_HEX_DIGITS))
    good = present & ~bad
    ids = np.zeros(values.shape, dtype=np.int64)
    ids[good] = hash_strings(values[good])
    return ids, good, bad


def _parse_floats(values: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Finite floats of an S array. Returns (float64 values, bad mask)."""
    try:
        parsed = values.astype(np.float64)
    except ValueError:                          # find the culprits; only on the error path
        parsed = np.zeros(values.shape)
        for i, v in enumerate(values):
            try:
                parsed[i] = float(v)
            except ValueError:
                parsed[i] = np.nan
    bad = ~np.isfinite(parsed) | (np.char.str_len(values) == 0)
    return np.where(bad, 0.0, parsed), bad


def _fields(lines: List[bytes], separator: bytes, count: int) -> Tuple[np.ndarray, np.ndarray]:
    """Split lines into an S matrix ``[n_good, count]`` and the mask of lines with ``count``
    fields."""
    split = [line.rstrip(b"\r\n").split(separator) for line in lines]
    good = np.fromiter((len(f) == count for f in split), dtype=bool, count=len(split))
    kept = [f for f, g in zip(split, good) if g]
    matrix = np.array(kept, dtype=bytes) if kept else np.zeros((0, count), dtype="S1")
    return matrix.reshape(len(kept), count), good


class _Problems:
    """Why each line of a chunk is malformed (the first reason found wins). ``where[r]`` is the
    line of field row ``r`` (the lines with the right field count)."""

    def __init__(self, n_lines: int):
        self.reasons: List[Optional[str]] = [None] * n_lines
        self.where = np.arange(n_lines)

    def add_lines(self, bad_lines: np.ndarray, reason: str) -> None:
        for i in np.flatnonzero(bad_lines):
            self.reasons[i] = self.reasons[i] or reason

    def add_rows(self, bad_rows: np.ndarray, reason: Callable[[int], str]) -> None:
        """``bad_rows [R]`` over field rows; ``reason(r)`` says what is wrong with row ``r``."""
        for r in np.flatnonzero(bad_rows):
            i = self.where[r]
            self.reasons[i] = self.reasons[i] or reason(r)

    @property
    def bad(self) -> np.ndarray:
        return np.array([r is not None for r in self.reasons], dtype=bool)


def _first_bad_column(bad: np.ndarray, fields: np.ndarray, columns: Sequence[int],
                      names: Sequence[str], what: str) -> Callable[[int], str]:
    """A ``reason(r)`` naming row ``r``'s first bad column (``bad [R, C]`` over ``columns``)."""
    def reason(r: int) -> str:
        j = int(np.argmax(bad[r]))
        return f"{names[j]} = {_show(fields[r, columns[j]])} is not {what}"
    return reason


def _parse_criteo(lines: List[bytes], problems: _Problems) -> Tuple[_Rows, np.ndarray]:
    """The rows of the well-formed lines, and the mask of the lines with 40 fields."""
    fields, shaped = _fields(lines, b"\t", 1 + CRITEO_DENSE + CRITEO_CATEGORICAL)
    problems.add_lines(~shaped, f"expected {1 + CRITEO_DENSE + CRITEO_CATEGORICAL} "
                                "tab-separated fields")
    problems.where = np.flatnonzero(shaped)

    label_text = fields[:, 0]
    problems.add_rows((label_text != b"0") & (label_text != b"1"),
                      lambda r: f"label {_show(label_text[r])} is not 0 or 1")
    dense_columns = range(1, 1 + CRITEO_DENSE)
    dense, _, bad_dense = _parse_ints(fields[:, dense_columns], allow_empty=True)
    problems.add_rows(bad_dense.any(axis=1), _first_bad_column(
        bad_dense, fields, dense_columns, [f"I{j + 1}" for j in range(CRITEO_DENSE)],
        "a valid integer"))
    cat_columns = range(1 + CRITEO_DENSE, 1 + CRITEO_DENSE + CRITEO_CATEGORICAL)
    ids, present, bad_cat = _parse_hex(fields[:, cat_columns])
    problems.add_rows(bad_cat.any(axis=1), _first_bad_column(
        bad_cat, fields, cat_columns, [f"C{j + 1}" for j in range(CRITEO_CATEGORICAL)],
        "a valid hex string of at most 16 digits"))

    transformed = np.log1p(np.maximum(dense, 0).astype(np.float64)).astype(np.float32)
    rows = _Rows(labels=(label_text == b"1").astype(np.float32), dense=transformed, ids=ids,
                 present=present)
    return rows, shaped


def _parse_movielens(lines: List[bytes], problems: _Problems,
                     separator: bytes) -> Tuple[_Rows, np.ndarray]:
    """As :func:`_parse_criteo`, for ``user, item, rating, timestamp`` lines."""
    fields, shaped = _fields(lines, separator, 4)
    problems.add_lines(~shaped, f"expected 4 fields separated by {separator.decode()!r}")
    problems.where = np.flatnonzero(shaped)
    int_columns = [0, 1, 3]
    ints, _, bad_int = _parse_ints(fields[:, int_columns], allow_empty=False)
    problems.add_rows(bad_int.any(axis=1), _first_bad_column(
        bad_int, fields, int_columns, ["user", "item", "timestamp"], "an integer"))
    rating, bad_rating = _parse_floats(fields[:, 2])
    problems.add_rows(bad_rating, lambda r: f"rating {_show(fields[r, 2])} is not a number")

    seconds = ints[:, 2]
    hour = (seconds // 3600) % 24
    weekday = (seconds // 86400 + 3) % 7          # 1970-01-01 was a Thursday (Monday = 0)
    dense = np.stack([hour / 23.0, weekday / 6.0], axis=1).astype(np.float32)
    rows = _Rows(labels=(rating >= 4).astype(np.float32), dense=dense, ids=ints[:, :2],
                 present=np.ones((len(ints), 2), dtype=bool))
    return rows, shaped


# -- the reader ------------------------------------------------------------------------------
def _open(path: Path) -> BinaryIO:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


class BatchReader:
    """Batches of a Criteo- or MovieLens-format file (see the module docstring), streamed.

    Args:
        path: the file (``.gz`` is read through gzip).
        batch_size: rows per batch; the last batch of a pass is smaller unless ``drop_last``.
        format: ``"criteo"`` or ``"movielens"``.
        split: ``"train"`` (lines not held out), ``"eval"`` (held out) or ``"all"``.
        eval_fraction: the share of lines held out (:func:`held_out_mask`).
        skip_malformed: skip and count malformed lines instead of raising
            :class:`MalformedLineError`.
        chunk_lines: lines read and parsed at a time (memory is about this many lines).
        progress: a tqdm bar over the file's bytes.
        drop_last: drop a last batch smaller than ``batch_size``.
        rank, world_size: this reader yields batches ``rank, rank + world_size, ...`` of the
            split (every rank of a data-parallel job reads its own share of the same file).

    Each iteration is one pass over the file. After a pass, ``rows`` is the number of rows
    yielded, ``skipped_lines`` the number of malformed lines skipped (all ranks count them),
    and ``skipped_examples`` the first few ``(line, reason)``.
    """

    def __init__(self, path: PathLike, batch_size: int, format: Union[str, DataFormat] = "criteo",
                 split: str = "train", eval_fraction: float = 0.1, skip_malformed: bool = False,
                 chunk_lines: int = 1 << 16, progress: bool = False, drop_last: bool = False,
                 rank: int = 0, world_size: int = 1):
        if batch_size < 1 or chunk_lines < 1:
            raise ValueError(f"batch_size and chunk_lines must be >= 1, got {batch_size}, "
                             f"{chunk_lines}")
        if split not in ("train", "eval", "all"):
            raise ValueError(f"split must be 'train', 'eval' or 'all', got {split!r}")
        if not 0.0 <= eval_fraction <= 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(self.path)
        self.format = DataFormat(format)
        self.batch_size, self.split, self.eval_fraction = batch_size, split, eval_fraction
        self.skip_malformed, self.chunk_lines = skip_malformed, chunk_lines
        self.progress, self.drop_last = progress, drop_last
        self.rank, self.world_size = rank, world_size
        self.rows = 0
        self.skipped_lines = 0
        self.skipped_examples: List[Tuple[int, str]] = []

    @property
    def feature_names(self) -> Tuple[str, ...]:
        return CRITEO_SPARSE_NAMES if self.format == DataFormat.CRITEO else MOVIELENS_SPARSE_NAMES

    @property
    def dense_features(self) -> int:
        return CRITEO_DENSE if self.format == DataFormat.CRITEO else MOVIELENS_DENSE

    def __iter__(self) -> Iterator[Batch]:
        self.rows, self.skipped_lines, self.skipped_examples = 0, 0, []
        pending: List[_Rows] = []
        pending_rows = 0
        batch_index = 0
        for rows in self._chunks():
            pending.append(rows)
            pending_rows += len(rows.labels)
            if pending_rows < self.batch_size:
                continue
            merged = _Rows.concat(pending)
            full = pending_rows - pending_rows % self.batch_size
            for start in range(0, full, self.batch_size):
                if batch_index % self.world_size == self.rank:
                    self.rows += self.batch_size
                    yield _to_batch(merged.select(slice(start, start + self.batch_size)),
                                    self.feature_names)
                batch_index += 1
            rest = merged.select(slice(full, None))
            pending, pending_rows = [rest], len(rest.labels)
        if pending_rows and not self.drop_last and batch_index % self.world_size == self.rank:
            self.rows += pending_rows
            yield _to_batch(_Rows.concat(pending), self.feature_names)
        if self.skipped_lines:
            log.warning("%s: skipped %d malformed lines (first: %s)", self.path,
                        self.skipped_lines, self.skipped_examples[:3])

    def _chunks(self) -> Iterator[_Rows]:
        """The well-formed rows of the split, chunk by chunk."""
        separator = b"\t"
        bar = None
        if self.progress:
            from tqdm import tqdm
            bar = tqdm(total=self.path.stat().st_size if self.path.suffix != ".gz" else None,
                       unit="B", unit_scale=True, desc=self.path.name)
        first_line = 1
        with _open(self.path) as f:
            while True:
                lines = list(itertools.islice(f, self.chunk_lines))
                if not lines:
                    break
                if bar is not None:
                    bar.update(sum(map(len, lines)))
                numbers = np.arange(first_line, first_line + len(lines), dtype=np.int64)
                first_line += len(lines)
                if self.format == DataFormat.MOVIELENS and numbers[0] == 1:
                    separator = b"::" if b"::" in lines[0] else b","     # the file's form
                    if lines[0][:1].isalpha():
                        lines, numbers = lines[1:], numbers[1:]        # the CSV header
                if self.split != "all":
                    keep = held_out_mask(numbers, self.eval_fraction)
                    if self.split == "train":
                        keep = ~keep
                    lines = [line for line, k in zip(lines, keep) if k]
                    numbers = numbers[keep]
                if not lines:
                    continue
                problems = _Problems(len(lines))
                if self.format == DataFormat.CRITEO:
                    rows, shaped = _parse_criteo(lines, problems)
                else:
                    rows, shaped = _parse_movielens(lines, problems, separator)
                bad = problems.bad
                if bad.any():
                    if not self.skip_malformed:
                        i = int(np.argmax(bad))
                        raise MalformedLineError(self.path, int(numbers[i]), problems.reasons[i])
                    for i in np.flatnonzero(bad)[:_EXAMPLES_KEPT - len(self.skipped_examples)]:
                        self.skipped_examples.append((int(numbers[i]), problems.reasons[i]))
                    self.skipped_lines += int(bad.sum())
                    rows = rows.select(~bad[shaped])
                yield rows
        if bar is not None:
            bar.close()


# -- synthetic Criteo-format data --------------------------------------------------------------
#: Distinct values of each categorical feature (their ids are Zipf-popular ranks, hashed).
_SYNTHETIC_VOCAB = (1_000, 500, 2_000_000, 50_000_000, 300, 20, 10_000, 600, 3, 80_000, 5_000,
                    3_000_000, 3_000, 25, 10_000, 5_000_000, 10, 5_000, 2_000, 4, 7_000_000, 18,
                    15, 300_000, 100, 50_000)
#: Features whose ids are 64-bit (16 hex digits); the others are 32-bit (8 hex digits).
_SYNTHETIC_WIDE = (2, 11, 20)
_SYNTHETIC_CAT_MISSING = (0.0, 0.0, 0.03, 0.03, 0.0, 0.1, 0.0, 0.0, 0.0, 0.03, 0.0, 0.03, 0.0,
                          0.0, 0.0, 0.03, 0.0, 0.0, 0.45, 0.45, 0.03, 0.0, 0.75, 0.03, 0.45, 0.03)
_SYNTHETIC_DENSE_MISSING = (0.45, 0.0, 0.2, 0.2, 0.03, 0.2, 0.04, 0.0, 0.04, 0.45, 0.04, 0.75, 0.2)
_SYNTHETIC_DENSE_MU = (0.5, 1.5, 1.0, 1.5, 3.0, 7.0, 2.0, 2.0, 3.5, 0.3, 0.5, 0.2, 1.0)
#: Categorical features with hidden per-value effects on the label, and their weights.
_SYNTHETIC_EFFECTS = {0: 1.0, 2: 0.8, 6: 0.8, 9: 0.6}
_SYNTHETIC_DENSE_WEIGHT = 0.6            # on log1p(max(I1, 0)) - 0.5
_SYNTHETIC_BIAS = -1.6
_SYNTHETIC_ZIPF = 1.15
_SYNTHETIC_CHUNK = 1 << 16
_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


@dataclass(frozen=True)
class SyntheticSummary:
    """What :func:`write_synthetic_criteo` wrote: ``rows``, the share of positive labels and
    the Bayes-optimal AUC and log loss (those of the true label probabilities)."""

    path: str
    rows: int
    positive_rate: float
    bayes_auc: float
    bayes_log_loss: float


def _hex(values: np.ndarray, digits: int) -> np.ndarray:
    """uint64 ``values [N]`` -> lowercase hex ``S{digits}`` strings of their low bits."""
    shifts = np.arange(digits - 1, -1, -1, dtype=np.uint64) * np.uint64(4)
    nibbles = (values[:, None] >> shifts) & np.uint64(0xF)
    return np.ascontiguousarray(_HEX_DIGITS[nibbles]).view(f"S{digits}").reshape(-1)


def _effect(values: np.ndarray, feature: int, seed: int) -> np.ndarray:
    """The hidden effect of each written id value: uniform on [-sqrt 3, sqrt 3] (unit
    variance), a fixed function of the value, the feature and the seed."""
    salt = np.uint64((seed * 1_000_003 + feature * 7_919 + 17) % (1 << 64))
    u = (splitmix64(values ^ salt) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return (2.0 * u - 1.0) * np.sqrt(3.0)


def _synthetic_chunk(rows: int, seed: int, chunk: int) -> Tuple[List[np.ndarray], np.ndarray]:
    """One chunk's columns as S arrays (label, I1..I13, C1..C26) and its true probabilities."""
    rng = np.random.default_rng([seed, chunk])
    columns: List[np.ndarray] = []
    logit = np.full(rows, _SYNTHETIC_BIAS)
    transformed_first = None
    for j in range(CRITEO_DENSE):
        x = np.floor(rng.lognormal(_SYNTHETIC_DENSE_MU[j] * 0.5, 1.2, rows)).astype(np.int64)
        if j == 1:
            x -= 3                                 # like Criteo's I2, a few negatives
        missing = rng.random(rows) < _SYNTHETIC_DENSE_MISSING[j]
        if j == 0:
            transformed_first = np.log1p(np.maximum(np.where(missing, 0, x), 0))
        columns.append(np.where(missing, b"", x.astype("S20")))
    logit += _SYNTHETIC_DENSE_WEIGHT * (transformed_first - 0.5)
    for f in range(CRITEO_CATEGORICAL):
        ranks = (rng.zipf(_SYNTHETIC_ZIPF, rows) - 1) % _SYNTHETIC_VOCAB[f]
        digits = 16 if f in _SYNTHETIC_WIDE else 8
        values = splitmix64(ranks.astype(np.uint64) ^ np.uint64(((seed << 8) + f) % (1 << 64)))
        if digits == 8:
            values &= np.uint64(0xFFFFFFFF)
        missing = rng.random(rows) < _SYNTHETIC_CAT_MISSING[f]
        if f in _SYNTHETIC_EFFECTS:
            logit += np.where(missing, 0.0, _SYNTHETIC_EFFECTS[f] * _effect(values, f, seed))
        columns.append(np.where(missing, b"", _hex(values, digits)))
    probability = 1.0 / (1.0 + np.exp(-logit))
    labels = rng.random(rows) < probability
    columns.insert(0, np.where(labels, b"1", b"0"))
    return columns, probability


def write_synthetic_criteo(path: PathLike, rows: int, seed: int = 0,
                           progress: bool = False) -> SyntheticSummary:
    """Write ``rows`` lines of synthetic Criteo-format data to ``path`` (see the module
    docstring for the distribution); the same ``(rows, seed)`` writes the same bytes on every
    machine. Memory is one chunk of lines plus about 20 bytes a row for the Bayes AUC."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    from torchmetrics.functional.classification import binary_auroc

    probabilities, labels = [], []
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=rows, unit="rows", desc=f"writing {Path(path).name}")
    with open(path, "wb") as f:
        for chunk, start in enumerate(range(0, rows, _SYNTHETIC_CHUNK)):
            n = min(_SYNTHETIC_CHUNK, rows - start)
            columns, probability = _synthetic_chunk(n, seed, chunk)
            lines = zip(*(c.tolist() for c in columns))
            f.write(b"".join(b"\t".join(line) + b"\n" for line in lines))
            probabilities.append(probability.astype(np.float32))
            labels.append(columns[0] == b"1")
            if bar is not None:
                bar.update(n)
    if bar is not None:
        bar.close()
    p = torch.from_numpy(np.concatenate(probabilities)).double()
    y = torch.from_numpy(np.concatenate(labels))
    auc = float(binary_auroc(p, y.long())) if 0 < int(y.sum()) < rows else float("nan")
    log_loss = float(torch.nn.functional.binary_cross_entropy(p, y.double()))
    return SyntheticSummary(str(path), rows, float(y.double().mean()), auc, log_loss)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python examples/dlrm_data.py synthetic.tsv --rows 1000000`` writes a synthetic file;
    ``--read`` reads a file instead and prints its counts."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("path")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--read", action="store_true")
    parser.add_argument("--format", default="criteo", choices=[f.value for f in DataFormat])
    parser.add_argument("--skip-malformed", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if not args.read:
        print(write_synthetic_criteo(args.path, args.rows, args.seed, progress=True))
        return
    for split in ("train", "eval"):
        reader = BatchReader(args.path, batch_size=4096, format=args.format, split=split,
                             skip_malformed=args.skip_malformed, progress=True)
        positives = sum(float(b.labels.sum()) for b in reader)
        print(f"{split}: {reader.rows} rows, {positives / max(reader.rows, 1):.3f} positive, "
              f"{reader.skipped_lines} malformed lines skipped")


if __name__ == "__main__":
    main()
