"""One table's checkpoint: what is saved, how it is checked, how it is put back.

A table's state is a set of named tensors (see :func:`capture`):

- ``signature``: int64 codes of what must match to load (dim, row width, dtype, optimizer,
  score policy; the storage mode too for checkpoint files, which load slot for slot: a
  state dict of another mode loads by key, see :func:`restore`), then the table's sharding
  scheme (where its keys sit on a sharded module; it need not match:
  see :func:`saved_scheme`);
- ``state``: the optimizer's step, then the table's counters (:data:`COUNTER_NAMES`);
- ``format``: the version of the layout of what follows (:data:`STATE_FORMAT`; see
  :func:`check_format`);
- per tier (``device``; ``host``: the DEFAULT host tier or the CACHE backing store;
  ``admission``: the admission counter), ``layout`` = (capacity, bucket size, clock, live
  entries, tombstones) and the tier's **live entries** only: ``keys``, ``scores``, ``slots``
  (where each sat) and ``rows`` (embedding plus optimizer state, the table's physical row;
  not for ``admission``), one per live entry, and ``tombstones``, the erased slots (lookups
  probe past them, so an exact image keeps them). A checkpoint's size follows the rows a
  table holds, not its capacity. These are host copies (see :func:`live_entries`), which
  DCP saves as byte items (:class:`~dynemb.checkpoint.dcp_bytes.SavedAsBytes`: its default
  planner then loads them whatever the module holds); a backing
  store that is not a :class:`~dynemb.stores.backing_store.HostBackingStore` is saved from
  its ``export`` (capacity -1, no slots).

Putting it back (:func:`restore`):

- **exactly**, slot for slot, when one full image of the same layout is given (same rank
  and world size; every entry of every tier, see :attr:`SavedTier.full_image`): every key in
  its saved slot with its score, the clock as saved. Training
  then continues bit for bit as if never stopped, evictions included;
- **by key** otherwise (other world size, other capacity, parts of several images, or
  another storage mode: a per-rank budget may make a table HBM_DIRECT on 2 ranks and CACHE
  on 1): every live entry is inserted with its saved score, never evicting (a key that
  finds no slot is an error naming the table, nothing is lost silently), where the table's
  mode keeps rows (see
  :meth:`~dynemb.tables.checkpoint_tiers.CheckpointTiers.insert_saved_entries`), whichever
  mode wrote them.

Which tiers a table has and where each keeps its keys and rows is the table's to say
(:meth:`~dynemb.tables.checkpoint_tiers.CheckpointTiers.checkpoint_tiers`, overridden per
storage mode in :mod:`dynemb.tables`): nothing here depends on the mode.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from dynemb.checkpoint.dcp_bytes import SavedAsBytes
from dynemb.checkpoint.image_checks import (check_distinct, check_live_keys, check_slot_image,
                                            is_bucketed_layout)
from dynemb.foundations.counters import COUNTER_NAMES
from dynemb.rows.optimizers import OptimizerType
from dynemb.options import ShardingScheme, StorageMode
from dynemb.tables import DynamicTable
from dynemb.tables.checkpoint_tiers import TIER_NAMES
from dynemb.tables.policies import storage_policy
from dynemb.types import EMPTY_KEY, TOMBSTONE_KEY, ScorePolicy

#: The version of the signature's codes (its first field; checkpoint files record it too).
SIGNATURE_VERSION = 1
#: The layout of a table's saved tensors, saved as ``format``: bumped when it changes.
STATE_FORMAT = 2
#: What each layout saved, for the message that refuses one.
STATE_FORMATS = {
    1: "every slot of each tier's capacity, empty ones too, and no 'format' entry",
    2: "each tier's live entries with their slots"}
TIERS = TIER_NAMES
ROW_FIELDS = ("keys", "scores", "rows")
#: The per-entry tensors of a tier (``tombstones`` has one per erased slot).
ENTRY_FIELDS = ("keys", "scores", "slots", "rows", "tombstones")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_OPTIMIZERS = tuple(OptimizerType)
_MODES = tuple(StorageMode)
_SCHEMES = tuple(ShardingScheme)
#: The fields that must match, then the sharding scheme (see :func:`saved_scheme`).
_SIGNATURE_FIELDS = ("format version", "dim", "row width", "optimizer state width", "dtype",
                     "optimizer", "storage mode", "score policy")
#: Where the sharding scheme's code sits in a signature; those of checkpoint files dumped
#: before it was recorded end just before it.
SCHEME_FIELD = len(_SIGNATURE_FIELDS)
_MODE_FIELD = _SIGNATURE_FIELDS.index("storage mode")
#: Entries inserted per step when loading by key (bounds the temporaries).
LOAD_CHUNK_ROWS = 1 << 20


# -- what is saved --------------------------------------------------------------------------
def signature(table: DynamicTable) -> torch.Tensor:
    """int64 codes of what a checkpoint of ``table`` must share with the table it loads into
    (see :func:`describe_mismatch`)."""
    return torch.tensor([SIGNATURE_VERSION, table.dim, table.width, table.state_dim,
                         _DTYPES.index(table.layout.dtype),
                         _OPTIMIZERS.index(table.optimizer.type), _MODES.index(table.mode),
                         table.options.score_strategy.code,
                         _SCHEMES.index(table.options.sharding)], dtype=torch.int64)


def saved_scheme(saved: torch.Tensor) -> Optional[ShardingScheme]:
    """The sharding scheme that placed the keys of a checkpoint of signature ``saved``, None
    for checkpoint files dumped before signatures recorded it.

    The scheme is not part of what must match: a sharded module whose own scheme differs
    sends every saved key to its owner (as it does for another world size), and an
    unsharded one holds every key whatever the scheme."""
    if saved.numel() <= SCHEME_FIELD:
        return None
    code = int(saved[SCHEME_FIELD])
    if not 0 <= code < len(_SCHEMES):
        raise ValueError(f"sharding scheme code {code} in the checkpoint is none of "
                         f"{[s.name for s in _SCHEMES]}")
    return _SCHEMES[code]


def saved_mode(saved: torch.Tensor) -> Optional[StorageMode]:
    """The storage mode of the table that wrote a checkpoint of signature ``saved`` (None
    for a code this version does not know)."""
    code = int(saved[_MODE_FIELD]) if saved.numel() > _MODE_FIELD else -1
    return _MODES[code] if 0 <= code < len(_MODES) else None


def describe_mismatch(table: DynamicTable, saved: torch.Tensor, *,
                      mode_may_differ: bool = False) -> Optional[str]:
    """None if a checkpoint of signature ``saved`` loads into ``table``, else what differs,
    in words (the sharding scheme may differ, see :func:`saved_scheme`; the storage mode
    too where ``mode_may_differ``: a load by key puts every row where the table's mode
    keeps it, see :func:`restore`)."""
    mine = signature(table).tolist()[:SCHEME_FIELD]
    saved = [int(v) for v in saved.tolist()]
    if not saved or saved[0] != SIGNATURE_VERSION:
        return f"checkpoint format {saved[:1]} is not {SIGNATURE_VERSION}"
    if len(saved) not in (SCHEME_FIELD, SCHEME_FIELD + 1):
        return (f"a signature of {len(saved)} fields ({SCHEME_FIELD + 1} expected, "
                f"{SCHEME_FIELD} before it recorded the sharding scheme)")
    if len(saved) > SCHEME_FIELD and not 0 <= saved[SCHEME_FIELD] < len(_SCHEMES):
        return (f"sharding scheme code {saved[SCHEME_FIELD]} is none of "
                f"{[s.name for s in _SCHEMES]}")
    saved = saved[:SCHEME_FIELD]
    if mode_may_differ and 0 <= saved[_MODE_FIELD] < len(_MODES):
        saved[_MODE_FIELD] = mine[_MODE_FIELD]
    diffs = []
    for i, (s, m) in enumerate(zip(saved, mine)):
        if s != m:
            diffs.append(f"{_SIGNATURE_FIELDS[i]} {_code_name(i, s)} in the checkpoint, "
                         f"{_code_name(i, m)} here")
    return "; ".join(diffs) or None


_CODE_NAMES = {4: dict(enumerate(_DTYPES)), 5: {i: o.value for i, o in enumerate(_OPTIMIZERS)},
               6: {i: m.value for i, m in enumerate(_MODES)},
               7: {p.code: p.name for p in ScorePolicy}}


def _code_name(field: int, code: int):
    """What signature field ``field``'s code stands for (the code itself if unknown)."""
    return _CODE_NAMES.get(field, {}).get(code, code)


