"""Tables filled to a load factor with synthetic keys, for benchmarks and capacity tests.

:func:`fill_to_load_factor` inserts distinct random keys in batches through the path a
training step takes, each table as a group of one over its arrays
(:func:`~dynemb.tables.grouping.group_of_one`: its prefetch, its forward's lookup, then the
pins end): new rows
start from the table's initializer, scores and evictions follow the table's policy, a CACHE
table writes evicted rows to its store, and the counters count the fill as lookups and
inserts (``table.counters.reset()`` starts them over). So a full table can be measured
without training it full.

What "load factor" means, by storage mode:

- HBM_DIRECT: rows of the table over its capacity (``stats()["load_factor"]``); a table that
  grows doubles as it would in training, so a target above its ``max_load_factor`` fills it
  at its ``max_capacity``;
- CACHE: rows of the device cache over its capacity (``stats()["load_factor"]``); the backing
  store only takes the rows the cache evicts;
- DEFAULT: rows of both tiers over the slots of both (``(stats()["rows_device"] +
  stats()["rows_backing"]) / (device capacity + host capacity)``): keys go to a tier by
  their hash in proportion to its slots, so both fill alike;
- HOST_ONLY: rows of its one (host) tier over its slots.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple, Union

import torch

from dynemb.options import StorageMode
from dynemb.tables.base import DynamicTable
from dynemb.tables.grouping import group_of_one
from dynemb.types import ScorePolicy

#: Keys inserted per batch at most (and at most a quarter of the slots).
FILL_BATCH = 1 << 16
#: Keys are drawn from ``[0, KEY_RANGE)``.
KEY_RANGE = 1 << 62
#: Batches in a row that add no row before the fill stops short of its target (near a load
#: factor of 1 most keys land in full buckets: they evict instead of adding a row).
STALLED_BATCHES = 64


@dataclass
class FillReport:
    """What :func:`fill_to_load_factor` did to one table.

    ``keys``: the keys it inserted that the table holds at the end (a row evicted by a later
    batch of the fill is gone from HBM_DIRECT and DEFAULT, and in the store of CACHE);
    ``inserted``: rows the table gained; ``rows`` / ``capacity``: its occupancy at the end, as
    the module docstring counts it, ``load_factor`` their ratio."""

    keys: torch.Tensor
    inserted: int
    rows: int
    capacity: int
    load_factor: float


def fill_to_load_factor(target, load_factor: float, *, seed: int = 0,
                        batch_size: int = FILL_BATCH, score: Optional[int] = None
                        ) -> Union[FillReport, Dict[str, FillReport]]:
    """Insert distinct synthetic keys into ``target`` until its load factor (see the module
    docstring) reaches ``load_factor``; returns its :class:`FillReport`.

    ``target`` is a :class:`~dynemb.tables.DynamicTable` or a module with a ``tables``
    mapping (``DynamicEmbCollection``, ``DynamicEmbBagCollection``; a sharded module's
    ``local`` for this rank's share): each table is filled, and a dict of reports by table
    name comes back. Keys come from ``torch.Generator`` seeded with ``seed``, in batches of at
    most ``batch_size`` (and no more than the rows still missing, so the fill ends exactly at
    the target unless evictions or growth move it, and then within one batch). Keys reach the
    table as often as its admission threshold asks, so they are admitted at once. ``score``:
    what a CUSTOMIZED table writes as the score of the fill keys (required there: a
    CUSTOMIZED table without it raises ``ValueError`` before any table changes; ignored by
    the other policies). A fill that stops gaining rows (e.g. NO_EVICTION buckets full)
    stops short; a batch that finds no slot raises ``TableFullError`` as in training.

    Example::

        >>> ec = DynamicEmbCollection(
        ...     [EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=1024,
        ...                      feature_names=["f"])],
        ...     table_options=DynamicEmbTableOptions(max_capacity=1024))
        >>> report = fill_to_load_factor(ec, 0.5, seed=1)["t"]
        >>> report.rows, report.capacity, report.load_factor, report.keys.numel()
        (512, 1024, 0.5, 512)
        >>> ec.stats()["t"]["load_factor"], bool(ec.read_rows("t", report.keys)[1].all())
        (0.5, True)
        >>> fill_to_load_factor(ec.tables["t"], 0.75).inserted  # one table: one report
        256
    """
    if isinstance(load_factor, bool) or not isinstance(load_factor, (int, float)) or not (
            0.0 < load_factor <= 1.0):
        raise ValueError(f"load_factor must be in (0, 1], got {load_factor!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    tables = {"": target} if isinstance(target, DynamicTable) else getattr(target, "tables",
                                                                             None)
    if not isinstance(tables, Mapping):
        raise TypeError(f"fill_to_load_factor takes a DynamicTable or a module with a "
                        f"'tables' mapping (a sharded module's 'local'), got "
                        f"{type(target).__name__}")
    for table in tables.values():  # before any table changes
        if table.options.score_strategy is ScorePolicy.CUSTOMIZED and score is None:
            raise ValueError(f"table {table.name!r} has score_strategy CUSTOMIZED: pass the "
                             f"score its fill keys get, fill_to_load_factor(..., score=...)")
    reports = {name: _fill(table, float(load_factor), seed, batch_size, score)
               for name, table in tables.items()}
    return reports[""] if isinstance(target, DynamicTable) else reports


def occupancy(table: DynamicTable) -> Tuple[int, int]:
    """``(rows, slots)`` of ``table`` as a load factor counts them (see the module
    docstring)."""
    rows, slots = table.tier.hash.size(), table.tier.hash.capacity
    if table.mode is StorageMode.DEFAULT:
        rows += table.host_tier.hash.size()
        slots += table.host_tier.hash.capacity
    return rows, slots


def target_rows(load_factor: float, slots: int) -> int:
    """The rows a fill to ``load_factor`` of ``slots`` stops at: rounded down, so the load
    factor reached is never above the one asked for (as DynamicEmb's ``fill_tables``).

    Example::

        >>> target_rows(0.1, 13952), target_rows(0.5, 1024), target_rows(0.3, 3)
        (1395, 512, 0)
    """
    return math.floor(load_factor * slots + 1e-9)  # 1e-9: 0.3 * 10 is 2.9999999999999996


def _fill(table: DynamicTable, load_factor: float, seed: int, batch_size: int,
          score: Optional[int]) -> FillReport:
    generator = torch.Generator().manual_seed(seed)
    threshold = 1 if table.admission is None else table.admission.threshold
    start, _ = occupancy(table)
    group = group_of_one(table)
    fed, stalled = [], 0
    while stalled < STALLED_BATCHES:
        rows, slots = occupancy(table)
        missing = target_rows(load_factor, slots) - rows
        if missing <= 0:
            break
        n = min(batch_size, missing, max(1, slots // 4))
        keys = torch.unique(torch.randint(0, KEY_RANGE, (n,), generator=generator))
        keys = keys.to(table.device)
        occurrences = torch.full_like(keys, threshold)
        group.check_failures()  # (CUDA) keys of the batch before that found no slot
        batch = group.prefetch([keys], [occurrences], [score])
        try:
            batch.lookup_occurrences()  # a DEFAULT table claims in its forward
        finally:
            batch.release()
        fed.append(keys)
        stalled = stalled + 1 if occupancy(table)[0] <= rows else 0
    group.check_failures(wait=True)  # the last batch's too
    rows, slots = occupancy(table)
    keys = torch.cat(fed) if fed else torch.empty(0, dtype=torch.int64, device=table.device)
    held = table.read_rows(keys)[1] if keys.numel() else keys.bool()
    return FillReport(keys[held], rows - start, rows, slots, rows / slots)
