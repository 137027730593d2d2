"""``CollectionStash``: the stashes of one :class:`~dynemb.DynamicEmbCollection`'s tables,
and the options that turn them on.

The collection calls :meth:`CollectionStash.after_lookup` at the end of each training forward
and :meth:`CollectionStash.restore` at the start of its backward (the last moment: a pipeline
or the user may restore earlier, see :func:`dynemb.stashing.restore`). Anything else that
touches a stashed table's rows brings them back first (see
:mod:`dynemb.stashing.table_stash`).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Mapping, Optional

import torch
from torchrec.modules.embedding_configs import EmbeddingConfig

from dynemb.bridges import memory_stashing
from dynemb.rows.optimizers import OptimizerConfig
from dynemb.options import DynamicEmbTableOptions, StashMode
from dynemb.stashing.table_stash import TableStash
from dynemb.stashing.transfers import HostTransfers, transfers_for


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


class CollectionStash:
    """The stashes of a collection's tables whose options ask for one.

    Args:
        tables: the collection's ``tables`` dict (read at each step: checkpoint loads
            replace its entries).
        transfers: how rows move (:func:`~dynemb.stashing.transfers.transfers_for`).
        prefetch_stream: the collection's prefetch stream (CUDA), which writes rows too.

    ``hand_restores_to_torchrec``: queue :meth:`restore` on TorchRec's
    ``MemoryStashingManager`` after each stash, so its EMS pipeline's backward hook restores
    the rows (set by :mod:`dynemb.pipelines`; on CUDA it is also done whenever the
    manager's streams are set).
    """

    def __init__(self, tables: Mapping[str, object], transfers: HostTransfers,
                 prefetch_stream=None):
        self._tables = tables
        self._transfers = transfers
        self._prefetch_stream = prefetch_stream
        self._stashes: Dict[str, TableStash] = {}
        self._step = 0
        self.hand_restores_to_torchrec = False

    @classmethod
    def build(cls, tables: Mapping[str, object], device: torch.device,
              prefetch_stream=None) -> Optional["CollectionStash"]:
        """The collection's stash, or None when no table stashes (nothing to do then)."""
        if not any(t.options.stash is not StashMode.NONE for t in tables.values()):
            return None
        return cls(tables, transfers_for(device), prefetch_stream)

    # -- what is stashed -----------------------------------------------------------------------
    def table_stashes(self) -> Dict[str, TableStash]:
        """The stash of each stashing table, by name."""
        for name, table in self._tables.items():
            if table.options.stash is not StashMode.NONE:
                self._stash_of(name, table)
        return dict(self._stashes)

    def _stash_of(self, name: str, table) -> TableStash:
        stash = self._stashes.get(name)
        if stash is None or stash.tier is not table.tier:  # a new table (checkpoint load)
            stash = TableStash(name, table.tier, table.options.stash, table.row_layout,
                               self._transfers, (self._prefetch_stream,))
            self._stashes[name] = stash
        return stash

    @property
    def stashed(self) -> List[str]:
        """Tables whose rows are away now."""
        return [name for name, s in self._stashes.items() if s.stashed]

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
        for name in list(self._stashes):
            if name not in self._tables:
                del self._stashes[name]
        stashed = False
        for name, table in self._tables.items():
            if table.options.stash is not StashMode.NONE:
                stashed |= self._stash_of(name, table).stash()
        if stashed and (self.hand_restores_to_torchrec or memory_stashing.manager_enabled()):
            memory_stashing.queue_restore(self.restore)

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