def capture(table: DynamicTable, step: int) -> Dict[str, torch.Tensor]:
    """The tensors of ``table``'s checkpoint by relative name (see the module docstring):
    host copies of its live entries, sized by the rows it holds."""
    out = {"signature": signature(table),
           "format": torch.tensor([STATE_FORMAT]),
           "state": torch.tensor([step, *table.counters.snapshot().values()],
                                 dtype=torch.int64)}
    for name, part in table.checkpoint_tiers().items():
        if part.hash is not None:
            keys, scores = part.hash.image()
            entries = live_entries(keys, scores, part.rows)
            out[f"{name}.layout"] = torch.tensor(
                [part.hash.capacity, part.hash.bucket_size, part.hash.clock,
                 entries["keys"].numel(), entries["tombstones"].numel()])
        else:
            if getattr(part.store, "on_disk", False):
                raise RuntimeError(
                    f"table {table.name!r} keeps its rows on disk ({part.store!r}): a state_dict "
                    f"would hold the whole table in memory at once. Save it with "
                    f"dynemb.checkpoint.dump(module, path) and load it with "
                    f"dynemb.checkpoint.load(module, path), which stream it chunk by chunk")
            keys, scores, rows = _export_store(part.store, table.width)
            entries = {"keys": keys, "scores": scores, "rows": rows}
            out[f"{name}.layout"] = torch.tensor([-1, 0, 0, keys.numel(), 0])
        out.update({f"{name}.{field}": SavedAsBytes.of(tensor)
                    for field, tensor in entries.items()})
    return out


