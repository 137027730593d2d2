"""Raw ids -> rows of a static table, for serving exports (see :mod:`dynemb.serving`).

- :class:`IdRemap`: one table's sorted live keys; ``torch.searchsorted`` finds an id's row, any
  other id reads the default row (index ``num_keys``);
- :func:`check_remaps`: a remap for every table of a static module, sized to its rows;
- :func:`remap_kjt`: a KJT's ids replaced by their rows, table by table;
- :class:`RemappedServing`: what the serving wrappers of both export kinds share.

Shapes: ``N`` ids, ``K`` live keys of a table.
"""
from __future__ import annotations

from typing import Dict, List, Mapping

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb.foundations.validation import check_features_present


_INT64_MAX = torch.iinfo(torch.int64).max


class IdRemap(torch.nn.Module):
    """Raw int64 ids -> row indices of a static table: the position of the id among the
    sorted live keys, or ``num_keys`` (the default row) for any other id. Torch only
    (``torch.searchsorted``), scriptable and exportable (``torch.jit.script``,
    ``torch.export``); the keys are a buffer, so they travel in its ``state_dict``.

    Args:
        keys: [K] int64 live keys, distinct, any order (sorted here).

    Example::

        >>> from dynemb.serving import IdRemap
        >>> remap = IdRemap(torch.tensor([30, -7, 12]))
        >>> remap(torch.tensor([12, 30, 5, -7, 2**63 - 1]))
        tensor([1, 2, 3, 0, 3])
    """

    def __init__(self, keys: torch.Tensor):
        super().__init__()
        if keys.dtype != torch.int64 or keys.dim() != 1:
            raise TypeError(f"keys must be a 1-d int64 tensor, got {keys.dtype} of shape "
                            f"{tuple(keys.shape)}")
        # sorted keys, then int64 max: searchsorted never runs past the end, and an id equal
        # to int64 max that is not a live key lands on index K, the default row, as it should
        padded = torch.full((keys.numel() + 1,), _INT64_MAX, dtype=torch.int64,
                            device=keys.device)
        padded[:-1] = torch.sort(keys).values
        if keys.numel() > 1 and bool((padded[1:-1] == padded[:-2]).any()):
            raise ValueError("keys must be distinct")
        self.register_buffer("sorted_keys", padded)

    @property
    def keys(self) -> torch.Tensor:
        """[K] the live keys, sorted: key ``keys[i]`` reads row ``i``."""
        return self.sorted_keys[:-1]

    @property
    def num_keys(self) -> int:
        """K, also the index of the default row."""
        return self.sorted_keys.numel() - 1

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[N] int64 row indices of ``ids`` [N] (int64 or int32, on the keys' device)."""
        ids = ids.to(torch.int64)
        rows = torch.searchsorted(self.sorted_keys, ids)
        default = torch.full_like(rows, self.sorted_keys.numel() - 1)
        return torch.where(self.sorted_keys[rows] == ids, rows, default)

    def extra_repr(self) -> str:
        return f"num_keys={self.num_keys}"


def check_remaps(rows_by_table: Mapping[str, int],
                 remaps: Mapping[str, IdRemap]) -> torch.nn.ModuleDict:
    """The remaps of the tables of ``rows_by_table`` (name -> rows of the static table), in
    its order; ``ValueError`` unless each table has one whose keys fill all but its last (the
    default) row."""
    missing = [name for name in rows_by_table if name not in remaps]
    if missing:
        raise ValueError(f"no IdRemap for tables {missing}")
    for name, rows in rows_by_table.items():
        if remaps[name].num_keys + 1 != rows:
            raise ValueError(f"table {name!r}: the remap has {remaps[name].num_keys} keys, "
                             f"the table {rows} rows (keys + the default row)")
    return torch.nn.ModuleDict({name: remaps[name] for name in rows_by_table})


def remap_kjt(kjt: KeyedJaggedTensor, remaps: torch.nn.ModuleDict,
              table_of_feature: Dict[str, str]) -> KeyedJaggedTensor:
    """``kjt`` with each id replaced by its row in its feature's table (same features,
    lengths and per-id weights); the ids of features of no table pass unchanged (the
    collection ignores them, as TorchRec's does)."""
    segments = torch.split(kjt.values(), kjt.length_per_key())
    values: List[torch.Tensor] = [remaps[table_of_feature[f]](ids) if f in table_of_feature
                                  else ids.to(torch.int64)
                                  for f, ids in zip(kjt.keys(), segments)]
    return KeyedJaggedTensor(
        keys=kjt.keys(), lengths=kjt.lengths(), stride=kjt.stride(),
        weights=kjt.weights_or_none(),
        values=(torch.cat(values) if values else
                torch.empty(0, dtype=torch.int64, device=kjt.values().device)))


def table_of_each_feature(configs) -> Dict[str, str]:
    """Feature name -> the one table that reads it; a feature read by several tables raises:
    a static wrapper remaps a feature's raw ids with one table's :class:`IdRemap`."""
    tables: Dict[str, List[str]] = {}
    for config in configs:
        for feature in config.feature_names:
            tables.setdefault(feature, []).append(config.name)
    shared = {f: names for f, names in tables.items() if len(names) > 1}
    if shared:
        raise ValueError(f"features read by several tables {shared} cannot be served by a "
                         f"static wrapper (it remaps each feature's raw ids with one table's "
                         f"IdRemap); remap with each table's IdRemap yourself and run the "
                         f"exported collection")
    return {f: names[0] for f, names in tables.items()}


class RemappedServing(torch.nn.Module):
    """The base of the serving wrappers: one :class:`IdRemap` per table of a static
    collection, each feature's raw ids remapped with its table's.

    Args:
        configs: the static collection's table configs.
        rows_by_table: rows of each static table (its remap's keys plus the default row).
        remaps: the :class:`IdRemap` of each table.
    """

    def __init__(self, configs, rows_by_table: Mapping[str, int],
                 remaps: Mapping[str, IdRemap]):
        super().__init__()
        self.remaps = check_remaps(rows_by_table, remaps)
        self._table_of_feature = table_of_each_feature(configs)

    def remap(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``kjt`` with each id replaced by its row index (same features, lengths and
        weights), for a serving stack that runs the static collection itself."""
        return remap_kjt(kjt, self.remaps, self._table_of_feature)

    def check_features(self, kjt: KeyedJaggedTensor) -> None:
        """Every feature the collection reads must be in ``kjt`` (empty where it has no ids)."""
        check_features_present(kjt.keys(), list(self._table_of_feature))
