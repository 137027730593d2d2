"""Export of trained dynamic tables for serving stacks that have no hash table.

- :func:`iter_rows`: every live ``(key, embedding)`` of one table, in bounded chunks;
- :func:`to_static`: a plain TorchRec ``EmbeddingCollection`` holding the trained rows, and
  per table an :class:`IdRemap` (raw int64 id -> row index: sorted keys and
  ``torch.searchsorted``, no hash table), built by streaming through :func:`iter_rows`;
- :class:`StaticServingCollection`: the two together, ``forward(kjt)`` as the dynamic
  module's eval forward;
- :func:`merge_exports`: one export of several ranks' exports of a sharded module.

Row ``i`` of a static table holds the ``i``-th smallest live key; the last row (index
``num_keys``) is the **default row**, what every unknown id reads. It holds what the dynamic
module returns in eval for an unseen id when that is a constant (``eval_initializer`` of
kind CONSTANT: its value, 0.0 by default); for the other kinds, whose eval rows depend on the
id, it holds zeros.

Shapes: ``N`` ids, ``K`` live keys of a table, ``D`` its embedding dim.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torchrec.modules.embedding_configs import DataType, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from dynemb.checkpoint.table_state import live_chunks
from dynemb.initializers import InitializerKind
from dynemb.validation import check_int

#: Rows read per chunk by default (a chunk's copy is ``chunk_rows`` rows of the table).
CHUNK_ROWS = 1 << 20
_INT64_MAX = torch.iinfo(torch.int64).max
# EmbeddingCollection stores every type but FP32 as float16: bfloat16 rows go to float32
# (exact) rather than be rounded to float16
_DATA_TYPES = {torch.float32: DataType.FP32, torch.float16: DataType.FP16,
               torch.bfloat16: DataType.FP32}


# -- reading the rows -----------------------------------------------------------------------
def iter_rows(module, table: str, *,
              chunk_rows: int = CHUNK_ROWS) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """``(keys [n] int64, embeddings [n, D])`` of every live row of ``table``, each key once,
    at most ``chunk_rows`` rows per chunk; the whole table is never copied at once.

    Embeddings are the embedding columns only (no optimizer state), in the table's dtype, on
    the device of the tier that holds them (the DEFAULT host tier and the CACHE store are on
    the host). A :class:`~dynemb.sharding.ShardedDynamicEmbCollection` yields this rank's
    share. Read between steps: rows the module writes while it is iterated may be seen in
    their old or new state, or missed.

    Raises ``KeyError`` for an unknown table and ``ValueError`` / ``TypeError`` for a
    ``chunk_rows`` that is not a positive int, before anything is read.

    Example::

        >>> from dynemb.checkpoint import iter_rows
        >>> ec = DynamicEmbCollection([EmbeddingConfig(name="t", embedding_dim=4,
        ...                                            num_embeddings=64, feature_names=["f"])])
        >>> _ = ec(KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([5, 9, 12]),
        ...                                            torch.tensor([3])))
        >>> chunks = list(iter_rows(ec, "t", chunk_rows=2))
        >>> sorted(k for keys, _ in chunks for k in keys.tolist())
        [5, 9, 12]
        >>> max(len(keys) for keys, _ in chunks) <= 2, chunks[0][1].shape[1]
        (True, 4)
    """
    dynamic = _table(_local(module), table)
    check_int(chunk_rows, "chunk_rows")
    return _embedding_chunks(dynamic, chunk_rows)


def _embedding_chunks(table, chunk_rows: int):
    for _, keys, _, rows in live_chunks(table, chunk_rows):
        # a user backing store may export more than it was asked for
        for lo in range(0, keys.numel(), chunk_rows):
            yield (keys[lo:lo + chunk_rows],
                   rows[lo:lo + chunk_rows, :table.dim].contiguous())


def _local(module):
    """The DynamicEmbCollection holding ``module``'s rows on this rank."""
    # imported here: dynemb.collection imports this package for its state_dict
    from dynemb.collection import DynamicEmbCollection
    from dynemb.sharding import ShardedDynamicEmbCollection
    if isinstance(module, ShardedDynamicEmbCollection):
        return module.local
    if isinstance(module, DynamicEmbCollection):
        return module
    raise TypeError(f"expected a DynamicEmbCollection or a ShardedDynamicEmbCollection, got "
                    f"{type(module).__name__}")


def _table(local, name: str):
    if name not in local.tables:
        raise KeyError(f"no table {name!r}; tables: {list(local.tables)}")
    return local.tables[name]