def live_entries(keys: torch.Tensor, scores: torch.Tensor,
                 rows: Optional[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The live entries of the slot image ``(keys, scores)`` (and its per-slot ``rows``), as
    host tensors: ``keys``, ``scores``, ``slots`` and ``rows`` (when given) of each occupied
    slot, and ``tombstones``, the erased slots. Rows are gathered ``LOAD_CHUNK_ROWS`` at a
    time, so a table on an accelerator needs no second copy of itself there.

    Example::

        >>> from dynemb.types import EMPTY_KEY, TOMBSTONE_KEY
        >>> keys = torch.tensor([EMPTY_KEY, 7, TOMBSTONE_KEY, 3])
        >>> out = live_entries(keys, torch.tensor([0, 5, 0, 9]), torch.eye(4))
        >>> out["keys"].tolist(), out["slots"].tolist(), out["tombstones"].tolist()
        ([7, 3], [1, 3], [2])
        >>> out["rows"].tolist()
        [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]
    """
    slots = ((keys != EMPTY_KEY) & (keys != TOMBSTONE_KEY)).nonzero().squeeze(1)
    out = {"keys": keys[slots].cpu(), "scores": scores[slots].cpu(), "slots": slots.cpu(),
           "tombstones": (keys == TOMBSTONE_KEY).nonzero().squeeze(1).cpu()}
    if rows is not None:
        if rows.device.type == "cpu":
            out["rows"] = rows.index_select(0, slots)
        else:
            out["rows"] = torch.empty((slots.numel(), *rows.shape[1:]), dtype=rows.dtype)
            for lo in range(0, slots.numel(), LOAD_CHUNK_ROWS):
                part = slots[lo:lo + LOAD_CHUNK_ROWS]
                out["rows"][lo:lo + part.numel()].copy_(rows.index_select(0, part))
    return out


def _export_store(store, width: int):
    keys, rows, scores, start = [], [], [], 0
    while start is not None:
        chunk = store.export(start, LOAD_CHUNK_ROWS)
        k, r, s, start = chunk if len(chunk) == 4 else (chunk[0], chunk[1], None, chunk[2])
        keys.append(k.cpu())
        rows.append(r.cpu())
        scores.append(torch.zeros_like(k.cpu()) if s is None else s.cpu())
    return torch.cat(keys), torch.cat(scores), torch.cat(rows).reshape(-1, width)


# -- what is loaded -------------------------------------------------------------------------
@dataclasses.dataclass
class SavedTier:
    """One tier of a saved image (or of a part of it): live entries, and where a whole
    image was saved, the slot of each (``slots``), the erased slots (``tombstones``) and
    how many of each the whole image has (``counts``)."""

    capacity: int
    bucket_size: int
    clock: int
    keys: torch.Tensor
    scores: torch.Tensor
    rows: Optional[torch.Tensor]
    slots: Optional[torch.Tensor] = None
    tombstones: Optional[torch.Tensor] = None
    counts: Optional[Tuple[int, int]] = None

    @property
    def full_image(self) -> bool:
        """Every entry and tombstone of a slot image (not a part of one, nor entries placed
        by key only)."""
        return (self.capacity >= 0 and self.slots is not None and self.tombstones is not None
                and self.counts == (self.keys.numel(), self.tombstones.numel())
                and self.slots.numel() == self.keys.numel())

    def live(self) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Keys, scores and rows of the live entries."""
        occupied = (self.keys != EMPTY_KEY) & (self.keys != TOMBSTONE_KEY)
        if bool(occupied.all()):
            return self.keys, self.scores, self.rows
        return (self.keys[occupied], self.scores[occupied],
                None if self.rows is None else self.rows[occupied])

    def slot_image(self, where: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(keys, scores)`` per slot of a :attr:`full_image` (free slots ``EMPTY_KEY``,
        erased ones ``TOMBSTONE_KEY``, score 0), as the table's :meth:`image` has them.
        Raises ``ValueError`` (starting with ``where``) for a slot outside the capacity or
        given twice, or an entry whose key is a free-slot marker."""
        check_live_keys(self.keys, where)
        slots, tombstones = self.slots.cpu(), self.tombstones.cpu()
        taken = torch.cat([slots, tombstones])
        if taken.numel() and (int(taken.min()) < 0 or int(taken.max()) >= self.capacity):
            raise ValueError(f"{where}: slots outside [0, {self.capacity})")
        if torch.unique(taken).numel() != taken.numel():
            raise ValueError(f"{where}: {taken.numel() - torch.unique(taken).numel()} slots "
                             f"are given twice (two entries, or an entry and a tombstone)")
        keys = torch.full((self.capacity,), EMPTY_KEY, dtype=torch.int64)
        scores = torch.zeros(self.capacity, dtype=torch.int64)
        keys[slots] = self.keys.cpu()
        scores[slots] = self.scores.cpu()
        keys[tombstones] = TOMBSTONE_KEY
        return keys, scores


@dataclasses.dataclass
class SavedTable:
    """One saved image of a table (rank ``rank`` of ``world_size``), possibly a part of it."""

    signature: torch.Tensor
    step: int
    counters: torch.Tensor
    tiers: Dict[str, SavedTier]
    rank: int = 0
    world_size: int = 1


def parse(entries: Dict[str, torch.Tensor], *, rank: int = 0, world_size: int = 1,
          where: str = "") -> SavedTable:
    """The :class:`SavedTable` of one image's tensors (as :func:`capture` names them).
    Raises ``ValueError`` naming the format of a checkpoint of another layout (see
    :func:`check_format`), or a signature that does not record the sharding scheme (every
    one of this layout does)."""
    missing = [n for n in ("signature", "state") if n not in entries]
    if missing:
        raise ValueError(f"{where}: the checkpoint lacks {missing}")
    check_format(entries.get("format"), where)
    fields = entries["signature"].numel()
    if fields != SCHEME_FIELD + 1:
        raise ValueError(f"{where}: a signature of {fields} fields, {SCHEME_FIELD + 1} expected "
                         f"(format {STATE_FORMAT} records the sharding scheme last)")
    state = entries["state"].to(torch.int64).cpu()
    tiers = {}
    for name in TIERS:
        if f"{name}.layout" not in entries:
            continue
        layout = [int(v) for v in entries[f"{name}.layout"].tolist()]
        if len(layout) != 5:
            raise ValueError(f"{where}: tier {name!r} has a layout of {len(layout)} fields, "
                             f"5 expected (capacity, bucket size, clock, entries, tombstones)")
        capacity, bucket, clock, live, erased = layout
        fields = [f"{name}.{f}" for f in ROW_FIELDS[:2]]
        if capacity >= 0:
            fields += [f"{name}.slots", f"{name}.tombstones"]
        lacking = [f for f in fields if f not in entries]
        if lacking:
            raise ValueError(f"{where}: the checkpoint lacks {lacking}")
        slots, tombstones = entries.get(f"{name}.slots"), entries.get(f"{name}.tombstones")
        tiers[name] = SavedTier(capacity, bucket, clock, entries[f"{name}.keys"],
                                entries[f"{name}.scores"], entries.get(f"{name}.rows"),
                                slots, tombstones, (live, erased))
    return SavedTable(entries["signature"], int(state[0]), state[1:], tiers, rank, world_size)


def check_format(saved: Optional[torch.Tensor], where: str) -> None:
    """Raise ``ValueError`` naming the format unless ``saved`` (a table share's ``format``
    entry, None where it has none) is :data:`STATE_FORMAT`.

    Example::

        >>> check_format(torch.tensor([STATE_FORMAT]), "t")
        >>> check_format(None, "table 't'")
        Traceback (most recent call last):
        ...
        ValueError: table 't': the checkpoint is of format 1 (every slot of ...
    """
    version = 1 if saved is None else (int(saved.reshape(-1)[0]) if saved.numel() else -1)
    if version == STATE_FORMAT:
        return
    what = STATE_FORMATS.get(version)
    described = f"format {version} ({what})" if what else f"an unknown format {version}"
    raise ValueError(
        f"{where}: the checkpoint is of {described}; this dynemb reads format {STATE_FORMAT} "
        f"({STATE_FORMATS[STATE_FORMAT]}). To carry it over, load it with the dynemb that "
        f"wrote it and write checkpoint files with dynemb.checkpoint.dump, which load here")


def check_compatible(table: DynamicTable, saved: SavedTable) -> None:
    """Raise ``ValueError`` naming the table and what differs if ``saved`` cannot load into
    ``table``."""
    problem = describe_mismatch(table, saved.signature, mode_may_differ=True)
    if problem is None:
        expected = set(table.checkpoint_tiers())
        if same_mode(table, saved):
            differs = set(saved.tiers) != expected
        else:  # loaded by key: the row tiers may differ, the admission counter may not
            differs = ("device" not in saved.tiers
                       or ("admission" in saved.tiers) != ("admission" in expected))
        if differs:
            problem = (f"tiers {sorted(saved.tiers)} in the checkpoint, {sorted(expected)} "
                       f"here (admission on in one and off in the other?)")
    if problem is None:
        for name, tier in saved.tiers.items():
            if tier.rows is None and name != "admission":
                problem = f"the checkpoint has no rows for tier {name!r}"
            elif tier.rows is not None and tier.rows.shape[1:] != (table.width,):
                problem = f"rows of width {tuple(tier.rows.shape[1:])} in the checkpoint"
            elif tier.rows is not None and tier.rows.shape[0] != tier.keys.shape[0]:
                problem = f"{tier.keys.shape[0]} keys but {tier.rows.shape[0]} rows"
            else:
                problem = _describe_bad_entries(name, tier)
            if problem is not None:
                break
    if problem is None:
        problem = _describe_bad_numbers(saved)
    if problem is not None:
        raise ValueError(f"table {table.name!r}: cannot load the checkpoint: {problem}")
    check_placement(table, saved)


def _describe_bad_entries(name: str, tier: SavedTier) -> Optional[str]:
    """What is malformed among a tier's per-entry tensors, or None."""
    n = tier.keys.shape[0] if tier.keys.dim() == 1 else -1
    for field, t in (("keys", tier.keys), ("scores", tier.scores), ("slots", tier.slots),
                     ("tombstones", tier.tombstones)):
        if t is None:
            continue
        if t.dim() != 1 or t.dtype != torch.int64 or (field != "tombstones" and
                                                         t.shape[0] != n):
            return (f"tier {name!r}: {field} are {t.dtype} {tuple(t.shape)}, one int64 per "
                    f"{'erased slot' if field == 'tombstones' else 'entry'} expected "
                    f"({n} keys)")
    return None


def _describe_bad_numbers(saved: SavedTable) -> Optional[str]:
    """What is out of range among the step, counters and layouts, or None."""
    if saved.step < 0:
        return f"step {saved.step} is negative"
    if saved.counters.numel() != len(COUNTER_NAMES):
        return f"{saved.counters.numel()} counters, {len(COUNTER_NAMES)} expected"
    if bool((saved.counters < 0).any()):
        return f"negative counters {saved.counters.tolist()}"
    for name, tier in saved.tiers.items():
        if tier.clock < 0 or tier.capacity < -1:
            return f"tier {name!r}: capacity {tier.capacity}, clock {tier.clock}"
    return None


def check_placement(table: DynamicTable, saved: SavedTable) -> None:
    """Raise ``ValueError`` naming the table and tier if a saved tier holds a key twice, or
    (a full slot image) a key where lookups would not find it: in another bucket, past an
    empty slot of its probe, or (DEFAULT) in the other tier. See
    :mod:`dynemb.checkpoint.image_checks`."""
    for name, tier in saved.tiers.items():
        where = f"table {table.name!r}, tier {name!r}"
        if tier.full_image and is_bucketed_layout(tier.capacity, tier.bucket_size):
            check_slot_image(tier.slot_image(where)[0], tier.bucket_size, where)
        else:
            check_distinct(tier.live()[0], where)
    images = {name: tier for name, tier in saved.tiers.items() if name != "admission"}
    if not same_mode(table, saved):
        # the saved mode's routing is not this table's; a key is in one row tier of it,
        # but where the device caches a backing store, which may keep an older copy
        cached = storage_policy(saved_mode(saved.signature)).backing_store
        if not cached and len(images) > 1:
            check_distinct(torch.cat([tier.live()[0].cpu() for tier in images.values()]),
                           f"table {table.name!r}, tiers {sorted(images)}")
        return
    if all(tier.full_image for tier in images.values()):
        capacities = {name: tier.capacity for name, tier in images.items()}
        for name, tier in images.items():
            table.check_routing(name, tier.keys, f"table {table.name!r}, tier {name!r}",
                                capacities)


def same_mode(table: DynamicTable, saved: SavedTable) -> bool:
    """Whether ``saved`` was written by a table of ``table``'s storage mode."""
    return saved_mode(saved.signature) is table.mode


def can_restore_exactly(table: DynamicTable, saved: SavedTable) -> bool:
    """One full image of this table's storage mode whose tiers have its bucket sizes and a
    capacity each tier has or can grow to."""
    parts = table.checkpoint_tiers()
    if not same_mode(table, saved) or set(saved.tiers) != set(parts):
        return False
    for name, tier in saved.tiers.items():
        part = parts[name]
        if part.hash is None or not tier.full_image:
            return False
        h = part.hash
        if tier.bucket_size != h.bucket_size or tier.capacity % h.bucket_size:
            return False
        if tier.capacity != h.capacity and not (
                h.grow_at_load_factor is not None and h.capacity < tier.capacity
                and (h.max_capacity is None or tier.capacity <= h.max_capacity)):
            return False
    return True


def restore(table: DynamicTable, saved: List[SavedTable]) -> DynamicTable:
    """The table holding what ``saved`` holds: ``table`` itself, updated in place, when one
    full image of its exact layout (and storage mode) is given; else a new table of the same
    configuration filled by key (``table`` untouched), whatever mode wrote ``saved``. Every
    part of ``saved`` must have passed :func:`check_compatible`. Raises
    :class:`TableFullError` naming the table if the entries do not fit."""
    if len(saved) == 1 and can_restore_exactly(table, saved[0]):
        parts = table.checkpoint_tiers()
        same = all(parts[n].hash.capacity == t.capacity for n, t in saved[0].tiers.items())
        target = table if same else table.empty_copy()
        _restore_image(target, saved[0])
        return target
    target = table.empty_copy()
    clock = max((t.clock for s in saved for n, t in s.tiers.items() if n != "admission"),
                default=0)
    # CACHE: store rows first, cached rows (newer) overwrite them
    for name in ("host", "device", "admission"):
        for part in saved:
            if name in part.tiers:
                keys, scores, rows = part.tiers[name].live()
                for lo in range(0, keys.numel(), LOAD_CHUNK_ROWS):
                    hi = lo + LOAD_CHUNK_ROWS
                    target.insert_saved_entries(name, keys[lo:hi], scores[lo:hi],
                                                None if rows is None else rows[lo:hi])
    for name, part in target.checkpoint_tiers().items():
        if part.hash is not None:
            part.hash.set_clock(max(s.tiers[name].clock for s in saved if name in s.tiers)
                                if name == "admission" else clock)
    target.counters.load(torch.stack([s.counters for s in saved]).sum(0))
    return target


def _restore_image(table: DynamicTable, saved: SavedTable) -> None:
    table.counters.load(saved.counters)
    for name, part in table.checkpoint_tiers().items():
        tier = saved.tiers[name]
        h = part.hash
        if h.capacity != tier.capacity:
            table.remap_tier_rows(name, h.grow(tier.capacity), tier.capacity)
        keys, scores = tier.slot_image(f"table {table.name!r}, tier {name!r}")
        h.load_image(keys.to(h.device), scores.to(h.device), tier.clock)
        if part.rows is not None:  # free slots' rows are written when a key claims them
            part.rows.index_copy_(0, tier.slots.to(part.rows.device),
                                  tier.rows.to(part.rows.device, part.rows.dtype))


# -- iteration ------------------------------------------------------------------------------
def live_chunks(table: DynamicTable, chunk_rows: int) -> Iterator[Tuple[str, torch.Tensor,
                                                                      torch.Tensor,
                                                                      torch.Tensor]]:
    """``(tier, keys, scores, rows)`` of every live row, at most ``chunk_rows`` slots read per
    chunk (CACHE: store rows whose key is cached are skipped: the cached row is current)."""
    for name, part in table.checkpoint_tiers().items():
        if name == "admission":
            continue
        if part.hash is None:  # a user backing store
            start = 0
            while start is not None:
                chunk = part.store.export(start, chunk_rows)
                k, r, s, start = chunk if len(chunk) == 4 else (chunk[0], chunk[1],
                                                                torch.zeros_like(chunk[0]),
                                                                chunk[2])
                yield from _current(table, name, k, s, r)
            continue
        keys, scores = part.hash.image()
        for lo in range(0, part.hash.capacity, chunk_rows):
            k, s = keys[lo:lo + chunk_rows], scores[lo:lo + chunk_rows]
            occupied = (k != EMPTY_KEY) & (k != TOMBSTONE_KEY)
            r = part.rows[lo:lo + chunk_rows][occupied]
            yield from _current(table, name, k[occupied], s[occupied], r)


def _current(table: DynamicTable, name: str, keys, scores, rows) -> Iterable:
    keys, scores, rows = table.current_entries(name, keys, scores, rows)
    if keys.numel():
        yield name, keys, scores, rows
