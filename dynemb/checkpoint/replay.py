"""One table rebuilt from a chain of dumps (a full one, then deltas): a new table, never the
live one.

- **In place** when the full dump's tiers fit the table's layout (the bucket sizes, and a
  capacity each tier has or may grow to): every entry goes to its saved slot, tombstones
  included, with the saved clock; training from a full dump alone then continues bit for
  bit. Each delta then patches each tier by key (its deleted keys erased, its entries
  inserted or overwritten, never evicting) or replaces it whole, and the tier takes the
  delta's clock. Every tier ends holding as many keys as the last dump recorded.
- **Streamed**: a user backing store's tier (a disk store, say) of a full dump alone goes
  into the new table's store chunk by chunk, by key, as the dump wrote it.
- **By key** otherwise (another capacity, a user backing store behind deltas): the chain is
  merged per tier in memory and restored as :func:`~dynemb.checkpoint.table_state.restore`
  does.

``read(i, record)`` gives the tensors of the data file ``record`` of link ``i``; a link is
a table's entry in one manifest (see :mod:`dynemb.checkpoint.files`).
"""
from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Tuple

import torch

from dynemb.checkpoint.files import CheckpointFileError
from dynemb.checkpoint.image_checks import check_distinct, check_live_keys, check_slot_image
from dynemb.checkpoint.table_state import SavedTable, SavedTier, restore
from dynemb.foundations.counters import COUNTER_NAMES
from dynemb.types import EMPTY_KEY, TOMBSTONE_KEY, TableFullError

Reader = Callable[[int, Dict], Dict[str, torch.Tensor]]


def replay(table, links: List[Dict], read: Reader, *, in_place: bool = False):
    """A new table of ``table``'s configuration holding what ``links`` hold (see the module
    docstring); with ``in_place`` (for a table that :func:`holds_nothing`: a module built
    to be loaded), ``table`` itself, so the load needs no second copy of its memory.
    Raises :class:`CheckpointFileError` for a file that does not fit, and
    :class:`~dynemb.TableFullError` for entries that find no slot."""
    fresh = table if in_place else table.empty_copy()  # what fits is where the load starts
    parts = fresh.checkpoint_tiers()
    # a store of the user's (a disk store, say) takes a full dump's entries chunk by chunk,
    # as its export gave them: the table never has to fit in memory
    streamed = {n for n, t in links[0]["tiers"].items()
                if parts[n].hash is None and len(links) == 1 and t["write"] == "replace"}
    if not all(n in streamed or _fits(parts[n].hash, t) for n, t in links[0]["tiers"].items()):
        del fresh
        return restore(table, [_merged(table, links, read)])
    for i, link in enumerate(links):
        for name, tier in link["tiers"].items():
            files = _Files(table, name, tier, lambda record, i=i: read(i, record))
            if name in streamed:
                for data in files("entries"):
                    fresh.insert_saved_entries(name, data["keys"], data["scores"], data["rows"])
            elif tier["write"] == "replace":
                _replace(fresh, name, tier, files)
            else:
                _patch(fresh, name, tier, files)
    for name, tier in links[-1]["tiers"].items():
        size = fresh.checkpoint_tiers()[name].size()
        if size != tier["live_rows"]:
            raise CheckpointFileError(f"table {table.name!r}: the checkpoint chain gives its "
                                      f"{name} tier {size} keys, the last dump recorded "
                                      f"{tier['live_rows']}")
    fresh.counters.load(counters(links[-1]))
    return fresh


def holds_nothing(table) -> bool:
    """No key in any tier (admission counter included) and no batch in flight."""
    return not table.has_batches_in_flight() and not any(
        part.size() for part in table.checkpoint_tiers().values())


def counters(link: Dict) -> torch.Tensor:
    saved = link["counters"]
    return torch.tensor([int(saved.get(n, 0)) for n in COUNTER_NAMES], dtype=torch.int64)


