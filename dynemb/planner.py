"""Plan models with dynamic tables using TorchRec's planner, with their true memory footprint.

TorchRec's planner sizes a table as ``num_embeddings x dim`` weights plus optimizer state
plus I/O buffers. A dynamic table on one rank holds something else: the device rows its
options allow (values and optimizer state side by side), the per-slot arrays of its hash
table, an admission counter, and in CACHE / DEFAULT mode a host tier with its own metadata.
This module computes that footprint (:func:`table_footprint`), teaches the planner to use it
(:class:`DynamicEmbStorageEstimator`, :class:`DynamicEmbPerfEstimator`,
:func:`make_planner`), prints it (:func:`footprint_report`, :class:`DynamicEmbStats`) and
measures what built tables really allocate (:func:`measure_allocated`).

Example::

    >>> planner = make_planner(Topology(world_size=8, compute_device="cuda"),
    ...                        batch_size=512, constraints=dynemb_constraints(model),
    ...                        pipeline_type=PipelineType.TRAIN_SPARSE_DIST)
    >>> plan = planner.collective_plan(model, [DynamicEmbCollectionSharder(),
    ...                                        EmbeddingCollectionSharder()], pg)
    >>> print(footprint_report(model, world_size=8, batch_size=512,
    ...                        pipeline_type=PipelineType.TRAIN_SPARSE_DIST))
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.constants import BIGINT_DTYPE, NUM_POOLINGS, POOLING_FACTOR
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.planners import EmbeddingShardingPlanner
from torchrec.distributed.planner.shard_estimators import (EmbeddingPerfEstimator,
                                                           EmbeddingStorageEstimator,
                                                           calculate_pipeline_io_cost,
                                                           get_num_poolings)
from torchrec.distributed.planner.stats import EmbeddingStats
from torchrec.distributed.planner.types import (ParameterConstraints, SharderDataMap,
                                                ShardEstimator, ShardingOption, Stats, Storage,
                                                Topology)
from torchrec.distributed.types import CacheParams, PipelineType, ShardingPlan, ShardingType
from torchrec.modules.embedding_configs import EmbeddingConfig, data_type_to_dtype

from dynemb.backing_store import default_store_slots
from dynemb.collection import DynamicEmbCollection
from dynemb.counters import COUNTER_NAMES
from dynemb.tables import DynamicTable, MemoryBreakdown
from dynemb.tables.tiered import host_tier_rows
from dynemb.flat_table import RowLayout
from dynemb.optimizers import OptimizerConfig
from dynemb.options import DynamicEmbTableOptions, StorageMode, TableLayout, choose_storage_mode
from dynemb.sharding.plan_rows import local_table_config, local_table_options

logger: logging.Logger = logging.getLogger(__name__)

__all__ = [
    "TableFootprint", "AllocatedBytes", "table_footprint", "rank_layout", "footprints",
    "footprint_report", "format_footprints", "measure_table", "measure_allocated",
    "format_allocated", "DynamicEmbStorageEstimator", "DynamicEmbPerfEstimator",
    "DynamicEmbStats", "dynemb_constraints", "dynamic_embedding_enumerator", "make_planner",
    "DYNEMB_SHARDING_TYPE", "DYNEMB_KERNEL",
]

#: The only sharding type and compute kernel a dynamic table is planned with.
DYNEMB_SHARDING_TYPE = ShardingType.ROW_WISE.value
DYNEMB_KERNEL = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value

# What the tables allocate (see dynemb.hash_table / dynamic_table / backing_store / admission):
# every hash-table slot holds an int64 key, an int64 score and an int32 reference count, and
# each hash table has one int64 size counter.
HASH_SLOT_BYTES = 8 + 8 + 4
HASH_TABLE_FIXED_BYTES = 8
# Per table: its counters (one int64 each) and the int64 count of deferred slot failures on
# the device, plus that count's host mirror.
TABLE_FIXED_DEVICE_BYTES = 8 * len(COUNTER_NAMES) + 8
TABLE_FIXED_HOST_BYTES = 8
ADMISSION_BUCKET = 128
# Embeddings leave a dynamic table as float32, whatever the stored dtype.
OUTPUT_BYTES_PER_VALUE = 4


# -- the footprint of one table on one rank ----------------------------------------------------
@dataclass(frozen=True)
class TableFootprint:
    """Bytes one rank spends on one row-wise sharded dynamic table.

    Device side: ``values_bytes`` + ``optimizer_bytes`` (the device rows, embedding columns
    then optimizer state, float32 whatever the dtype: see :class:`~dynemb.flat_table.RowLayout`),
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
    def host_bytes(self) -> int:
        return (self.host_values_bytes + self.host_optimizer_bytes + self.host_hash_bytes
                + self.host_fixed_bytes)

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
            return Storage(hbm=0, ddr=self.device_static_bytes + io + self.host_bytes)
        return Storage(hbm=self.device_bytes, ddr=self.host_bytes)


