"""Serving export of pooled modules: a :class:`~dynemb.DynamicEmbBagCollection` (or its sharded
form) as a plain TorchRec ``EmbeddingBagCollection`` plus an :class:`IdRemap` per table.

- :func:`export_bags`: what :func:`~dynemb.serving.to_static` does for a pooled module;
- :func:`merge_bag_exports`: what :func:`~dynemb.serving.merge_exports` does for pooled
  exports (the ranks' shares of a sharded module);
- :class:`StaticServingBagCollection`: the export used like the dynamic module,
  ``forward(kjt) -> KeyedTensor`` equal to its eval forward.

The static tables follow the sequence export's layout (row ``i``: the ``i``-th smallest live
key; the last row: the default row, see :mod:`dynemb.serving`). Every table is
stored as FP32 whatever the dynamic table's dtype (float16 and bfloat16 convert exactly):
``nn.EmbeddingBag`` pools float16 rows in float16, while the dynamic module pools in float32.

Shapes: ``B`` samples, ``K`` live keys of a table.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence

import torch
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from dynemb.serving.remap import IdRemap, RemappedServing
from dynemb.serving.tables import export_tables, merge_tables


class StaticBagExport(NamedTuple):
    """What :func:`~dynemb.serving.to_static` returns for a pooled module: the static
    ``EmbeddingBagCollection`` and the remaps by table."""

    ebc: EmbeddingBagCollection
    remaps: Dict[str, IdRemap]


def export_bags(module, local, device: torch.device,
                embedding_configs: Optional[Sequence[EmbeddingBagConfig]],
                chunk_rows: int) -> StaticBagExport:
    """The static ``EmbeddingBagCollection`` of pooled ``module`` (a DynamicEmbBagCollection
    or its sharded form, whose rows on this rank are in ``local``): per table of
    ``embedding_configs`` (default: the module's) its name, dim, feature names and pooling,
    FP32 rows (``K + 1``), the module's ``is_weighted``; tables may have different dims.
    Called by :func:`~dynemb.serving.to_static` (which see for the arguments).

    Example::

        >>> from dynemb.serving import StaticServingBagCollection, to_static
        >>> from torchrec import EmbeddingBagConfig, PoolingType
        >>> dyn = DynamicEmbBagCollection([EmbeddingBagConfig(
        ...     name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"],
        ...     pooling=PoolingType.MEAN)])
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([5, 9, 12]),
        ...                                           torch.tensor([2, 1]))
        >>> _ = dyn(kjt)  # a training forward inserts the three ids
        >>> ebc, remaps = to_static(dyn)
        >>> type(ebc).__name__, ebc.embedding_bags["t"].weight.shape
        ('EmbeddingBagCollection', torch.Size([4, 4]))
        >>> serving = StaticServingBagCollection(ebc, remaps)
        >>> probe = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([9, 7, 12]),
        ...                                             torch.tensor([2, 1]))
        >>> torch.equal(serving(probe).values(), dyn.eval()(probe).values())
        True
    """
    configs = _bag_configs(module, local, embedding_configs)
    is_weighted = module.is_weighted()
    static, remaps = export_tables(
        local, [c.name for c in configs], device, chunk_rows,
        lambda rows: EmbeddingBagCollection([_static_bag_config(c, rows[c.name])
                                             for c in configs],
                                            is_weighted=is_weighted, device=device),
        _ebc_weights)
    return StaticBagExport(static, remaps)


def _bag_configs(module, local, given) -> List[EmbeddingBagConfig]:
    """``given`` (or the module's configs) checked against the module's tables: each known,
    once, an ``EmbeddingBagConfig`` with the table's dim and pooling."""
    pooling = {c.name: c.pooling for c in module.embedding_bag_configs()}
    configs = list(module.embedding_bag_configs() if given is None else given)
    names = [getattr(c, "name", None) for c in configs]
    if not configs or any(n not in local.tables for n in names) or len(set(names)) != len(names):
        raise ValueError(f"embedding_configs name tables {names}: each must be one of the "
                         f"module's tables {list(local.tables)}, once")
    for c in configs:
        if not isinstance(c, EmbeddingBagConfig):
            raise TypeError(f"table {c.name!r}: a pooled module exports EmbeddingBagConfigs, "
                            f"got {type(c).__name__}")
        if c.embedding_dim != local.tables[c.name].dim:
            raise ValueError(f"table {c.name!r}: embedding_dim {c.embedding_dim} in the "
                             f"configs, {local.tables[c.name].dim} in the module")
        if c.pooling != pooling[c.name]:
            raise ValueError(f"table {c.name!r}: pooling {c.pooling.name} in the configs, "
                             f"{pooling[c.name].name} in the module")
    return configs


def _static_bag_config(config: EmbeddingBagConfig, num_rows: int) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(name=config.name, embedding_dim=config.embedding_dim,
                              num_embeddings=num_rows, feature_names=list(config.feature_names),
                              data_type=DataType.FP32, pooling=config.pooling)


def _ebc_weights(ebc: EmbeddingBagCollection) -> Dict[str, torch.Tensor]:
    return {name: bag.weight for name, bag in ebc.embedding_bags.items()}


def _ebc_signature(ebc: EmbeddingBagCollection) -> List:
    return [("is_weighted", ebc.is_weighted())] + [
        (c.name, c.embedding_dim, list(c.feature_names), c.data_type, c.pooling)
        for c in ebc.embedding_bag_configs()]


def _ebc_like(first: EmbeddingBagCollection, rows: Dict[str, int]) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        [EmbeddingBagConfig(name=c.name, embedding_dim=c.embedding_dim,
                            feature_names=list(c.feature_names), num_embeddings=rows[c.name],
                            data_type=c.data_type, pooling=c.pooling)
         for c in first.embedding_bag_configs()],
        is_weighted=first.is_weighted(), device=first.device)


