"""The export itself: :func:`to_static` (any dynamic module: sequence here, pooled in
:mod:`dynemb.serving.pooled`), :func:`merge_exports` (several ranks' exports of a sharded
module) and :class:`StaticServingCollection` (a sequence export served, ``forward(kjt)`` as
the dynamic module's eval forward). The rows and default row of a static table:
:mod:`dynemb.serving.tables`.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Union

import torch
from torchrec.modules.embedding_configs import DataType, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from dynemb.module_interface import is_pooled
from dynemb.serving.pooled import StaticBagExport, export_bags, merge_bag_exports
from dynemb.serving.remap import IdRemap, RemappedServing
from dynemb.serving.tables import (CHUNK_ROWS, export_tables, local_collection, merge_tables,
                                   warn_if_unseen_ids_differ)

__all__ = ["StaticExport", "StaticServingCollection", "merge_exports", "to_static"]

# EmbeddingCollection stores every type but FP32 as float16: bfloat16 rows go to float32
# (exact) rather than be rounded to float16
_DATA_TYPES = {torch.float32: DataType.FP32, torch.float16: DataType.FP16,
               torch.bfloat16: DataType.FP32}


class StaticExport(NamedTuple):
    """What :func:`to_static` returns for a sequence module: the static collection and the
    remaps by table."""

    ec: EmbeddingCollection
    remaps: Dict[str, IdRemap]


def to_static(module, *, device: Optional[torch.device] = None,
              embedding_configs: Optional[Sequence[EmbeddingConfig]] = None,
              chunk_rows: int = CHUNK_ROWS) -> Union[StaticExport, StaticBagExport]:
    """A plain TorchRec module with the trained rows of every dynamic table, and per table
    the :class:`IdRemap` from raw ids to its rows: a :class:`StaticExport` (an
    ``EmbeddingCollection``) for a sequence module, a :class:`StaticBagExport` (an
    ``EmbeddingBagCollection``, same pooling and ``is_weighted``: see
    :func:`~dynemb.serving.pooled.export_bags`) for a pooled one.

    Each static table has the dynamic table's name, dim and feature names and ``K + 1`` rows
    (``K`` live keys, sorted, then the default row: see :mod:`dynemb.serving`). In a sequence
    export it has the table's data type, FP32 or FP16 (bfloat16 rows are stored as FP32,
    exactly, since ``EmbeddingCollection`` holds every non-FP32 type as float16), and the
    collection has the module's ``need_indices``; a pooled export is FP32 throughout. The rows
    are read twice through :func:`~dynemb.serving.tables.iter_rows` (keys first, then rows into
    place): besides the static module, memory holds one chunk and, while they
    are sorted, a few copies of one table's keys (8 bytes a key). Run it between steps.

    With :class:`StaticServingCollection` the export answers like the dynamic module's eval
    forward, bit for bit, for every live key and for unseen ids when the eval initializer is
    a constant that the table dtype holds exactly (0.0 always is). A table whose eval
    initializer is not CONSTANT gets a ``UserWarning``: its unseen ids read the default row
    (zeros) in the export, not the dynamic module's id-dependent eval rows.

    A sharded module (:class:`~dynemb.sharding.ShardedDynamicEmbCollection`,
    :class:`~dynemb.sharding.ShardedDynamicEmbBagCollection`) exports this rank's share
    only: ids owned by other ranks read the default row; combine the ranks' exports with
    :func:`merge_exports`.

    Args:
        module: a DynamicEmbCollection or DynamicEmbBagCollection, or its sharded form.
        device: where the static module lives (default: the dynamic module's device).
        embedding_configs: the tables to export, and the names, dims and feature names the
            static tables take (default: the module's own configs, every table);
            ``EmbeddingBagConfig``\\ s with the module's pooling for a pooled module.
        chunk_rows: rows read per chunk.

    Raises ``ValueError`` when the tables of a sequence module have different dims
    (``EmbeddingCollection`` needs one dim: export each dim's tables apart) or the configs
    name tables the module lacks.

    Example::

        >>> from dynemb.serving import StaticServingCollection, to_static
        >>> dyn = DynamicEmbCollection([EmbeddingConfig(
        ...     name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"])])
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([5, 9, 12]),
        ...                                           torch.tensor([3]))
        >>> _ = dyn(kjt)  # a training forward inserts the three ids
        >>> ec, remaps = to_static(dyn)
        >>> ec.embeddings["t"].weight.shape, remaps["t"].keys.tolist()
        (torch.Size([4, 4]), [5, 9, 12])
        >>> serving = StaticServingCollection(ec, remaps)
        >>> probe = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([9, 7]),
        ...                                             torch.tensor([2]))
        >>> torch.equal(serving(probe)["f"].values(), dyn.eval()(probe)["f"].values())
        True
    """
    local = local_collection(module)
    device = torch.device(device) if device is not None else local.device
    export = (export_bags if is_pooled(module) else _export_sequence)(
        module, local, device, embedding_configs, chunk_rows)
    warn_if_unseen_ids_differ(local.tables, list(export.remaps))
    return export


def _export_sequence(module, local, device: torch.device,
                     embedding_configs: Optional[Sequence[EmbeddingConfig]],
                     chunk_rows: int) -> StaticExport:
    """:func:`to_static` of a sequence module, whose rows on this rank are in ``local``."""
    configs = _configs(module, local, embedding_configs)
    need_indices = module.need_indices()
    return StaticExport(*export_tables(
        local, [c.name for c in configs], device, chunk_rows,
        lambda rows: EmbeddingCollection(
            [_static_config(c, local.tables[c.name], rows[c.name]) for c in configs],
            device=device, need_indices=need_indices),
        _ec_weights))


def _configs(module, local, given) -> List[EmbeddingConfig]:
    if given is None:
        given = module.embedding_configs()
    configs = list(given)
    names = [c.name for c in configs]
    unknown = [n for n in names if n not in local.tables]
    if not configs or unknown or len(set(names)) != len(names):
        raise ValueError(f"embedding_configs name tables {names}: each must be one of the "
                         f"module's tables {list(local.tables)}, once")
    for c in configs:
        if c.embedding_dim != local.tables[c.name].dim:
            raise ValueError(f"table {c.name!r}: embedding_dim {c.embedding_dim} in the "
                             f"configs, {local.tables[c.name].dim} in the module")
    dims = sorted({c.embedding_dim for c in configs})
    if len(dims) > 1:
        raise ValueError(f"tables have different embedding dims {dims}: a TorchRec "
                         f"EmbeddingCollection needs one; export the tables of each dim "
                         f"apart (embedding_configs=...)")
    return configs


def _static_config(config: EmbeddingConfig, table, num_rows: int) -> EmbeddingConfig:
    return EmbeddingConfig(name=config.name, embedding_dim=config.embedding_dim,
                           num_embeddings=num_rows, feature_names=list(config.feature_names),
                           data_type=_DATA_TYPES[table.layout.dtype])


def _ec_weights(ec: EmbeddingCollection) -> Dict[str, torch.Tensor]:
    return {name: module.weight for name, module in ec.embeddings.items()}


def _ec_signature(ec: EmbeddingCollection) -> List:
    return [(c.name, c.embedding_dim, list(c.feature_names), c.data_type)
            for c in ec.embedding_configs()]


def _ec_like(first: EmbeddingCollection, rows: Dict[str, int]) -> EmbeddingCollection:
    return EmbeddingCollection(
        [EmbeddingConfig(name=c.name, embedding_dim=c.embedding_dim,
                         feature_names=list(c.feature_names), num_embeddings=rows[c.name],
                         data_type=c.data_type) for c in first.embedding_configs()],
        device=first.device, need_indices=first.need_indices())


def merge_exports(exports: Sequence[Union[StaticExport, StaticBagExport]]
                  ) -> Union[StaticExport, StaticBagExport]:
    """One export holding the rows of several: the exports of every rank of a sharded module
    (each rank's :func:`to_static`, saved and loaded in one process), whose keys are
    disjoint. All sequence (:class:`StaticExport`) or all pooled (:class:`StaticBagExport`,
    which must also agree on pooling and ``is_weighted``); tables, dims, feature names and
    data types must agree; the default row is the first export's. Memory: the inputs, the
    merged module and one table's keys.

    Example::

        >>> import torchrec
        >>> from dynemb.serving import IdRemap, StaticExport, merge_exports
        >>> def export(keys, value):
        ...     ec = torchrec.EmbeddingCollection([EmbeddingConfig(
        ...         name="t", embedding_dim=2, num_embeddings=len(keys) + 1,
        ...         feature_names=["f"])])
        ...     ec.embeddings["t"].weight.data[:] = value
        ...     return StaticExport(ec, {"t": IdRemap(torch.tensor(keys))})
        >>> ec, remaps = merge_exports([export([4, 1], 1.0), export([3], 2.0)])
        >>> remaps["t"].keys.tolist(), ec.embeddings["t"].weight[:, 0].tolist()
        ([1, 3, 4], [1.0, 2.0, 1.0, 1.0])
    """
    exports = list(exports)
    pooled = [isinstance(e[0], EmbeddingBagCollection) for e in exports]
    if any(pooled):
        if not all(pooled):
            raise ValueError(f"cannot merge pooled and sequence exports (export i is pooled: "
                             f"{pooled})")
        return merge_bag_exports(exports)
    return StaticExport(*merge_tables(exports, _ec_signature, _ec_like, _ec_weights))


# -- serving --------------------------------------------------------------------------------
class StaticServingCollection(RemappedServing):
    """A static export used like the dynamic module: ``forward(kjt)`` maps each feature's
    raw ids to rows with its table's :class:`IdRemap` and runs the ``EmbeddingCollection``;
    float32 outputs per feature, in the config's order (TorchRec's), with the raw ids as
    weights when the collection has ``need_indices``. Pooled exports are served by
    :class:`~dynemb.serving.pooled.StaticServingBagCollection`.

    Args:
        ec: the static collection (:func:`to_static`'s ``ec``).
        remaps: its :class:`IdRemap` by table name.

    Example::

        >>> from dynemb.serving import IdRemap, StaticServingCollection
        >>> import torchrec
        >>> ec = torchrec.EmbeddingCollection([EmbeddingConfig(
        ...     name="t", embedding_dim=2, num_embeddings=3, feature_names=["f"])])
        >>> ec.embeddings["t"].weight.data[:] = torch.tensor([[1., 1.], [2., 2.], [0., 0.]])
        >>> serving = StaticServingCollection(ec, {"t": IdRemap(torch.tensor([70, 10]))})
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([70, 5]),
        ...                                           torch.tensor([1, 1]))
        >>> serving.remap(kjt).values()
        tensor([1, 2])
        >>> serving(kjt)["f"].values().tolist()  # id 5 is unknown: the default row
        [[2.0, 2.0], [0.0, 0.0]]
    """

    def __init__(self, ec: EmbeddingCollection, remaps: Dict[str, IdRemap]):
        if not isinstance(ec, EmbeddingCollection):
            raise TypeError(f"expected a TorchRec EmbeddingCollection, got "
                            f"{type(ec).__name__} (pooled exports: "
                            f"StaticServingBagCollection)")
        configs = ec.embedding_configs()
        super().__init__(configs, {c.name: ec.embeddings[c.name].weight.shape[0]
                                   for c in configs}, remaps)
        self.ec = ec

    def forward(self, kjt: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        self.check_features(kjt)
        out = self.ec(self.remap(kjt))
        if not self.ec.need_indices():
            return out
        ids = kjt.to_dict()  # the raw ids, not the rows they were remapped to
        return {f: JaggedTensor(values=jt.values(), lengths=jt.lengths(),
                                weights=ids[f].values()) for f, jt in out.items()}