def _hash_bytes(capacity: int) -> int:
    return capacity * HASH_SLOT_BYTES + HASH_TABLE_FIXED_BYTES


def rank_layout(config: EmbeddingConfig, options: DynamicEmbTableOptions,
                optimizer: OptimizerConfig, world_size: int) -> TableLayout:
    """The layout each rank builds for its shard of ``config``'s table (the sharder splits
    rows and budgets over ``world_size`` ranks)."""
    local = local_table_config(config, world_size)
    state_dim = optimizer.state_dim(config.embedding_dim)
    return choose_storage_mode(
        local_table_options(options, world_size), name=config.name,
        num_embeddings=local.num_embeddings, width=config.embedding_dim + state_dim,
        state_dim=state_dim, config_dtype=data_type_to_dtype(config.data_type),
        world_size=world_size)


def table_footprint(config: EmbeddingConfig, options: DynamicEmbTableOptions,
                    optimizer: OptimizerConfig, *, world_size: int = 1, rank: int = 0,
                    batch_size: int = 0, input_lengths: Optional[Sequence[float]] = None,
                    num_poolings: Optional[Sequence[float]] = None,
                    batch_sizes: Optional[Sequence[int]] = None, unique_ratio: float = 1.0,
                    pipeline_type: PipelineType = PipelineType.NONE,
                    count_ephemeral_storage_cost: bool = False,
                    multipass_prefetch_max_pass: Optional[int] = None,
                    is_inference: bool = False,
                    compute_device: str = "cuda") -> TableFootprint:
    """The bytes ``rank`` of ``world_size`` spends on ``config``'s table (all ranks are
    alike: the sharder gives each the same share of rows and budget).

    I/O follows TorchRec's row-wise sequence formula with this table's input dedup: per batch
    a rank receives ``unique_ratio * sum(input_lengths * num_poolings * batch_sizes)`` ids
    (each sender sends each distinct id once; 1.0 = no duplicates, an upper bound) and its
    features get ``sum(input_lengths * num_poolings * batch_sizes)`` float32 rows.
    ``batch_size`` is per rank, as in TorchRec's planner; ``input_lengths`` default to
    TorchRec's pooling factor (1.0) and ``num_poolings`` to 1.0. The pipeline multipliers
    are TorchRec's (``calculate_pipeline_io_cost``); CACHE tables count as cached for the
    prefetch pipeline.
    """
    if not 0.0 < unique_ratio <= 1.0:
        raise ValueError(f"unique_ratio must be in (0, 1], got {unique_ratio!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    layout = rank_layout(config, options, optimizer, world_size)
    dim = config.embedding_dim
    state_dim = optimizer.state_dim(dim)
    row = RowLayout(dim, state_dim, layout.dtype)

    device_rows = layout.device_capacity  # HBM_DIRECT: its peak after growing to max_capacity
    values = device_rows * row.embedding_bytes
    state = device_rows * row.state_bytes
    hash_bytes = _hash_bytes(device_rows)
    local_options = local_table_options(options, world_size)
    admission = 0
    if local_options.admission is not None:
        cap = local_options.admission.counter_capacity
        admission = _hash_bytes(max(ADMISSION_BUCKET, -(-cap // ADMISSION_BUCKET)
                                    * ADMISSION_BUCKET))

    host_rows, host_hash, host_exact = 0, 0, True
    if layout.mode is StorageMode.DEFAULT:
        host_rows = host_tier_rows(layout)
        host_hash = _hash_bytes(host_rows)
    elif layout.mode is StorageMode.CACHE:
        if options.backing_store is None:  # the default store, at the most slots it grows to
            host_rows = default_store_slots(layout.max_capacity)
            host_hash = _hash_bytes(host_rows)
        else:  # a user store: count the rows it must hold, not its own structures
            host_rows, host_exact = layout.max_capacity, False

    lengths = list(input_lengths) if input_lengths is not None else [POOLING_FACTOR]
    poolings = list(num_poolings) if num_poolings is not None else [NUM_POOLINGS] * len(lengths)
    sizes = list(batch_sizes) if batch_sizes is not None else [batch_size] * len(lengths)
    if not len(lengths) == len(poolings) == len(sizes):
        raise ValueError(f"table {config.name!r}: input_lengths, num_poolings and batch_sizes "
                         f"must have one entry per input, got {lengths}, {poolings}, {sizes}")
    occurrences = sum(x * y * z for x, y, z in zip(lengths, poolings, sizes))
    input_bytes = math.ceil(occurrences * unique_ratio * BIGINT_DTYPE)
    output_bytes = math.ceil(occurrences * dim * OUTPUT_BYTES_PER_VALUE)
    prefetch_bytes = input_bytes if layout.mode is StorageMode.CACHE else 0
    io = calculate_pipeline_io_cost(
        input_size=input_bytes, output_size=output_bytes, prefetch_size=prefetch_bytes,
        pipeline_type=pipeline_type, multipass_prefetch_max_pass=multipass_prefetch_max_pass,
        count_ephemeral_storage_cost=count_ephemeral_storage_cost, is_inference=is_inference)

    return TableFootprint(
        table=config.name, rank=rank, world_size=world_size, mode=layout.mode,
        dtype=layout.dtype, dim=dim, state_dim=state_dim, device_rows=device_rows,
        host_rows=host_rows, values_bytes=values, optimizer_bytes=state, hash_bytes=hash_bytes,
        admission_bytes=admission, fixed_bytes=TABLE_FIXED_DEVICE_BYTES,
        input_bytes=input_bytes, output_bytes=output_bytes, prefetch_bytes=prefetch_bytes,
        io_bytes=io, host_values_bytes=host_rows * row.embedding_bytes,
        host_optimizer_bytes=host_rows * row.state_bytes, host_hash_bytes=host_hash,
        host_fixed_bytes=TABLE_FIXED_HOST_BYTES, pipeline_type=pipeline_type,
        compute_device=compute_device, host_exact=host_exact, is_inference=is_inference)


def _dynamic_collections(model: nn.Module) -> List[Tuple[str, DynamicEmbCollection]]:
    if isinstance(model, DynamicEmbCollection):
        return [("", model)]
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, DynamicEmbCollection)]
    if not found:
        raise ValueError(f"{type(model).__name__} holds no DynamicEmbCollection")
    return found


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


