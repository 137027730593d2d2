"""TorchRec-shaped descriptions of a dynamic module's tables: ``ec.embeddings[name]`` /
``ebc.embedding_bags[name]`` and their ``.weight``, for code that reads where a table lives
and how large it is (its device, dtype, ``num_embeddings`` and ``embedding_dim``).

TorchRec's modules hold one ``nn.Embedding(Bag)`` per table, whose ``weight`` is the table.
A dynamic table is a hash table of rows created on first sight, not a tensor, so the views
describe it and hold no values: ``weight.device``, ``weight.dtype`` and ``weight.shape``
(``[num_embeddings, embedding_dim]``, the config's, as TorchRec's weight) answer as
TorchRec's; anything that would read or write values (``weight.data``, ``weight[ids]``,
``weight.copy_(...)``, ``torch.nn.init.*(weight)``) raises, naming what reads and writes
rows instead (``read_rows``, ``dynemb.serving.iter_rows``, ``load_tables``).
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Mapping, Optional

import torch
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, data_type_to_dtype

from dynemb.options import DynamicEmbTableOptions

_NO_VALUES = ("a dynamic table is a hash table of rows created on first sight, not a "
              "tensor: read rows with module.read_rows(table, ids) or "
              "dynemb.serving.iter_rows(module, table), write them with module.load_tables "
              "or a state_dict; the view only tells the table's device, dtype and shape")


class TableWeightView:
    """What ``.weight`` of a table view gives: the table's ``device``, ``dtype`` and
    ``shape`` (``[num_embeddings, embedding_dim]``), no values.

    Example::

        >>> ec = DynamicEmbCollection([EmbeddingConfig(
        ...     name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"])])
        >>> weight = ec.embeddings["t"].weight
        >>> weight.device, weight.dtype, weight.shape
        (device(type='cpu'), torch.float32, torch.Size([64, 4]))
        >>> weight.data
        Traceback (most recent call last):
        AttributeError: ...weight of table 't' has no 'data': a dynamic table is a hash ...
    """

    def __init__(self, table: str, shape: torch.Size, dtype: torch.dtype,
                 device: torch.device):
        self.table = table
        self.shape = shape
        self.dtype = dtype
        self.device = device

    def size(self, dim: Optional[int] = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self.shape)

    @property
    def is_meta(self) -> bool:
        return self.device.type == "meta"

    def __getattr__(self, name: str) -> Any:  # only for names not set above
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"the weight of table {self.table!r} has no {name!r}: "
                             f"{_NO_VALUES}")

    def __getitem__(self, index) -> Any:
        raise TypeError(f"the weight of table {self.table!r} cannot be indexed: {_NO_VALUES}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"{getattr(func, '__name__', func)} cannot take the weight of a "
                        f"dynamic table: {_NO_VALUES}")

    def __repr__(self) -> str:
        return (f"TableWeightView(table={self.table!r}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype}, device={self.device})")


class TableView:
    """What ``embeddings[name]`` / ``embedding_bags[name]`` gives: a table's
    ``num_embeddings``, ``embedding_dim`` and :class:`TableWeightView` ``weight``, where
    TorchRec's module has an ``nn.Embedding(Bag)``."""

    def __init__(self, config: BaseEmbeddingConfig, dtype: torch.dtype,
                 device: torch.device):
        self.name = config.name
        self.num_embeddings = config.num_embeddings
        self.embedding_dim = config.embedding_dim
        self.weight = TableWeightView(
            config.name, torch.Size([config.num_embeddings, config.embedding_dim]), dtype,
            device)

    def __repr__(self) -> str:
        return (f"TableView({self.name!r}, num_embeddings={self.num_embeddings}, "
                f"embedding_dim={self.embedding_dim}, device={self.weight.device})")


class TableViews(Mapping[str, TableView]):
    """A read-only mapping, table name -> :class:`TableView`, in config order (as TorchRec's
    ``ModuleDict`` of tables)."""

    def __init__(self, views: List[TableView]):
        self._views: Dict[str, TableView] = {view.name: view for view in views}

    def __getitem__(self, name: str) -> TableView:
        if name not in self._views:
            raise KeyError(f"no table {name!r}; tables: {list(self._views)}")
        return self._views[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)

    def __repr__(self) -> str:
        return f"TableViews({list(self._views.values())})"


def table_views(configs: List[BaseEmbeddingConfig],
                options: Mapping[str, DynamicEmbTableOptions],
                device: torch.device) -> TableViews:
    """One :class:`TableView` per config: its storage dtype is ``embedding_dtype`` when the
    table's options set one, else the config's ``data_type``."""
    return TableViews([
        TableView(config, options[config.name].embedding_dtype
                  or data_type_to_dtype(config.data_type), device)
        for config in configs])
