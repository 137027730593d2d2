"""The dynamic tables of a module, as checkpoint files name them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, Tuple

import torch

# DistributedModelParallel's wrappers (its own, then DDP's) are no part of the model's names
_WRAPPERS = ("_dmp_wrapped_module.module.", "_dmp_wrapped_module.")


@dataclass
class ModuleTables:
    """This rank's :class:`~dynemb.DynamicEmbCollection`\\ s of a module, by fqn (a sharded
    collection is represented by its ``local`` share, under the sharded module's fqn)."""

    collections: Dict[str, object]
    rank: int
    world_size: int

    def tables(self) -> Iterator[Tuple[str, str, object, str]]:
        """``(key, fqn, collection, table name)``; key ``"<fqn>/<table>"`` (the table name
        alone for a collection at the module's root)."""
        for fqn, collection in self.collections.items():
            for name in collection.tables:
                yield (f"{fqn}/{name}" if fqn else name), fqn, collection, name


def module_tables(module: torch.nn.Module) -> ModuleTables:
    """The collections of ``module`` (itself one, or containing some; a
    ``DistributedModelParallel``'s wrapper is left out of their fqns), and this process's
    rank and world size (from ``torch.distributed`` when it is initialized, else 0 of 1).
    Raises ``TypeError`` if it holds none."""
    # imported here: dynemb.collection imports this package for its state_dict
    from dynemb.collection import DynamicEmbCollection

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"expected an nn.Module holding dynamic tables, got "
                        f"{type(module).__name__}")
    found: Dict[str, object] = {}
    shares = set()  # the local collections of sharded modules, found through their owner
    for fqn, sub in module.named_modules():
        fqn = _model_fqn(fqn)
        local = getattr(sub, "local", None)
        if isinstance(local, DynamicEmbCollection) and not isinstance(sub, DynamicEmbCollection):
            found[fqn] = local
            shares.add(id(local))
        elif isinstance(sub, DynamicEmbCollection) and id(sub) not in shares:
            found[fqn] = sub
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


def _model_fqn(fqn: str) -> str:
    for prefix in _WRAPPERS:
        if f"{fqn}.".startswith(prefix):
            return fqn[len(prefix):]
    return fqn