def _ratio_for(unique_ratios: Union[None, float, Mapping[str, float]], name: str) -> float:
    if unique_ratios is None:
        return 1.0
    if isinstance(unique_ratios, Mapping):
        return float(unique_ratios.get(name, 1.0))
    return float(unique_ratios)


def footprints(model: nn.Module, *, world_size: int, batch_size: int,
               pipeline_type: PipelineType = PipelineType.NONE,
               constraints: Optional[Mapping[str, ParameterConstraints]] = None,
               unique_ratios: Union[None, float, Mapping[str, float]] = None,
               compute_device: str = "cuda",
               count_ephemeral_storage_cost: bool = False) -> List[TableFootprint]:
    """:func:`table_footprint` of every rank of every dynamic table in ``model`` (an
    unsharded model or a :class:`DynamicEmbCollection`, on any device, meta included).

    ``constraints`` supply ``pooling_factors`` / ``num_poolings`` / ``batch_sizes`` per
    table as they do to the planner; ``unique_ratios`` is one ratio or a dict by table.
    """
    out: List[TableFootprint] = []
    for _, module in _dynamic_collections(model):
        options = module.table_options
        for config in module.embedding_configs():
            lengths, poolings, sizes = _constraint_inputs(constraints, config.name, batch_size)
            for rank in range(world_size):
                out.append(table_footprint(
                    config, options[config.name], module.optimizer_config,
                    world_size=world_size, rank=rank, input_lengths=lengths,
                    num_poolings=poolings, batch_sizes=sizes,
                    unique_ratio=_ratio_for(unique_ratios, config.name),
                    pipeline_type=pipeline_type, compute_device=compute_device,
                    count_ephemeral_storage_cost=count_ephemeral_storage_cost))
    return out


