"""``CollectionStash``: the stashes of one :class:`~dynemb.DynamicEmbCollection`'s tables,
and the options that turn them on.

The collection calls :meth:`CollectionStash.after_lookup` at the end of each training forward
and :meth:`CollectionStash.restore` at the start of its backward (the last moment: a pipeline
or the user may restore earlier, see :func:`dynemb.stashing.restore`). Before anything else
reads or moves a stashed table's rows, the collection brings them back
(:meth:`CollectionStash.bring_back`, :meth:`CollectionStash.before_prefetch`; see
:mod:`dynemb.stashing.table_stash`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torchrec.modules.embedding_configs import EmbeddingConfig

from dynemb.bridges import memory_stashing
from dynemb.rows.optimizers import OptimizerConfig
from dynemb.options import DynamicEmbTableOptions, StashMode
from dynemb.stashing.table_stash import TableStash
from dynemb.stashing.transfers import HostTransfers, transfers_for
from dynemb.tables.policies import storage_policy


def resolve_stash_options(options: Dict[str, DynamicEmbTableOptions],
                          configs: List[EmbeddingConfig],
                          optimizer: OptimizerConfig) -> Dict[str, DynamicEmbTableOptions]:
    """Each table's options with its stash mode settled: a config with TorchRec's
    ``stash_weights=True`` stashes whole rows (``StashMode.ALL``) unless its options name a
    mode; ``OPTIMIZER_STATE`` needs an optimizer that keeps state.

    Example::

        >>> config = EmbeddingConfig(name="t", embedding_dim=8, num_embeddings=64,
        ...                          feature_names=["f"], stash_weights=True)
        >>> resolve_stash_options({"t": DynamicEmbTableOptions()}, [config],
        ...                       OptimizerConfig())["t"].stash
        <StashMode.ALL: 'all'>
    """
    out = dict(options)
    for config in configs:
        opt = out[config.name]
        if opt.stash is StashMode.NONE and getattr(config, "stash_weights", False):
            opt = dataclasses.replace(opt, stash=StashMode.ALL)
        if (opt.stash is StashMode.OPTIMIZER_STATE
                and optimizer.state_dim(config.embedding_dim) == 0):
            raise ValueError(
                f"table {config.name!r}: stash=StashMode.OPTIMIZER_STATE, but the "
                f"{optimizer.type.name} optimizer keeps no state in the rows; use "
                f"StashMode.VALUES or StashMode.ALL")
        out[config.name] = opt
    return out


#: Where a module's rows live, unit by unit: ``[(table names, rows)]``, ``rows`` a table's own
#: tier or a table group's record (see :class:`~dynemb.stashing.table_stash.TableStash`).
RowUnits = Callable[[], Sequence[Tuple[Tuple[str, ...], object]]]


class CollectionStash:
    """The stashes of a collection's tables whose options ask for one.

    Args:
        tables: the collection's ``tables`` dict (read at each step: checkpoint loads
            replace its entries).
        transfers: how rows move (:func:`~dynemb.stashing.transfers.transfers_for`).
        prefetch_stream: the collection's prefetch stream (CUDA), which writes rows too.
        units: where the rows live now (read at each step: groups change with the tables);
            the tables of a unit share one stash, their rows go and come back as one. None:
            each table's own tier.

    ``hand_restores_to_torchrec``: queue :meth:`restore` on TorchRec's
    ``MemoryStashingManager`` after each stash, so its EMS pipeline's backward hook restores
    the rows (set by :mod:`dynemb.pipelines`; on CUDA it is also done whenever the
    manager's streams are set).
    """

    def __init__(self, tables: Mapping[str, object], transfers: HostTransfers,
                 prefetch_stream=None, units: Optional[RowUnits] = None):
        self._tables = tables
        self._transfers = transfers
        self._prefetch_stream = prefetch_stream
        self._units = units
        self._stashes: Dict[Tuple[str, ...], TableStash] = {}
        self._step = 0
        self.hand_restores_to_torchrec = False

    @classmethod
    def build(cls, tables: Mapping[str, object], device: torch.device,
              prefetch_stream=None, units: Optional[RowUnits] = None
              ) -> Optional["CollectionStash"]:
        """The collection's stash, or None when no table stashes (nothing to do then)."""
        if not any(t.options.stash is not StashMode.NONE for t in tables.values()):
            return None
        return cls(tables, transfers_for(device), prefetch_stream, units)

    # -- what is stashed -----------------------------------------------------------------------
    def _stashing_units(self) -> Iterator[Tuple[Tuple[str, ...], object, object]]:
        """``(names, rows, first table)`` of each unit whose tables stash (the tables of a
        group share their stash mode)."""
        units = (self._units() if self._units is not None else
                 [((name,), table.tier) for name, table in self._tables.items()])
        for names, rows in units:
            table = self._tables[names[0]]
            if table.options.stash is not StashMode.NONE:
                yield tuple(names), rows, table

    def table_stashes(self) -> Dict[str, TableStash]:
        """The stash of each stashing table, by name (the tables of a group share one: their
        rows are one tensor)."""
        out = {}
        for names, rows, table in self._stashing_units():
            stash = self._stash_of(names, rows, table)
            out.update((name, stash) for name in names)
        return {name: out[name] for name in self._tables if name in out}

    def _stash_of(self, names: Tuple[str, ...], rows, table) -> TableStash:
        stash = self._stashes.get(names)
        if stash is None or stash.tier is not rows:  # new tables (checkpoint load), regrouped
            if stash is not None:
                stash.restore()  # (a no-op unless its rows are away)
            stash = TableStash(", ".join(names), rows, table.options.stash, table.row_layout,
                               self._transfers, (self._prefetch_stream,))
            self._stashes[names] = stash
        return stash

    @property
    def stashed(self) -> List[str]:
        """Tables whose rows are away now, in table order."""
        away = {name for names, s in self._stashes.items() if s.stashed for name in names}
        return [name for name in self._tables if name in away]

    def stashed_bytes(self) -> int:
        """Device bytes away now."""
        return sum(s.stashed_bytes for s in self._stashes.values() if s.stashed)

    # -- the step ------------------------------------------------------------------------------
    def after_lookup(self) -> None:
        """A training forward has enqueued every lookup: stash now, or at TorchRec's
        ``execute_pending_stashes()`` when the manager delays stashes."""
        self._step += 1
        if memory_stashing.delay_stash_enabled():
            step = self._step

            def deferred(_grad: Optional[torch.Tensor] = None) -> None:
                if step == self._step:  # this forward's backward has not run yet
                    self._stash_now()

            memory_stashing.queue_pending_stash(deferred)
            return
        self._stash_now()

    def _stash_now(self) -> None:
        units = list(self._stashing_units())
        live = {names for names, _, _ in units}
        for names in [n for n in self._stashes if n not in live]:  # tables gone or regrouped
            self._stashes.pop(names).restore()
        stashed = False
        for names, rows, table in units:
            stashed |= self._stash_of(names, rows, table).stash()
        if stashed and (self.hand_restores_to_torchrec or memory_stashing.manager_enabled()):
            memory_stashing.queue_restore(self.restore)

    def bring_back(self, names: Optional[Iterable[str]] = None) -> None:
        """Bring back now the rows of the named tables (None: every table) that are away:
        what the collection does before anything reads or moves them (counted in each
        stash's ``restores_on_access``). The tables of a group come back together."""
        wanted = None if names is None else set(names)
        for unit, stash in self._stashes.items():
            if stash.stashed and (wanted is None or wanted.intersection(unit)):
                stash.restore(on_access=True)

    def before_prefetch(self, training: bool) -> None:
        """A prefetch is about to run. An eval prefetch may read rows: every table comes
        back. A training prefetch brings back the tables whose prefetch reads or moves rows
        (a CACHE table writes evicted rows back and loads new ones, a table that can grow
        moves its rows); the others only claim slots and initialize new rows, which wait for
        the restore (a DEFAULT table claims in forward: its prefetch touches no row)."""
        if not training:
            self.bring_back()
            return
        for unit, stash in self._stashes.items():
            if stash.stashed and any(_prefetch_moves_rows(self._tables[name])
                                     for name in unit if name in self._tables):
                stash.restore(on_access=True)

    def restore(self, _grad: Optional[torch.Tensor] = None, sync_event=None) -> None:
        """Bring every stashed table back (a no-op for those in place). Its signature is that
        of TorchRec's restore callbacks (a gradient hook's argument, an event to wait for)."""
        self._step += 1
        for stash in self._stashes.values():
            stash.restore(sync_event)

    def __repr__(self) -> str:
        modes = {n: t.options.stash.value for n, t in self._tables.items()
                 if t.options.stash is not StashMode.NONE}
        return f"CollectionStash({modes}, stashed={self.stashed})"


def _prefetch_moves_rows(table) -> bool:
    """Whether a training prefetch of ``table`` may read or move its device rows: rows move
    between a backing store and the device (CACHE), or the table can grow."""
    return (storage_policy(table.mode).backing_store
            or table.tier.hash.grow_at_load_factor is not None)
