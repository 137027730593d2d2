"""Rows of dynamic tables into static ones: what the sequence export
(:mod:`dynemb.serving.export`) and the pooled one (:mod:`dynemb.serving.pooled`)
share.

- :func:`iter_rows`: every live ``(key, embedding)`` of one table, in bounded chunks;
- :func:`export_tables`: the static module of some tables and their :class:`IdRemap`\\ s,
  streamed through :func:`iter_rows`;
- :func:`merge_tables`: one static module holding the rows of several (ranks' exports).

Row ``i`` of a static table holds the ``i``-th smallest live key; the last row (index
``num_keys``) is the **default row**, what every unknown id reads: the table's
``eval_initializer`` value when that is CONSTANT, else zeros (:func:`default_value`).

Shapes: ``K`` live keys of a table, ``D`` its embedding dim.
"""
from __future__ import annotations

import warnings
from typing import Callable, Dict, Iterator, List, Sequence, Tuple

import torch

from dynemb.checkpoint.table_state import live_chunks
from dynemb.rows.initializers import InitializerKind
from dynemb.module_interface import DynamicModuleInterface, local_module
from dynemb.serving.remap import IdRemap
from dynemb.foundations.validation import check_int

#: Rows read per chunk by default (a chunk's copy is ``chunk_rows`` rows of the table).
CHUNK_ROWS = 1 << 20

#: A static module (``EmbeddingCollection`` or ``EmbeddingBagCollection``) -> its weights.
WeightsOf = Callable[[torch.nn.Module], Dict[str, torch.Tensor]]


# -- reading the rows -----------------------------------------------------------------------
def iter_rows(module, table: str, *,
              chunk_rows: int = CHUNK_ROWS) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """``(keys [n] int64, embeddings [n, D])`` of every live row of ``table``, each key once,
    at most ``chunk_rows`` rows per chunk; the whole table is never copied at once.

    Embeddings are the embedding columns only (no optimizer state), in the table's dtype, on
    the device of the tier that holds them (the DEFAULT host tier and the CACHE store are on
    the host). A sharded module (:class:`~dynemb.sharding.ShardedDynamicEmbCollection`,
    :class:`~dynemb.sharding.ShardedDynamicEmbBagCollection`) yields this rank's share. Read
    between steps: rows the module writes while it is iterated may be seen in their old or
    new state, or missed.

    Raises ``KeyError`` for an unknown table and ``ValueError`` / ``TypeError`` for a
    ``chunk_rows`` that is not a positive int, before anything is read.

    Example::

        >>> from dynemb.serving import iter_rows
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
    local = local_collection(module)
    if table not in local.tables:
        raise KeyError(f"no table {table!r}; tables: {list(local.tables)}")
    check_int(chunk_rows, "chunk_rows")
    return embedding_chunks(local.tables[table], chunk_rows)


def embedding_chunks(table, chunk_rows: int):
    """``(keys, embeddings)`` of ``table``'s live rows, at most ``chunk_rows`` per chunk."""
    for _, keys, _, rows in live_chunks(table, chunk_rows):
        # a user backing store may export more than it was asked for
        for lo in range(0, keys.numel(), chunk_rows):
            yield (keys[lo:lo + chunk_rows],
                   rows[lo:lo + chunk_rows, :table.dim].contiguous())


def local_collection(module) -> DynamicModuleInterface:
    """The dynamic module holding ``module``'s rows on this rank: the module itself, or a
    sharded module's ``local`` share."""
    local = local_module(module)
    if local is None:
        raise TypeError(f"expected a DynamicEmbCollection, a DynamicEmbBagCollection or their "
                        f"sharded form, got {type(module).__name__}")
    if local.device.type == "meta":
        raise RuntimeError(f"this {type(module).__name__} is on the meta device and holds no "
                           f"rows to read: shard it (DistributedModelParallel with its dynemb "
                           f"sharder), materialize it with .to_empty(device=...), or build it "
                           f"on a real device")
    local.rows_in_place()
    return local