# -- printing ----------------------------------------------------------------------------------
_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))
_COLUMNS = (("values", "values_bytes"), ("optim", "optimizer_bytes"),
            ("hash", "hash_bytes"), ("admit", "admission_bytes"), ("input", "input_bytes"),
            ("output", "output_bytes"), ("pipe I/O", "io_bytes"),
            ("device", "device_bytes"), ("host", "host_bytes"))


def _pick_unit(largest: int) -> Tuple[str, int]:
    """MiB from 10 MiB up (GiB would round the I/O columns away), else KiB or bytes."""
    for name, size in _UNITS[1:]:
        if largest >= 10 * size:
            return name, size
    return "B", 1


def _pipeline_note(pipeline_type: PipelineType) -> str:
    return {
        PipelineType.TRAIN_SPARSE_DIST: "pipe I/O = 2 x input",
        PipelineType.TRAIN_PREFETCH_SPARSE_DIST:
            "pipe I/O = 3 x input + (1 + 6 / passes) x prefetch (CACHE tables: prefetch = input)",
    }.get(pipeline_type, "pipe I/O = input + output")


def format_footprints(items: Sequence[TableFootprint], *, title: str = "",
                      unit: Optional[str] = None) -> str:
    """The report of :func:`footprint_report` for given footprints (one line per table and
    rank, a line per table over all ranks, then totals per rank and overall)."""
    if not items:
        return "no dynamic tables"
    largest = max(max(f.device_bytes, f.host_bytes) for f in items) * max(
        f.world_size for f in items)
    unit_name, scale = (_pick_unit(largest) if unit is None
                        else next((n, s) for n, s in _UNITS if n == unit))

    def fmt(n: int) -> str:
        return f"{n:,}" if scale == 1 else f"{n / scale:,.2f}"

    header = ["table", "rank", "mode", "dev rows", "host rows"] + [c for c, _ in _COLUMNS]
    rows: List[List[str]] = []
    tables: Dict[str, List[TableFootprint]] = {}
    for f in items:
        tables.setdefault(f.table, []).append(f)
    for name, group in tables.items():
        for f in group:
            rows.append([name, str(f.rank), f.mode.name, f"{f.device_rows:,}",
                         f"{f.host_rows:,}"] + [fmt(getattr(f, a)) for _, a in _COLUMNS])
        rows.append([name, "all", "", f"{sum(f.device_rows for f in group):,}",
                     f"{sum(f.host_rows for f in group):,}"]
                    + [fmt(sum(getattr(f, a) for f in group)) for _, a in _COLUMNS])
    ranks = sorted({f.rank for f in items})
    for r in ranks:
        on = [f for f in items if f.rank == r]
        rows.append(["(all tables)", str(r), "", "", ""]
                    + [fmt(sum(getattr(f, a) for f in on)) for _, a in _COLUMNS])
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]

    def line(cells: List[str]) -> str:
        return "  ".join(c.ljust(w) if i < 3 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    first = items[0]
    lines = [title or "Dynamic embedding footprint",
             f"world size {first.world_size}, pipeline {first.pipeline_type.value} "
             f"({_pipeline_note(first.pipeline_type)}), compute device {first.compute_device}, "
             f"sizes in {unit_name}",
             line(header), line(["-" * w for w in widths])]
    lines += [line(r) for r in rows]
    device = sum(f.device_bytes for f in items)
    host = sum(f.host_bytes for f in items)
    lines.append(f"total: device {device:,} bytes ({fmt(device)} {unit_name}), host {host:,} "
                 f"bytes ({fmt(host)} {unit_name}), all {device + host:,} bytes")
    inexact = sorted({f.table for f in items if not f.host_exact})
    if inexact:
        lines.append(f"note: {inexact} use a custom backing store; host counts its rows only")
    return "\n".join(lines)


def footprint_report(model: nn.Module, world_size: int, batch_size: int,
                     pipeline_type: PipelineType = PipelineType.NONE, *,
                     constraints: Optional[Mapping[str, ParameterConstraints]] = None,
                     unique_ratios: Union[None, float, Mapping[str, float]] = None,
                     compute_device: str = "cuda", unit: Optional[str] = None) -> str:
    """Per table and per rank, the bytes of values, optimizer state, hash metadata,
    admission counter, input ids, output rows, pipelined I/O, device total and host tier,
    then per-rank and overall totals. Same numbers as the planner's
    :class:`DynamicEmbStorageEstimator` with the same arguments (``batch_size`` per rank).

    Example::

        >>> print(footprint_report(model, world_size=2, batch_size=256,
        ...                        pipeline_type=PipelineType.TRAIN_SPARSE_DIST))
    """
    items = footprints(model, world_size=world_size, batch_size=batch_size,
                       pipeline_type=pipeline_type, constraints=constraints,
                       unique_ratios=unique_ratios, compute_device=compute_device)
    return format_footprints(items, unit=unit, title=(
        f"Dynamic embedding footprint (batch size {batch_size} per rank)"))


# -- measuring built tables --------------------------------------------------------------------
#: What a built table holds, by category (see :meth:`dynemb.tables.DynamicTable.memory_breakdown`).
AllocatedBytes = MemoryBreakdown


def measure_table(table: DynamicTable) -> AllocatedBytes:
    """What ``table`` has allocated right now (its own :meth:`memory_breakdown`)."""
    return table.memory_breakdown()


def format_allocated(allocated: Mapping[str, AllocatedBytes]) -> str:
    """One line per table of :func:`measure_allocated`'s result, in bytes."""
    fields = ("values_bytes", "optimizer_bytes", "hash_bytes", "admission_bytes",
              "other_bytes", "device_bytes", "host_bytes", "in_flight_bytes")
    header = ["table", "values", "optim", "hash", "admit", "other", "device", "host",
              "in flight"]
    rows = [[name] + [f"{getattr(a, f):,}" for f in fields] for name, a in allocated.items()]
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) if rows else len(header[i])
              for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in [header, ["-" * w for w in widths]] + rows]
    return "\n".join(lines)