def _fits(h, tier: Dict) -> bool:
    """A tier of this layout can be placed slot for slot into ``h`` (grown if need be)."""
    capacity, bucket = tier["capacity"], tier["bucket_size"]
    if h is None or capacity < 0 or bucket != h.bucket_size or capacity % bucket:
        return False
    return capacity == h.capacity or (
        h.grow_at_load_factor is not None and h.capacity < capacity
        and (h.max_capacity is None or capacity <= h.max_capacity))


class _Files:
    """The data files of one tier of one link, read and checked as they are iterated."""

    def __init__(self, table, name: str, tier: Dict, read):
        self.table, self.name, self.tier, self.read = table, name, tier, read

    def __call__(self, content: str) -> Iterator[Dict[str, torch.Tensor]]:
        for record in self.tier["files"]:
            if record["content"] == content:
                data = self.read(record)
                self._check(data, content, record["file"], record["rows"])
                yield data

    def _check(self, data, content: str, file: str, rows: int) -> None:
        fields = {"entries": ("keys", "scores", "slots"), "deleted": ("keys",),
                  "tombstones": ("slots",)}[content]
        if self.name != "admission" and content == "entries":
            fields += ("rows",)
        for f in fields:
            t = data.get(f)
            if t is None or t.shape[:1] != (rows,) or (
                    f != "rows" and (t.dim() != 1 or t.dtype != torch.int64)):
                raise CheckpointFileError(f"{file}: field {f!r} is missing or malformed (the "
                                          f"manifest says {rows} entries)")
        if content == "entries":
            where = f"{file}: table {self.table.name!r}, tier {self.name!r}"
            try:
                check_live_keys(data["keys"], where)
                check_distinct(data["keys"], where)
            except ValueError as err:
                raise CheckpointFileError(str(err)) from None
        rows = data.get("rows")
        if "rows" in fields and (rows.dim() != 2 or rows.shape[1] != self.table.width
                                 or rows.dtype != self.table.layout.dtype):
            raise CheckpointFileError(f"{file}: rows are {rows.dtype} {tuple(rows.shape)}, the "
                                      f"table stores {self.table.layout.dtype} rows of width "
                                      f"{self.table.width}")


def _replace(fresh, name: str, tier: Dict, files: _Files) -> None:
    """The tier becomes exactly the saved one: slot for slot when it fits, else by key."""
    h = fresh.checkpoint_tiers()[name].hash
    capacity = tier["capacity"]
    if not _fits(h, tier) or capacity < h.capacity:
        _clear(h)
        for data in files("entries"):
            _upsert(fresh, name, data)
        h.set_clock(tier["clock"])
        return
    if capacity > h.capacity:
        fresh.remap_tier_rows(name, h.grow(capacity), capacity)
    keys = torch.full((capacity,), EMPTY_KEY, dtype=torch.int64, device=h.device)
    scores = torch.zeros(capacity, dtype=torch.int64, device=h.device)
    rows = fresh.checkpoint_tiers()[name].rows
    for data in files("entries"):
        slots = _slots(data["slots"], capacity, tier)
        keys[slots.to(h.device)] = data["keys"].to(h.device)
        scores[slots.to(h.device)] = data["scores"].to(h.device)
        if rows is not None:
            rows.index_copy_(0, slots.to(rows.device), data["rows"].to(rows.device))
    for data in files("tombstones"):
        keys[_slots(data["slots"], capacity, tier).to(h.device)] = TOMBSTONE_KEY
    where = f"table {fresh.name!r}, tier {name!r}"
    try:
        check_slot_image(keys, h.bucket_size, where)
    except ValueError as err:
        raise CheckpointFileError(f"{_names(tier)}: {err}") from None
    _check_routing(fresh, name, keys, f"{_names(tier)}: ")
    h.load_image(keys, scores, tier["clock"])


def _names(tier: Dict) -> str:
    return ", ".join(f["file"] for f in tier["files"]) or "(no files)"