# -- id -> row ------------------------------------------------------------------------------
class IdRemap(torch.nn.Module):
    """Raw int64 ids -> row indices of a static table: the position of the id among the
    sorted live keys, or ``num_keys`` (the default row) for any other id. Torch only
    (``torch.searchsorted``), scriptable and exportable (``torch.jit.script``,
    ``torch.export``); the keys are a buffer, so they travel in its ``state_dict``.

    Args:
        keys: [K] int64 live keys, distinct, any order (sorted here).

    Example::

        >>> from dynemb.checkpoint import IdRemap
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


# -- the export -----------------------------------------------------------------------------
class StaticExport(NamedTuple):
    """What :func:`to_static` returns: the static collection and the remaps by table."""

    ec: EmbeddingCollection
    remaps: Dict[str, IdRemap]


def default_value(table) -> float:
    """The value of every column of the default row of a dynamic ``table``: the eval
    initializer's constant, or 0.0 when the eval initializer is not CONSTANT."""
    init = table.options.eval_initializer
    return float(init.value) if init.kind is InitializerKind.CONSTANT else 0.0


def to_static(module, *, device: Optional[torch.device] = None,
              embedding_configs: Optional[Sequence[EmbeddingConfig]] = None,
              chunk_rows: int = CHUNK_ROWS) -> StaticExport:
    """A plain TorchRec ``EmbeddingCollection`` with the trained rows of every dynamic table,
    and per table the :class:`IdRemap` from raw ids to its rows.

    Each static table has the dynamic table's name, dim and feature names, ``K + 1`` rows
    (``K`` live keys, sorted, then the default row: see the module docstring) and the
    table's data type: FP32 or FP16 (bfloat16 rows are stored as FP32, exactly, since
    ``EmbeddingCollection`` holds every non-FP32 type as float16); the collection has the
    module's ``need_indices``. The rows are read twice through :func:`iter_rows` (keys first,
    then rows into place): besides the static module, memory holds one chunk and, while they
    are sorted, a few copies of one table's keys (8 bytes a key). Run it between steps.

    With :class:`StaticServingCollection` the export answers like the dynamic module's eval
    forward, bit for bit, for every live key and for unseen ids when the eval initializer is
    a constant that the table dtype holds exactly (0.0 always is).

    A :class:`~dynemb.sharding.ShardedDynamicEmbCollection` exports this rank's share only:
    ids owned by other ranks read the default row; combine the ranks' exports with
    :func:`merge_exports`.

    Args:
        module: a DynamicEmbCollection or a ShardedDynamicEmbCollection.
        device: where the static module lives (default: the dynamic module's device).
        embedding_configs: the tables to export, and the names, dims and feature names the
            static tables take (default: the module's own configs, every table; required for
            a sharded module).
        chunk_rows: rows read per chunk.

    Raises ``ValueError`` when the tables have different dims (``EmbeddingCollection`` needs
    one dim: export each dim's tables apart) or the configs name tables the module lacks.

    Example::

        >>> from dynemb.checkpoint import StaticServingCollection, to_static
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
    local = _local(module)
    configs = _configs(module, local, embedding_configs)
    check_int(chunk_rows, "chunk_rows")
    device = torch.device(device) if device is not None else local.device
    remaps: Dict[str, IdRemap] = {}
    with torch.no_grad():
        for config in configs:
            remaps[config.name] = _remap_of(local.tables[config.name], device, chunk_rows)
        ec = EmbeddingCollection(
            [_static_config(config, local.tables[config.name], remaps[config.name].num_keys)
             for config in configs], device=device, need_indices=_need_indices(module, local))
        for config in configs:
            _fill(ec.embeddings[config.name].weight, local.tables[config.name],
                  remaps[config.name], chunk_rows)
    return StaticExport(ec, remaps)


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


def _need_indices(module, local) -> bool:
    return module.need_indices()


def _static_config(config: EmbeddingConfig, table, num_keys: int) -> EmbeddingConfig:
    return EmbeddingConfig(name=config.name, embedding_dim=config.embedding_dim,
                           num_embeddings=num_keys + 1, feature_names=list(config.feature_names),
                           data_type=_DATA_TYPES[table.layout.dtype])


def _remap_of(table, device: torch.device, chunk_rows: int) -> IdRemap:
    parts = [keys.to(device) for keys, _ in _embedding_chunks(table, chunk_rows)]
    keys = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=device)
    del parts
    try:
        return IdRemap(keys)
    except ValueError:
        raise ValueError(f"table {table.name!r}: a key is stored twice (in two tiers?); "
                         f"cannot export") from None


def _fill(weight: torch.Tensor, table, remap: IdRemap, chunk_rows: int) -> None:
    """Write each live row at its key's rank; the last row is the default row."""
    written = 0
    for keys, rows in _embedding_chunks(table, chunk_rows):
        keys = keys.to(weight.device)
        where = remap(keys)
        if bool((where == remap.num_keys).any()):
            raise RuntimeError(f"table {table.name!r} changed while it was exported: a key "
                               f"appeared between the two reads")
        weight.index_copy_(0, where, rows.to(weight.device, weight.dtype))
        written += keys.numel()
    if written != remap.num_keys:
        raise RuntimeError(f"table {table.name!r} changed while it was exported: "
                           f"{remap.num_keys} keys, then {written} rows")
    weight[remap.num_keys].fill_(default_value(table))