def measure_allocated(module: nn.Module) -> Dict[str, AllocatedBytes]:
    """:func:`measure_table` of every built dynamic table in ``module``: a
    :class:`DynamicEmbCollection`, a sharded one (its ``local`` collection: this rank's
    shards), or a model holding them (keys then are ``"<module path>.<table>"``)."""
    local = getattr(module, "local", None)
    if isinstance(local, DynamicEmbCollection):
        module = local
    if isinstance(module, DynamicEmbCollection):
        return {name: measure_table(t) for name, t in module.tables.items()}
    out: Dict[str, AllocatedBytes] = {}
    for path, m in module.named_modules():
        if isinstance(m, DynamicEmbCollection):
            for name, t in m.tables.items():
                out[f"{path}.{name}" if path else name] = measure_table(t)
    return out


# -- TorchRec estimators -----------------------------------------------------------------------
def _is_dynamic(option: ShardingOption) -> bool:
    return isinstance(option.module[1], DynamicEmbCollection)


def _config_of(option: ShardingOption) -> Tuple[DynamicEmbCollection, EmbeddingConfig]:
    module = option.module[1]
    for config in module.embedding_configs():
        if config.name == option.name:
            return module, config
    raise KeyError(f"no table {option.name!r} in the DynamicEmbCollection at "
                   f"{option.module[0]!r}")


