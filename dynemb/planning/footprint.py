"""The footprint model: the bytes one rank spends on one row-wise sharded dynamic table.

A dynamic table on one rank holds the device rows its options allow (values and optimizer
state side by side), the per-slot arrays of its hash table, an admission counter, a few
counters, and in CACHE / DEFAULT mode a host tier with its own hash table (HOST_ONLY: that
host tier alone, no device rows nor device hash table). The sizing rules
belong to the table layer (the storage policy's ``planned_rows`` and ``backing_store``,
:mod:`dynemb.tables.policies`; ``fixed_memory`` of :mod:`dynemb.tables`,
:func:`dynemb.rows.admission.counter_slots`,
:data:`dynemb.rows.hash_table.SLOT_BYTES`); this module adds the pipeline's I/O the way TorchRec's
planner counts it.

Capacity headroom: unless ``max_capacity`` is set, a rank's table has room for its share of
``num_embeddings`` distinct ids without evicting, which takes more slots than ids because
keys fill the hash buckets unevenly (:func:`dynemb.rows.hash_table_checks.slots_for_keys`: with
buckets of 128, 1.66x the ids at 1,000 per rank, 1.86x at a million, 2.1x at a billion).
Every slot holds a row (values and optimizer state) and 20 bytes of hash metadata, so the
footprint, like the table, counts the slots, not the ids: 1024 ids on 2 ranks below are
896 slots per rank.

Example::

    >>> config = EmbeddingConfig(name="items", embedding_dim=16, num_embeddings=1024,
    ...                          feature_names=["item"])
    >>> fp = table_footprint(config, DynamicEmbTableOptions(), OptimizerConfig(), world_size=2)
    >>> fp.storage()  # what the planner reserves for the shard
    Storage(hbm=75360, ddr=0, ssd=0)
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torchrec.distributed.planner.constants import BIGINT_DTYPE, NUM_POOLINGS, POOLING_FACTOR
from torchrec.distributed.planner.shard_estimators import calculate_pipeline_io_cost
from torchrec.distributed.planner.types import ParameterConstraints, Storage
from torchrec.distributed.types import PipelineType
from torchrec.modules.embedding_configs import EmbeddingConfig, data_type_to_dtype

from dynemb.rows.admission import counter_slots
from dynemb.rows.flat_table import RowLayout
from dynemb.rows.hash_table import SLOT_BYTES
from dynemb.module_interface import DynamicModuleInterface, find_dynamic_modules, is_pooled
from dynemb.rows.optimizers import OptimizerConfig
from dynemb.options import DynamicEmbTableOptions, StorageMode, TableLayout, choose_storage_mode
from dynemb.modules.rank_share import local_table_config, local_table_options
from dynemb.stashing.table_stash import stashed_bytes_per_row
from dynemb.tables import DynamicTable, storage_policy

#: A hash table's own int64 size counter, next to its slots.
HASH_TABLE_FIXED_BYTES = torch.int64.itemsize
#: Embeddings leave a dynamic table as float32, whatever the stored dtype.
OUTPUT_BYTES_PER_VALUE = torch.float32.itemsize

#: One ratio for every table, or a ratio by table name (missing tables: 1.0).
UniqueRatios = Union[None, float, Mapping[str, float]]


@dataclass(frozen=True)
class TableFootprint:
    """Bytes one rank spends on one row-wise sharded dynamic table.

    Device side: ``values_bytes`` + ``optimizer_bytes`` (the device rows, embedding columns
    then optimizer state, float32 whatever the dtype: see
    :class:`~dynemb.rows.flat_table.RowLayout`),
    ``hash_bytes`` (key, score and reference count of every slot of the device hash table),
    ``admission_bytes`` (the admission counter's hash table), ``fixed_bytes`` (counters), and
    the I/O of the pipeline: ``input_bytes`` (deduplicated ids received for one batch, int64),
    ``output_bytes`` (float32 rows of one batch, one per id occurrence), ``prefetch_bytes``
    (CACHE mode's prefetch buffer), combined by TorchRec's pipeline multipliers into
    ``io_bytes``.

    Host side: the DEFAULT host tier or the CACHE backing store at its full size
    (``host_values_bytes``, ``host_optimizer_bytes``, ``host_hash_bytes``).
    ``host_exact`` is False for a user-supplied backing store, of which only the rows are
    counted.

    Memory stashing (``options.stash``, :mod:`dynemb.stashing`): ``stash_bytes`` of the
    device rows wait in a host buffer of the same size (counted in ``host_bytes``) between
    each training forward and its backward, where the device peak usually is:
    ``device_bytes_stashed`` is the table's device share then, ``device_bytes`` otherwise.

    Example::

        >>> config = EmbeddingConfig(name="items", embedding_dim=16, num_embeddings=1024,
        ...                          feature_names=["item"])
        >>> fp = table_footprint(config, DynamicEmbTableOptions(), OptimizerConfig(), world_size=2,
        ...                      batch_size=64)
        >>> fp.device_bytes == fp.device_static_bytes + fp.io_bytes
        True
    """

    table: str
    rank: int
    world_size: int
    mode: StorageMode
    dtype: torch.dtype
    dim: int
    state_dim: int
    device_rows: int
    host_rows: int
    values_bytes: int
    optimizer_bytes: int
    hash_bytes: int
    admission_bytes: int
    fixed_bytes: int
    input_bytes: int
    output_bytes: int
    prefetch_bytes: int
    io_bytes: int
    host_values_bytes: int
    host_optimizer_bytes: int
    host_hash_bytes: int
    host_fixed_bytes: int
    pipeline_type: PipelineType = PipelineType.NONE
    compute_device: str = "cuda"
    host_exact: bool = True
    is_inference: bool = False
    stash_bytes: int = 0
    disk_bytes: int = 0

    @property
    def device_static_bytes(self) -> int:
        """What the built table allocates on the device (no I/O)."""
        return (self.values_bytes + self.optimizer_bytes + self.hash_bytes
                + self.admission_bytes + self.fixed_bytes)

    @property
    def device_bytes(self) -> int:
        """Device bytes the planner reserves: the table plus the pipeline's I/O."""
        return self.device_static_bytes + self.io_bytes

    @property
    def device_bytes_stashed(self) -> int:
        """Device bytes while the rows are stashed (between a training forward and its
        backward): ``device_bytes`` less ``stash_bytes``."""
        return self.device_bytes - self.stash_bytes

    @property
    def host_bytes(self) -> int:
        """The host tier or store, and the stash's host buffer."""
        return (self.host_values_bytes + self.host_optimizer_bytes + self.host_hash_bytes
                + self.host_fixed_bytes + self.stash_bytes)

    @property
    def static_bytes(self) -> int:
        """Everything the built table allocates, device and host (no I/O)."""
        return self.device_static_bytes + self.host_bytes

    def storage(self) -> Storage:
        """The planner's ``Storage`` of this shard. On a CUDA topology the device side is HBM
        and the host side DDR; on a CPU topology everything is DDR and, as TorchRec does for
        CPU, input and output count once each."""
        if self.compute_device == "cpu":
            io = 0 if self.is_inference else self.input_bytes + self.output_bytes
            return Storage(hbm=0, ddr=self.device_static_bytes + io + self.host_bytes,
                           ssd=self.disk_bytes)
        return Storage(hbm=self.device_bytes, ddr=self.host_bytes, ssd=self.disk_bytes)


def hash_table_bytes(slots: int) -> int:
    """Bytes of a hash table of ``slots`` slots, as :meth:`ScoredHashTable.nbytes` reads them.

    Example::

        >>> hash_table_bytes(512)
        10248
    """
    return slots * SLOT_BYTES + HASH_TABLE_FIXED_BYTES


def rank_layout(config: EmbeddingConfig, options: DynamicEmbTableOptions,
                optimizer: OptimizerConfig, world_size: int) -> TableLayout:
    """The layout each rank builds for its shard of ``config``'s table (the sharder splits
    rows and budgets over ``world_size`` ranks).

    Example::

        >>> config = EmbeddingConfig(name="items", embedding_dim=16, num_embeddings=1024,
        ...                          feature_names=["item"])
        >>> rank_layout(config, DynamicEmbTableOptions(), OptimizerConfig(), 2).mode
        <StorageMode.HBM_DIRECT: 'hbm_direct'>
    """
    local = local_table_config(config, world_size)
    state_dim = optimizer.state_dim(config.embedding_dim)
    return choose_storage_mode(
        local_table_options(options, world_size), name=config.name,
        num_embeddings=local.num_embeddings, width=config.embedding_dim + state_dim,
        state_dim=state_dim, config_dtype=data_type_to_dtype(config.data_type),
        world_size=world_size)


def _batch_ids(name: str, batch_size: int, input_lengths: Optional[Sequence[float]],
               num_poolings: Optional[Sequence[float]],
               batch_sizes: Optional[Sequence[int]]) -> float:
    """Id occurrences one rank receives per batch: TorchRec's row-wise sequence formula."""
    lengths = list(input_lengths) if input_lengths is not None else [POOLING_FACTOR]
    poolings = list(num_poolings) if num_poolings is not None else [NUM_POOLINGS] * len(lengths)
    sizes = list(batch_sizes) if batch_sizes is not None else [batch_size] * len(lengths)
    if not len(lengths) == len(poolings) == len(sizes):
        raise ValueError(f"table {name!r}: input_lengths, num_poolings and batch_sizes "
                         f"must have one entry per input, got {lengths}, {poolings}, {sizes}")
    return sum(x * y * z for x, y, z in zip(lengths, poolings, sizes))


def table_footprint(config: EmbeddingConfig, options: DynamicEmbTableOptions,
                    optimizer: OptimizerConfig, *, world_size: int = 1, rank: int = 0,
                    batch_size: int = 0, input_lengths: Optional[Sequence[float]] = None,
                    num_poolings: Optional[Sequence[float]] = None,
                    batch_sizes: Optional[Sequence[int]] = None, unique_ratio: float = 1.0,
                    pipeline_type: PipelineType = PipelineType.NONE,
                    count_ephemeral_storage_cost: bool = False,
                    multipass_prefetch_max_pass: Optional[int] = None,
                    is_inference: bool = False,
                    compute_device: str = "cuda", pooled: bool = False) -> TableFootprint:
    """The bytes ``rank`` of ``world_size`` spends on ``config``'s table (all ranks are
    alike: the sharder gives each the same share of rows and budget).

    I/O follows TorchRec's row-wise sequence formula with this table's input dedup: per batch
    a rank receives ``unique_ratio * sum(input_lengths * num_poolings * batch_sizes)`` ids
    (each sender sends each distinct id once; 1.0 = no duplicates, an upper bound) and its
    features get ``sum(input_lengths * num_poolings * batch_sizes)`` float32 rows.
    ``batch_size`` is per rank, as in TorchRec's planner; ``input_lengths`` default to
    TorchRec's pooling factor (1.0) and ``num_poolings`` to 1.0. The pipeline multipliers
    are TorchRec's (``calculate_pipeline_io_cost``); tables backed by a store (CACHE: their
    policy's ``backing_store``, rows loaded in prefetch) count as cached for the prefetch
    pipeline. A ``pooled`` table (of a ``DynamicEmbBagCollection``) receives every
    occurrence (ids travel in their bags, ``unique_ratio`` does not apply) and outputs one
    float32 row per bag of every rank's batch (``world_size * sum(num_poolings *
    batch_sizes)``), as TorchRec's row-wise pooled sharding.

    Example::

        >>> from torchrec.distributed.types import PipelineType
        >>> config = EmbeddingConfig(name="items", embedding_dim=16, num_embeddings=1024,
        ...                          feature_names=["item"])
        >>> fp = table_footprint(config, DynamicEmbTableOptions(), OptimizerConfig(),
        ...                      world_size=2, batch_size=64,
        ...                      pipeline_type=PipelineType.TRAIN_SPARSE_DIST)
        >>> fp.mode, fp.device_rows       # room for 512 ids in buckets of 128
        (<StorageMode.HBM_DIRECT: 'hbm_direct'>, 896)
    """
    if not 0.0 < unique_ratio <= 1.0:
        raise ValueError(f"unique_ratio must be in (0, 1], got {unique_ratio!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    layout = rank_layout(config, options, optimizer, world_size)
    local_options = local_table_options(options, world_size)
    dim = config.embedding_dim
    state_dim = optimizer.state_dim(dim)
    row = RowLayout(dim, state_dim, layout.dtype)
    policy = storage_policy(layout.mode)
    rows = policy.planned_rows(layout, local_options)
    disk_bytes = store_memory = 0
    levels = getattr(local_options.backing_store, "planned_levels", None)
    if policy.backing_store and levels is not None:  # a store on disk
        host_rows, _, disk_bytes, store_memory = levels(layout.target_rows, row.row_bytes)
        rows = dataclasses.replace(rows, host_rows=host_rows, host_hash_slots=host_rows,
                                   host_exact=True)
    fixed = DynamicTable.fixed_memory()
    stash = 0 if is_inference else rows.device_rows * stashed_bytes_per_row(local_options.stash,
                                                                            row)
    admission = (0 if local_options.admission is None
                 else hash_table_bytes(counter_slots(local_options.admission.counter_capacity)))
    host_hash = hash_table_bytes(rows.host_hash_slots) if rows.host_hash_slots else 0

    occurrences = _batch_ids(config.name, batch_size, input_lengths, num_poolings, batch_sizes)
    if pooled:
        bags = world_size * _batch_ids(config.name, batch_size, None if input_lengths is None
                                       else [1.0] * len(input_lengths), num_poolings,
                                       batch_sizes)
        input_bytes = math.ceil(occurrences * BIGINT_DTYPE)
        output_bytes = math.ceil(bags * dim * OUTPUT_BYTES_PER_VALUE)
    else:
        input_bytes = math.ceil(occurrences * unique_ratio * BIGINT_DTYPE)
        output_bytes = math.ceil(occurrences * dim * OUTPUT_BYTES_PER_VALUE)
    prefetch_bytes = input_bytes if policy.backing_store else 0  # rows loaded in prefetch
    io = calculate_pipeline_io_cost(
        input_size=input_bytes, output_size=output_bytes, prefetch_size=prefetch_bytes,
        pipeline_type=pipeline_type, multipass_prefetch_max_pass=multipass_prefetch_max_pass,
        count_ephemeral_storage_cost=count_ephemeral_storage_cost, is_inference=is_inference)

    return TableFootprint(
        table=config.name, rank=rank, world_size=world_size, mode=layout.mode,
        dtype=layout.dtype, dim=dim, state_dim=state_dim, device_rows=rows.device_rows,
        host_rows=rows.host_rows, values_bytes=rows.device_rows * row.embedding_bytes,
        optimizer_bytes=rows.device_rows * row.state_bytes,
        hash_bytes=hash_table_bytes(rows.device_rows) if rows.device_rows else 0,
        admission_bytes=admission,
        fixed_bytes=fixed.other_bytes, input_bytes=input_bytes, output_bytes=output_bytes,
        prefetch_bytes=prefetch_bytes, io_bytes=io,
        host_values_bytes=rows.host_rows * row.embedding_bytes,
        host_optimizer_bytes=rows.host_rows * row.state_bytes, host_hash_bytes=host_hash,
        host_fixed_bytes=fixed.host_other_bytes + store_memory, pipeline_type=pipeline_type,
        compute_device=compute_device, host_exact=rows.host_exact, is_inference=is_inference,
        stash_bytes=stash, disk_bytes=disk_bytes)


# -- every table of a model --------------------------------------------------------------------
def dynamic_collections(model: nn.Module) -> List[Tuple[str, DynamicModuleInterface]]:
    """``(module path, collection)`` of every :class:`DynamicEmbCollection` in ``model`` (or
    ``model`` itself); raises if there is none."""
    found = list(find_dynamic_modules(model).items())
    if not found:
        raise ValueError(f"{type(model).__name__} holds no DynamicEmbCollection")
    return found


def unique_ratio_of(unique_ratios: UniqueRatios, name: str) -> float:
    """Table ``name``'s ratio of distinct ids (1.0 unless given)."""
    if unique_ratios is None:
        return 1.0
    if isinstance(unique_ratios, Mapping):
        return float(unique_ratios.get(name, 1.0))
    return float(unique_ratios)


def _constraint_inputs(constraints: Optional[Mapping[str, ParameterConstraints]], name: str,
                       batch_size: int):
    """input_lengths, num_poolings, batch_sizes of a table, read as TorchRec's planner does."""
    c = constraints.get(name) if constraints else None
    lengths = list(c.pooling_factors) if c is not None else [POOLING_FACTOR]
    poolings = (list(c.num_poolings) if c is not None and c.num_poolings
                else [NUM_POOLINGS] * len(lengths))
    sizes = (list(c.batch_sizes) if c is not None and c.batch_sizes
             else [batch_size] * len(lengths))
    return lengths, poolings, sizes


def footprints(model: nn.Module, *, world_size: int, batch_size: int,
               pipeline_type: PipelineType = PipelineType.NONE,
               constraints: Optional[Mapping[str, ParameterConstraints]] = None,
               unique_ratios: UniqueRatios = None, compute_device: str = "cuda",
               count_ephemeral_storage_cost: bool = False) -> List[TableFootprint]:
    """:func:`table_footprint` of every rank of every dynamic table in ``model`` (an
    unsharded model or a :class:`DynamicEmbCollection`, on any device, meta included).

    ``constraints`` supply ``pooling_factors`` / ``num_poolings`` / ``batch_sizes`` per
    table as they do to the planner; ``unique_ratios`` is one ratio or a dict by table.

    Example::

        >>> model = torch.nn.Sequential(DynamicEmbCollection(tables=[EmbeddingConfig(
        ...     name="items", embedding_dim=16, num_embeddings=1024, feature_names=["item"])]))
        >>> sum(f.device_bytes for f in footprints(model, world_size=2, batch_size=256))
        187584
    """
    out: List[TableFootprint] = []
    for _, module in dynamic_collections(model):
        options = module.table_options
        for config in module.table_configs():
            lengths, poolings, sizes = _constraint_inputs(constraints, config.name, batch_size)
            for rank in range(world_size):
                out.append(table_footprint(
                    config, options[config.name], module.optimizer_config,
                    world_size=world_size, rank=rank, input_lengths=lengths,
                    num_poolings=poolings, batch_sizes=sizes,
                    unique_ratio=unique_ratio_of(unique_ratios, config.name),
                    pipeline_type=pipeline_type, compute_device=compute_device,
                    count_ephemeral_storage_cost=count_ephemeral_storage_cost,
                    pooled=is_pooled(module)))
    return out
