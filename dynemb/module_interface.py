"""What the services (checkpoint files, inference export, memory stashing, planning reports)
know of a dynamic module, and the one way they find those modules in a model.

The services sit below the modules: they see a module through
:class:`DynamicModuleInterface` (as TorchRec's code sees its modules through
``EmbeddingCollectionInterface``), never through the concrete classes, so
``dynemb.modules.collection`` may import them and nothing imports back up.
"""
from __future__ import annotations

import abc
from typing import Dict, List, Optional

import torch
from torch import nn
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface

from dynemb.options import DynamicEmbTableOptions

# DistributedModelParallel's wrappers (its own, then DDP's) are no part of the model's names
_WRAPPERS = ("_dmp_wrapped_module.module.", "_dmp_wrapped_module.")


class DynamicModuleInterface(abc.ABC):
    """A module whose tables are dynamic (``DynamicEmbCollection``,
    ``DynamicEmbBagCollection``, and the per-rank share of their sharded forms).

    ``tables`` maps each table name to its :class:`~dynemb.tables.DynamicTable`."""

    tables: Dict[str, object]

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Where the tables live (``meta``: described, not built)."""

    @property
    @abc.abstractmethod
    def table_options(self) -> Dict[str, DynamicEmbTableOptions]:
        """Each table's options, by name."""

    @property
    @abc.abstractmethod
    def memory_stash(self):
        """The module's :class:`~dynemb.stashing.CollectionStash`, None if no table stashes."""

    @property
    @abc.abstractmethod
    def steps(self) -> Dict[str, int]:
        """Each table's optimizer step (a copy)."""

    @property
    @abc.abstractmethod
    def generation(self) -> int:
        """How many times the tables were loaded or reset: a lookup of an older generation
        cannot run its backward."""

    @abc.abstractmethod
    def table_configs(self) -> List[BaseEmbeddingConfig]:
        """The TorchRec configs of the tables, in order."""

    def settle_optimizer(self) -> None:
        """Adopt what configures the tables' optimizer before their rows are replaced (a
        checkpoint's rows and optimizer state load into tables built for it); nothing to do
        where nothing but the constructor configures it."""

    def rows_in_place(self) -> None:
        """Bring back every row the module moved off its tables' tensors for a while (memory
        stashing, between a training forward and its backward), before reading or replacing
        the tables' rows directly; nothing to do where nothing moves them."""

    def write_rows(self, table: str, keys: torch.Tensor, rows: torch.Tensor, *,
                   optimizer_state: Optional[torch.Tensor] = None,
                   scores: Optional[torch.Tensor] = None) -> None:
        """Write rows by key into a table, all or nothing (see
        :mod:`dynemb.tables.row_writes`)."""
        raise NotImplementedError(f"{type(self).__name__} does not write rows")

    @abc.abstractmethod
    def load_tables(self, saved) -> None:
        """Replace the named tables' contents with saved images, all or nothing."""

    @abc.abstractmethod
    def install_tables(self, tables: Dict[str, object], steps: Dict[str, int]) -> None:
        """Swap in tables rebuilt elsewhere (e.g. from checkpoint files) with their steps:
        queued prefetches are dropped, pins end, and the generation is bumped."""


class ShardedDynamicModuleInterface(abc.ABC):
    """A sharded dynamic module: its rows on this rank are those of :attr:`local`, saved
    under the sharded module's own name."""

    @property
    @abc.abstractmethod
    def local(self) -> DynamicModuleInterface:
        """This rank's share of the tables."""

    def write_rows(self, table: str, keys: torch.Tensor, rows: torch.Tensor, *,
                   optimizer_state: Optional[torch.Tensor] = None,
                   scores: Optional[torch.Tensor] = None) -> None:
        """Write rows by key, each to its owner rank, all or nothing over the ranks (a
        collective, see :mod:`dynemb.sharding.sharded_writes`)."""
        raise NotImplementedError(f"{type(self).__name__} does not write rows")


def find_dynamic_modules(model: nn.Module) -> Dict[str, DynamicModuleInterface]:
    """This rank's dynamic modules in ``model`` (``model`` itself or its submodules) by their
    name in the model: a sharded module is represented by its :attr:`local` share under its
    own name, and ``DistributedModelParallel``'s wrappers are left out of the names.

    Example::

        >>> from torchrec.modules.embedding_configs import EmbeddingConfig
        >>> from dynemb import DynamicEmbCollection
        >>> model = torch.nn.ModuleDict({"sparse": DynamicEmbCollection([EmbeddingConfig(
        ...     name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"])])})
        >>> list(find_dynamic_modules(model))
        ['sparse']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module holding dynamic tables, got "
                        f"{type(model).__name__}")
    found: Dict[str, DynamicModuleInterface] = {}
    shares = set()  # local shares, found through their sharded owner (visited first)
    for fqn, sub in model.named_modules():
        if isinstance(sub, ShardedDynamicModuleInterface):
            found[_model_fqn(fqn)] = sub.local
            shares.add(id(sub.local))
        elif isinstance(sub, DynamicModuleInterface) and id(sub) not in shares:
            found[_model_fqn(fqn)] = sub
    return found


def local_module(module: nn.Module) -> Optional[DynamicModuleInterface]:
    """The module holding ``module``'s rows on this rank: itself if dynamic, a sharded
    module's :attr:`local` share, else None."""
    if isinstance(module, ShardedDynamicModuleInterface):
        return module.local
    return module if isinstance(module, DynamicModuleInterface) else None


def is_pooled(module: nn.Module) -> bool:
    """Whether a dynamic module (or its sharded form) pools its bags."""
    local = local_module(module)
    return isinstance(local, EmbeddingBagCollectionInterface)


def _model_fqn(fqn: str) -> str:
    for prefix in _WRAPPERS:
        if f"{fqn}.".startswith(prefix):
            return fqn[len(prefix):]
    return fqn