class DynamicEmbStorageEstimator(ShardEstimator):
    """Storage estimator: dynamic tables get :func:`table_footprint`'s bytes per shard
    (HBM = device tables + hash metadata + admission counter + pipelined I/O, DDR = host
    tier); every other sharding option goes to TorchRec's ``EmbeddingStorageEstimator``
    unchanged.

    Args:
        topology, constraints, pipeline_type, run_embedding_at_peak_memory, is_inference:
            as for ``EmbeddingStorageEstimator``.
        unique_ratios: expected fraction of distinct ids in a batch (one float, or a dict by
            table name; default 1.0, i.e. no duplicates). Scales the input ids a shard
            receives, since each rank sends each distinct id once.
    """

    def __init__(self, topology: Topology,
                 constraints: Optional[Dict[str, ParameterConstraints]] = None,
                 pipeline_type: PipelineType = PipelineType.NONE,
                 run_embedding_at_peak_memory: bool = False, is_inference: bool = False,
                 *, unique_ratios: Union[None, float, Mapping[str, float]] = None) -> None:
        self._topology = topology
        self._constraints = constraints
        self._pipeline_type = pipeline_type
        self._count_ephemeral = run_embedding_at_peak_memory
        self._is_inference = is_inference
        self._unique_ratios = unique_ratios
        self._torchrec = EmbeddingStorageEstimator(
            topology=topology, constraints=constraints, pipeline_type=pipeline_type,
            run_embedding_at_peak_memory=run_embedding_at_peak_memory,
            is_inference=is_inference)

    @property
    def pipeline_type(self) -> PipelineType:
        return self._pipeline_type

    def footprint(self, option: ShardingOption, rank: int = 0,
                  sharder_data_map: Optional[SharderDataMap] = None) -> TableFootprint:
        """The :class:`TableFootprint` of one shard of a dynamic table's sharding option."""
        module, config = _config_of(option)
        constraints = self._constraints.get(option.name) if self._constraints else None
        num_poolings = get_num_poolings(self._constraints, option)
        batch_sizes = (constraints.batch_sizes if constraints and constraints.batch_sizes
                       else [option.batch_size] * option.num_inputs)
        mpp = option.cache_params.multipass_prefetch_config if option.cache_params else None
        if mpp is None and sharder_data_map is not None:
            data = sharder_data_map.get(option.module_type_key)
            if data is not None:
                mpp = data.fused_params.get("multipass_prefetch_config")
        return table_footprint(
            config, module.table_options[config.name], module.optimizer_config,
            world_size=self._topology.world_size, rank=rank,
            input_lengths=option.input_lengths, num_poolings=num_poolings,
            batch_sizes=batch_sizes, unique_ratio=_ratio_for(self._unique_ratios, option.name),
            pipeline_type=self._pipeline_type,
            count_ephemeral_storage_cost=self._count_ephemeral,
            multipass_prefetch_max_pass=mpp.num_passes if mpp else None,
            is_inference=self._is_inference, compute_device=self._topology.compute_device)

    def estimate(self, sharding_options: List[ShardingOption],
                 sharder_data_map: Optional[SharderDataMap] = None) -> None:
        ours = [o for o in sharding_options if _is_dynamic(o)]
        others = [o for o in sharding_options if not _is_dynamic(o)]
        if others:
            self._torchrec.estimate(others, sharder_data_map=sharder_data_map)
        for option in ours:
            if option.sharding_type != DYNEMB_SHARDING_TYPE:
                raise ValueError(f"dynamic table {option.name!r}: sharding type "
                                 f"{option.sharding_type!r} is not supported; constrain it to "
                                 f"{DYNEMB_SHARDING_TYPE!r} (see dynemb_constraints)")
            for i, shard in enumerate(option.shards):
                # every rank holds the same share (rows and budget split evenly)
                shard.storage = self.footprint(option, i, sharder_data_map).storage()


