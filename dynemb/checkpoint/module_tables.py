"""The dynamic tables of a module, as checkpoint files name them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, Tuple

import torch

from dynemb.module_interface import DynamicModuleInterface, find_dynamic_modules



@dataclass
class ModuleTables:
    """This rank's :class:`~dynemb.DynamicEmbCollection`\\ s of a module, by fqn (a sharded
    collection is represented by its ``local`` share, under the sharded module's fqn)."""

    collections: Dict[str, DynamicModuleInterface]
    rank: int
    world_size: int

    def tables(self) -> Iterator[Tuple[str, str, DynamicModuleInterface, str]]:
        """``(key, fqn, collection, table name)``; key ``"<fqn>/<table>"`` (the table name
        alone for a collection at the module's root)."""
        for fqn, collection in self.collections.items():
            collection.rows_in_place()
            for name in collection.tables:
                yield (f"{fqn}/{name}" if fqn else name), fqn, collection, name


def module_tables(module: torch.nn.Module) -> ModuleTables:
    """The dynamic modules of ``module`` (see
    :func:`~dynemb.module_interface.find_dynamic_modules`), and this process's rank and world
    size (from ``torch.distributed`` when it is initialized, else 0 of 1). Raises
    ``TypeError`` if it holds none."""
    found = find_dynamic_modules(module)
    if not found:
        raise TypeError(f"{type(module).__name__} holds no DynamicEmbCollection")
    meta = [fqn or "<root>" for fqn, c in found.items() if c.device.type == "meta"]
    if meta:
        raise ValueError(f"collections {meta} are on the meta device and hold no rows: shard "
                         f"the module first")
    rank, world_size = 0, 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return ModuleTables(found, rank, world_size)