def _check_routing(fresh, name: str, keys: torch.Tensor, files: str = "") -> None:
    """Each key is in the tier lookups look for it in (the table's
    :meth:`~dynemb.tables.checkpoint_tiers.CheckpointTiers.check_routing`; errors start with
    ``files``)."""
    try:
        fresh.check_routing(name, keys, f"{files}table {fresh.name!r}, tier {name!r}")
    except ValueError as err:
        raise CheckpointFileError(str(err)) from None


def _slots(slots: torch.Tensor, capacity: int, tier: Dict) -> torch.Tensor:
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= capacity):
        raise CheckpointFileError(f"{_names(tier)}: slots outside [0, {capacity})")
    return slots


def _patch(fresh, name: str, tier: Dict, files: _Files) -> None:
    h = fresh.checkpoint_tiers()[name].hash
    for data in files("deleted"):
        if data["keys"].numel():
            h.erase(data["keys"].to(h.device))
    for data in files("entries"):
        _upsert(fresh, name, data)
    h.set_clock(tier["clock"])


def _clear(h) -> None:
    keys, _ = h.image()
    live = keys[(keys != EMPTY_KEY) & (keys != TOMBSTONE_KEY)]
    if live.numel():
        h.erase(live)


def _upsert(table, name: str, data: Dict[str, torch.Tensor]) -> None:
    """Insert or overwrite entries of one tier by key, with their scores, never evicting."""
    h = table.checkpoint_tiers()[name].hash
    if data["keys"].numel() == 0:
        return
    _check_routing(table, name, data["keys"])
    try:
        result = h.load_entries(data["keys"].to(h.device), data["scores"].to(h.device))
    except TableFullError as err:
        raise TableFullError(f"table {table.name!r}: {err.failed_keys.numel()} keys of the "
                             f"checkpoint found no free slot in its {name} tier "
                             f"({h.capacity} slots)", err.failed_keys, None) from None
    if result.remap is not None:
        table.remap_tier_rows(name, result.remap, h.capacity)
    rows = table.checkpoint_tiers()[name].rows
    if rows is not None:
        rows.index_copy_(0, result.slots.to(rows.device), data["rows"].to(rows.device))


# -- by key -------------------------------------------------------------------------------------
def _merged(table, links: List[Dict], read: Reader) -> SavedTable:
    """The chain merged per tier into one compact image (restored by key)."""
    tiers: Dict[str, Tuple[torch.Tensor, ...]] = {}
    for i, link in enumerate(links):
        for name, tier in link["tiers"].items():
            files = _Files(table, name, tier, lambda record, i=i: read(i, record))
            fields = ("keys", "scores") + (() if name == "admission" else ("rows",))
            # the reader reuses its buffer from file to file: keep copies
            chunks = [{k: v.clone() for k, v in c.items()} for c in files("entries")]
            entries = tuple(torch.cat([c[f] for c in chunks]) if chunks else
                            _empty(table, f) for f in fields)
            if tier["write"] == "replace":
                tiers[name] = entries
                continue
            gone = [d["keys"].clone() for d in files("deleted")] + [entries[0]]
            kept = ~torch.isin(tiers[name][0], torch.cat(gone))
            tiers[name] = tuple(torch.cat([old[kept], new])
                                for old, new in zip(tiers[name], entries))
    last = links[-1]
    saved = {name: SavedTier(-1, tier["bucket_size"], tier["clock"], *tiers[name][:2],
                             tiers[name][2] if len(tiers[name]) > 2 else None)
             for name, tier in last["tiers"].items()}
    return SavedTable(torch.tensor(last["signature"], dtype=torch.int64), int(last["step"]),
                      counters(last), saved)


def _empty(table, field: str) -> torch.Tensor:
    if field == "rows":
        return torch.empty(0, table.width, dtype=table.layout.dtype)
    return torch.empty(0, dtype=torch.int64)
