"""Old module paths of dynemb, kept importable so that modules pickled by an earlier version
(``torch.save(module)``) load.

A pickle names each class by its module, and until the package was laid out by layer most
modules lay directly in ``dynemb/`` (``dynemb.collection``, ``dynemb.hash_table``...). Those
names import here as aliases of the modules that hold the same code now; nothing else
changes, and no new code should use them.

Example::

    >>> install()
    >>> import dynemb.hash_table, dynemb.rows.hash_table
    >>> dynemb.hash_table is dynemb.rows.hash_table
    True
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Dict, Optional

#: old module -> the module that holds its code now
MOVED_MODULES: Dict[str, str] = {
    **{f"dynemb.{name}": f"dynemb.modules.{name}" for name in (
        "bag_collection", "batch_claims", "collection", "collection_config", "dynamic_core",
        "dynamic_module", "fused_params", "jagged", "module_conversion", "occurrence_lookup",
        "pooling", "prefetch", "rank_share", "table_inputs", "table_views", "table_weights",
        "tracing")},
    **{f"dynemb.{name}": f"dynemb.rows.{name}" for name in (
        "admission", "dedup", "flat_table", "fused_optimizer", "hash_table",
        "hash_table_checks", "hash_table_images", "initializers", "occurrence_grads",
        "optimizers", "row_moves")},
    **{f"dynemb.{name}": f"dynemb.stores.{name}" for name in (
        "backing_store", "disk_levels", "disk_store")},
    **{f"dynemb.{name}": f"dynemb.foundations.{name}" for name in (
        "counters", "device_values", "key_mixing", "marked_optimizer", "threads",
        "validation")},
    "dynemb.allocation_checks": "dynemb.tables.allocation_checks",
    "dynemb.kernel_backend": "dynemb.backends.protocol",
}

#: names of a module that became a package, and where each lives now
MOVED_NAMES: Dict[str, Dict[str, str]] = {
    "dynemb.backends": {"CpuBackend": "dynemb.backends.numba_backends",
                        "CudaBackend": "dynemb.backends.cuda_backend",
                        "get_backend": "dynemb.backends.numba_backends"},
}


def moved_name(package: str, name: str):
    """``name`` of the old module ``package`` (now a package), from where it lives now;
    AttributeError for any other name (a package's ``__getattr__`` calls this)."""
    where = MOVED_NAMES.get(package, {}).get(name)
    if where is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return getattr(importlib.import_module(where), name)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module name as the module that holds its code now."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec) -> Optional[object]:
        module = importlib.import_module(MOVED_MODULES[spec.name])
        spec.loader_state = module.__spec__  # importlib puts the alias's spec on the module
        return module

    def exec_module(self, module) -> None:
        # the module is the new one, already run: it is not run again, and it keeps its own
        # name and spec (its classes pickle under their new module)
        module.__spec__ = module.__spec__.loader_state


_FINDER = _Alias()


def install() -> None:
    """Makes the old module names importable (once; ``import dynemb`` does it)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