class DynamicEmbPerfEstimator(ShardEstimator):
    """Perf estimator: dynamic tables are estimated by TorchRec's ``EmbeddingPerfEstimator``
    as the nearest TorchRec kernel (``fused`` for HBM_DIRECT; ``fused_uvm_caching`` with the
    table's real device/total row ratio as cache load factor for CACHE and DEFAULT on a CUDA
    topology), then get their ``customized_kernel`` label (and cache params) back. Other
    options go to TorchRec's estimator as they are."""

    def __init__(self, topology: Topology,
                 constraints: Optional[Dict[str, ParameterConstraints]] = None,
                 is_inference: bool = False) -> None:
        self._topology = topology
        self._torchrec = EmbeddingPerfEstimator(topology=topology, constraints=constraints,
                                                is_inference=is_inference)

    def proxy_kernel(self, option: ShardingOption) -> Tuple[str, Optional[float]]:
        """The TorchRec kernel (and cache load factor) a dynamic table is timed as."""
        module, config = _config_of(option)
        layout = rank_layout(config, module.table_options[config.name],
                             module.optimizer_config, self._topology.world_size)
        if layout.mode is StorageMode.HBM_DIRECT or self._topology.compute_device != "cuda":
            return EmbeddingComputeKernel.FUSED.value, None
        return (EmbeddingComputeKernel.FUSED_UVM_CACHING.value,
                layout.device_capacity / layout.max_capacity)

    def estimate(self, sharding_options: List[ShardingOption],
                 sharder_data_map: Optional[SharderDataMap] = None) -> None:
        ours = [o for o in sharding_options if _is_dynamic(o)]
        others = [o for o in sharding_options if not _is_dynamic(o)]
        if others:
            self._torchrec.estimate(others, sharder_data_map=sharder_data_map)
        if not ours:
            return
        saved = [(o, o.compute_kernel, o.cache_params) for o in ours]
        try:
            for option in ours:
                kernel, ratio = self.proxy_kernel(option)
                option.compute_kernel = kernel
                if ratio is not None:
                    option.cache_params = dataclasses.replace(
                        option.cache_params or CacheParams(), load_factor=ratio)
            self._torchrec.estimate(ours, sharder_data_map=sharder_data_map)
        finally:
            for option, kernel, cache_params in saved:
                option.compute_kernel = kernel
                option.cache_params = cache_params


# -- stats -------------------------------------------------------------------------------------
class DynamicEmbStats(Stats):
    """Logs (logger ``dynemb.planner``, INFO) the footprint breakdown of the dynamic tables of
    the chosen plan, one line per table and rank, as :func:`footprint_report` prints it.
    Use it next to TorchRec's ``EmbeddingStats`` (:func:`make_planner` does)."""

    def __init__(self, storage_estimator: DynamicEmbStorageEstimator) -> None:
        self._estimator = storage_estimator
        self.last_report: str = ""

    def log(self, sharding_plan: ShardingPlan, topology: Topology, batch_size: int,
            storage_reservation, num_proposals: int, num_plans: int, run_time: float,
            best_plan: List[ShardingOption], constraints=None, sharders=None,
            enumerator=None, debug: bool = False, debug_stats=None) -> None:
        items = []
        for option in best_plan:
            if not _is_dynamic(option):
                continue
            for i, shard in enumerate(option.shards):
                rank = shard.rank if shard.rank is not None else i
                fp = self._estimator.footprint(option, rank)
                items.append(dataclasses.replace(fp, table=option.fqn))
        if not items:
            return
        items.sort(key=lambda f: (f.table, f.rank))
        self.last_report = format_footprints(
            items, title=f"Dynamic embedding footprint of the plan (batch size {batch_size} "
                         f"per rank)")
        for row in self.last_report.splitlines():
            logger.info(row)