# -- the default row ------------------------------------------------------------------------
def default_value(table) -> float:
    """The value of every column of the default row of a dynamic ``table``: the eval
    initializer's constant, or 0.0 when the eval initializer is not CONSTANT."""
    init = table.options.eval_initializer
    return float(init.value) if init.kind is InitializerKind.CONSTANT else 0.0


def warn_if_unseen_ids_differ(tables: Dict[str, object], names: Sequence[str]) -> None:
    """``UserWarning`` naming the tables of ``names`` whose eval initializer is not CONSTANT:
    for unseen ids the dynamic module's eval gives an id-dependent row, the export its
    default row of zeros."""
    differ = {name: tables[name].options.eval_initializer.kind.name for name in names
              if tables[name].options.eval_initializer.kind is not InitializerKind.CONSTANT}
    if differ:
        warnings.warn(
            f"tables {sorted(differ)} have a non-constant eval_initializer "
            f"({', '.join(f'{n}: {k}' for n, k in sorted(differ.items()))}): in the static "
            f"export every unseen id reads the default row (zeros), while the dynamic "
            f"module's eval gives each unseen id its own initializer row; outputs for unseen "
            f"ids will differ from the dynamic module (use a CONSTANT eval_initializer to "
            f"export them exactly)", UserWarning, stacklevel=3)


# -- dynamic tables -> static weights -------------------------------------------------------
def export_tables(local, names: Sequence[str], device: torch.device, chunk_rows: int,
                  build: Callable[[Dict[str, int]], torch.nn.Module],
                  weights_of: WeightsOf) -> Tuple[torch.nn.Module, Dict[str, IdRemap]]:
    """``(static, remaps)``: ``build(rows by table)`` filled with the live rows of the tables
    ``names`` of ``local``, each at its key's rank, then the default row."""
    check_int(chunk_rows, "chunk_rows")
    remaps: Dict[str, IdRemap] = {}
    with torch.no_grad():
        for name in names:
            remaps[name] = _remap_of(local.tables[name], device, chunk_rows)
        static = build({name: remap.num_keys + 1 for name, remap in remaps.items()})
        weights = weights_of(static)
        for name in names:
            _fill(weights[name], local.tables[name], remaps[name], chunk_rows)
    return static, remaps


def _remap_of(table, device: torch.device, chunk_rows: int) -> IdRemap:
    parts = [keys.to(device) for keys, _ in embedding_chunks(table, chunk_rows)]
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
    for keys, rows in embedding_chunks(table, chunk_rows):
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


# -- several exports -> one -----------------------------------------------------------------
def merge_tables(parts: Sequence[Tuple[torch.nn.Module, Dict[str, IdRemap]]],
                 signature: Callable[[torch.nn.Module], List],
                 build: Callable[[torch.nn.Module, Dict[str, int]], torch.nn.Module],
                 weights_of: WeightsOf) -> Tuple[torch.nn.Module, Dict[str, IdRemap]]:
    """``(static, remaps)`` holding the rows of every ``(static, remaps)`` of ``parts``, whose
    keys are disjoint and whose ``signature`` (tables, dims, features, types) agree:
    ``build(first static, rows by table)`` filled; the default row is the first part's."""
    if not parts:
        raise ValueError("no export to merge")
    shapes = [signature(static) for static, _ in parts]
    for i, other in enumerate(shapes[1:], 1):
        if other != shapes[0]:
            raise ValueError(f"export {i} has tables {other}, export 0 has {shapes[0]}")
    first = weights_of(parts[0][0])
    remaps: Dict[str, IdRemap] = {}
    with torch.no_grad():
        for name in first:
            try:
                remaps[name] = IdRemap(torch.cat([r[name].keys for _, r in parts]))
            except ValueError:
                raise ValueError(f"table {name!r}: the exports share keys (exports of "
                                 f"different ranks of one module never do)") from None
        static = build(parts[0][0], {n: remap.num_keys + 1 for n, remap in remaps.items()})
        for name, weight in weights_of(static).items():
            for part, part_remaps in parts:
                rows = weights_of(part)[name]
                keys = part_remaps[name].keys.to(weight.device)
                weight.index_copy_(0, remaps[name](keys), rows[:-1].to(weight.device))
            weight[-1].copy_(first[name][-1])
    return static, remaps