def merge_bag_exports(exports: Sequence[StaticBagExport]) -> StaticBagExport:
    """One pooled export holding the rows of several (each rank's export of a sharded
    pooled module); see :func:`~dynemb.serving.merge_exports`, which calls it."""
    return StaticBagExport(*merge_tables(list(exports), _ebc_signature, _ebc_like,
                                         _ebc_weights))


class StaticServingBagCollection(RemappedServing):
    """A pooled static export used like the dynamic module: ``forward(kjt)`` maps each
    feature's raw ids to rows with its table's :class:`IdRemap` (per-id weights kept) and
    runs the ``EmbeddingBagCollection``: a ``KeyedTensor`` [B, sum of dims], float32, keyed
    by feature in config order. As for the dynamic module, every feature of the collection
    must be in the KJT, with per-id weights exactly when the collection is weighted.

    Args:
        ebc: the static collection (:func:`~dynemb.serving.to_static`'s ``ebc``).
        remaps: its :class:`IdRemap` by table name.

    Example::

        >>> from dynemb.serving import IdRemap, StaticServingBagCollection
        >>> import torchrec
        >>> ebc = torchrec.EmbeddingBagCollection([torchrec.EmbeddingBagConfig(
        ...     name="t", embedding_dim=2, num_embeddings=3, feature_names=["f"])])
        >>> ebc.embedding_bags["t"].weight.data[:] = torch.tensor([[1., 1.], [2., 2.],
        ...                                                         [0., 0.]])
        >>> serving = StaticServingBagCollection(ebc, {"t": IdRemap(torch.tensor([70, 10]))})
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([70, 10, 5]),
        ...                                           torch.tensor([2, 1]))
        >>> serving.remap(kjt).values()
        tensor([1, 0, 2])
        >>> serving(kjt).values().tolist()  # id 5 is unknown: the default row
        [[3.0, 3.0], [0.0, 0.0]]
    """

    def __init__(self, ebc: EmbeddingBagCollection, remaps: Dict[str, IdRemap]):
        if not isinstance(ebc, EmbeddingBagCollection):
            raise TypeError(f"expected a TorchRec EmbeddingBagCollection, got "
                            f"{type(ebc).__name__} (sequence exports: "
                            f"StaticServingCollection)")
        configs = ebc.embedding_bag_configs()
        super().__init__(configs, {c.name: ebc.embedding_bags[c.name].weight.shape[0]
                                   for c in configs}, remaps)
        self.ebc = ebc

    def forward(self, kjt: KeyedJaggedTensor) -> KeyedTensor:
        self.check_features(kjt)
        if self.ebc.is_weighted() and kjt.weights_or_none() is None:
            # an unweighted collection ignores weights, as TorchRec's and the dynamic one do
            raise ValueError("the collection is weighted but the KJT has no weights")
        return self.ebc(self.remap(kjt))