def merge_exports(exports: Sequence[StaticExport]) -> StaticExport:
    """One export holding the rows of several: the exports of every rank of a sharded module
    (each rank's :func:`to_static`, saved and loaded in one process), whose keys are
    disjoint. Tables, dims, feature names and data types must agree; the default row is the
    first export's. Memory: the inputs, the merged module and one table's keys.

    Example::

        >>> import torchrec
        >>> from dynemb.checkpoint import IdRemap, StaticExport, merge_exports
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
    if not exports:
        raise ValueError("no export to merge")
    shapes = [[(c.name, c.embedding_dim, list(c.feature_names), c.data_type)
               for c in e.ec.embedding_configs()] for e in exports]
    for i, other in enumerate(shapes[1:], 1):
        if other != shapes[0]:
            raise ValueError(f"export {i} has tables {other}, export 0 has {shapes[0]}")
    remaps: Dict[str, IdRemap] = {}
    with torch.no_grad():
        for name, *_ in shapes[0]:
            try:
                remaps[name] = IdRemap(torch.cat([e.remaps[name].keys for e in exports]))
            except ValueError:
                raise ValueError(f"table {name!r}: the exports share keys (exports of "
                                 f"different ranks of one module never do)") from None
        configs = [EmbeddingConfig(name=name, embedding_dim=dim, feature_names=features,
                                   num_embeddings=remaps[name].num_keys + 1, data_type=dtype)
                   for name, dim, features, dtype in shapes[0]]
        ec = EmbeddingCollection(configs, device=exports[0].ec.device,
                                 need_indices=exports[0].ec.need_indices())
        for name, remap in remaps.items():
            weight = ec.embeddings[name].weight
            for e in exports:
                rows = e.ec.embeddings[name].weight
                keys = e.remaps[name].keys.to(weight.device)
                weight.index_copy_(0, remap(keys), rows[:-1].to(weight.device))
            weight[-1].copy_(exports[0].ec.embeddings[name].weight[-1])
    return StaticExport(ec, remaps)


# -- serving --------------------------------------------------------------------------------
class StaticServingCollection(torch.nn.Module):
    """A static export used like the dynamic module: ``forward(kjt)`` maps each feature's
    raw ids to rows with its table's :class:`IdRemap` and runs the ``EmbeddingCollection``;
    float32 outputs per feature, in the KJT's feature order, with the raw ids as weights when
    the collection has ``need_indices``.

    Args:
        ec: the static collection (:func:`to_static`'s ``ec``).
        remaps: its :class:`IdRemap` by table name.

    Example::

        >>> from dynemb.checkpoint import IdRemap, StaticServingCollection
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
        super().__init__()
        configs = ec.embedding_configs()
        missing = [c.name for c in configs if c.name not in remaps]
        if missing:
            raise ValueError(f"no IdRemap for tables {missing}")
        for c in configs:
            rows = ec.embeddings[c.name].weight.shape[0]
            if remaps[c.name].num_keys + 1 != rows:
                raise ValueError(f"table {c.name!r}: the remap has {remaps[c.name].num_keys} "
                                 f"keys, the table {rows} rows (keys + the default row)")
        self.ec = ec
        self.remaps = torch.nn.ModuleDict({c.name: remaps[c.name] for c in configs})
        self._table_of_feature = {f: c.name for c in configs for f in c.feature_names}

    def remap(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``kjt`` with each id replaced by its row index (same features and lengths), for a
        serving stack that runs the ``EmbeddingCollection`` itself."""
        unknown = [f for f in kjt.keys() if f not in self._table_of_feature]
        if unknown:
            raise ValueError(f"features {unknown} are in no table; known features: "
                             f"{sorted(self._table_of_feature)}")
        segments = torch.split(kjt.values(), kjt.length_per_key())
        values = [self.remaps[self._table_of_feature[f]](ids)
                  for f, ids in zip(kjt.keys(), segments)]
        return KeyedJaggedTensor(
            keys=kjt.keys(), lengths=kjt.lengths(), stride=kjt.stride(),
            values=(torch.cat(values) if values else
                    torch.empty(0, dtype=torch.int64, device=kjt.values().device)))

    def forward(self, kjt: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        out = self.ec(self.remap(kjt))
        if not self.ec.need_indices():
            return {f: out[f] for f in kjt.keys()}
        ids = kjt.to_dict()
        return {f: JaggedTensor(values=out[f].values(), lengths=out[f].lengths(),
                                weights=ids[f].values()) for f in kjt.keys()}