# -- wiring ------------------------------------------------------------------------------------
def dynemb_constraints(model: nn.Module,
                       constraints: Optional[Mapping[str, ParameterConstraints]] = None
                       ) -> Dict[str, ParameterConstraints]:
    """``constraints`` (copied) plus, for every table of every :class:`DynamicEmbCollection`
    in ``model``, ``sharding_types=["row_wise"]`` and ``compute_kernels=["customized_kernel"]``
    (other fields of a constraint already given for that table, e.g. ``pooling_factors``,
    are kept). Tables of other modules are left to the planner.

    Table names are the planner's keys: a dynamic table must not share its name with a
    table of another module.
    """
    out = dict(constraints or {})
    for _, module in _dynamic_collections(model):
        for config in module.embedding_configs():
            base = out.get(config.name)
            fields = dict(sharding_types=[DYNEMB_SHARDING_TYPE], compute_kernels=[DYNEMB_KERNEL])
            out[config.name] = (dataclasses.replace(base, **fields) if base is not None
                                else ParameterConstraints(**fields))
    return out


def _estimators(topology: Topology, constraints, pipeline_type: PipelineType,
                unique_ratios, run_embedding_at_peak_memory: bool, is_inference: bool):
    storage = DynamicEmbStorageEstimator(
        topology, constraints, pipeline_type=pipeline_type,
        run_embedding_at_peak_memory=run_embedding_at_peak_memory, is_inference=is_inference,
        unique_ratios=unique_ratios)
    perf = DynamicEmbPerfEstimator(topology, constraints, is_inference=is_inference)
    return perf, storage


def dynamic_embedding_enumerator(topology: Topology, batch_size: int,
                                 constraints: Optional[Dict[str, ParameterConstraints]] = None,
                                 pipeline_type: PipelineType = PipelineType.NONE, *,
                                 unique_ratios: Union[None, float, Mapping[str, float]] = None,
                                 run_embedding_at_peak_memory: bool = False,
                                 is_inference: bool = False) -> EmbeddingEnumerator:
    """TorchRec's ``EmbeddingEnumerator`` with :class:`DynamicEmbPerfEstimator` and
    :class:`DynamicEmbStorageEstimator` (pass it as ``enumerator=`` to any TorchRec
    planner built with the same topology, batch size and constraints)."""
    perf, storage = _estimators(topology, constraints, pipeline_type, unique_ratios,
                                run_embedding_at_peak_memory, is_inference)
    return EmbeddingEnumerator(topology=topology, batch_size=batch_size,
                               constraints=constraints, estimator=[perf, storage])


def make_planner(topology: Topology,
                 constraints: Optional[Dict[str, ParameterConstraints]] = None, *,
                 batch_size: int = 512, pipeline_type: PipelineType = PipelineType.NONE,
                 unique_ratios: Union[None, float, Mapping[str, float]] = None,
                 run_embedding_at_peak_memory: bool = False, is_inference: bool = False,
                 log_footprint: bool = True, **planner_kwargs) -> EmbeddingShardingPlanner:
    """An ``EmbeddingShardingPlanner`` whose enumerator uses the dynamic-table estimators
    and whose stats are TorchRec's ``EmbeddingStats`` plus (``log_footprint``)
    :class:`DynamicEmbStats`. ``batch_size`` is per rank; ``planner_kwargs`` go to the
    planner (``proposer``, ``partitioner``, ``storage_reservation``, ``debug``...).

    Example::

        >>> planner = make_planner(Topology(world_size=2, compute_device="cuda"),
        ...                        dynemb_constraints(model), batch_size=256)
        >>> plan = planner.plan(model, [DynamicEmbCollectionSharder(),
        ...                             EmbeddingCollectionSharder()])
    """
    perf, storage = _estimators(topology, constraints, pipeline_type, unique_ratios,
                                run_embedding_at_peak_memory, is_inference)
    enumerator = EmbeddingEnumerator(topology=topology, batch_size=batch_size,
                                     constraints=constraints, estimator=[perf, storage])
    if "stats" not in planner_kwargs:
        stats: List[Stats] = [EmbeddingStats()]
        if log_footprint:
            stats.append(DynamicEmbStats(storage))
        planner_kwargs["stats"] = stats
    return EmbeddingShardingPlanner(topology=topology, batch_size=batch_size,
                                    enumerator=enumerator, constraints=constraints,
                                    **planner_kwargs)

