"""TorchRec's planner, taught about dynamic tables.

TorchRec sizes a table as ``num_embeddings x dim`` weights plus optimizer state plus I/O
buffers, and its perf estimator rejects the ``customized_kernel`` of a dynamic table. Here:
:class:`DynamicEmbStorageEstimator` (the footprint model of
:mod:`dynemb.planning.footprint`), :class:`DynamicEmbPerfEstimator` (TorchRec's timing of the
nearest fbgemm kernel), :class:`DynamicEmbStats` (the plan's footprint, logged),
:func:`dynemb_constraints` and the planners built from them (:func:`make_planner`,
:func:`dynamic_embedding_enumerator`). Options of any other module go to TorchRec's own
estimators unchanged.

Example::

    >>> planner = make_planner(Topology(world_size=8, compute_device="cuda"),  # doctest: +SKIP
    ...                        dynemb_constraints(model), batch_size=512,
    ...                        pipeline_type=PipelineType.TRAIN_SPARSE_DIST)
    >>> plan = planner.collective_plan(model, [DynamicEmbCollectionSharder(),  # doctest: +SKIP
    ...                                        EmbeddingCollectionSharder()], pg)
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Dict, List, Mapping, Optional, Tuple

from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.planners import EmbeddingShardingPlanner
from torchrec.distributed.planner.shard_estimators import (EmbeddingPerfEstimator,
                                                           EmbeddingStorageEstimator,
                                                           get_num_poolings)
from torchrec.distributed.planner.stats import EmbeddingStats
from torchrec.distributed.planner.types import (ParameterConstraints, SharderDataMap,
                                                ShardEstimator, ShardingOption, Stats, Topology)
from torchrec.distributed.types import CacheParams, PipelineType, ShardingPlan, ShardingType
from torchrec.modules.embedding_configs import EmbeddingConfig

from dynemb.module_interface import DynamicModuleInterface, is_pooled
from dynemb.optimizer_config import OptimizerConfig
from dynemb.planning.footprint import (TableFootprint, UniqueRatios, dynamic_collections,
                                       rank_layout, table_footprint,
                                       unique_ratio_of)
from dynemb.planning.report import format_footprints
from dynemb.modules.fused_params import sharded_optimizer
from dynemb.tables.policies import RowReads, storage_policy

# Named after the public module users import the planner from, so that is the logger they
# configure.
logger: logging.Logger = logging.getLogger("dynemb.planning")

#: The only sharding type and compute kernel a dynamic table is planned with.
DYNEMB_SHARDING_TYPE = ShardingType.ROW_WISE.value
DYNEMB_KERNEL = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value


def _estimate_others(torchrec_estimator: ShardEstimator, options: List[ShardingOption],
                     sharder_data_map: Optional[SharderDataMap]) -> List[ShardingOption]:
    """Let TorchRec's estimator estimate the options of ordinary tables; returns those of
    dynamic tables, left to us."""
    others = [o for o in options if not _is_dynamic(o)]
    if others:
        torchrec_estimator.estimate(others, sharder_data_map=sharder_data_map)
    ours = [o for o in options if _is_dynamic(o)]
    return ours


def _is_dynamic(option: ShardingOption) -> bool:
    return isinstance(option.module[1], DynamicModuleInterface)


def _config_of(option: ShardingOption) -> Tuple[DynamicModuleInterface, EmbeddingConfig]:
    module = option.module[1]
    for config in module.table_configs():
        if config.name == option.name:
            return module, config
    raise KeyError(f"no table {option.name!r} in the DynamicEmbCollection at "
                   f"{option.module[0]!r}")


def planned_optimizer(option: ShardingOption,
                      sharder_data_map: Optional[SharderDataMap] = None) -> OptimizerConfig:
    """The optimizer a dynamic table's option will train with: its sharder's
    ``fused_params`` (in ``sharder_data_map``) and the marks of ``apply_optimizer_in_backward``
    on its module's table parameters, or its module's (conflicts raise, as when DMP shards
    the module; see :func:`~dynemb.modules.fused_params.sharded_optimizer`)."""
    module = option.module[1]
    data = sharder_data_map.get(option.module_type_key) if sharder_data_map else None
    return (sharded_optimizer(module, data.fused_params if data is not None else None,
                              option.module[0]) or module.optimizer_config)


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
        torchrec_estimator: the TorchRec storage estimator other options go to (default: a
            new ``EmbeddingStorageEstimator`` with the same arguments).

    A table's optimizer state is sized for the optimizer it will train with: its sharder's
    ``fused_params`` or its module's ``optimizer=`` (:func:`planned_optimizer`).

    Example::

        >>> estimator = DynamicEmbStorageEstimator(topology, constraints,  # doctest: +SKIP
        ...                                        unique_ratios={"items": 0.5})
        >>> EmbeddingEnumerator(topology, 512, constraints, estimator=[perf, estimator])  # doctest: +SKIP
    """

    def __init__(self, topology: Topology,
                 constraints: Optional[Dict[str, ParameterConstraints]] = None,
                 pipeline_type: PipelineType = PipelineType.NONE,
                 run_embedding_at_peak_memory: bool = False, is_inference: bool = False,
                 *, unique_ratios: UniqueRatios = None,
                 torchrec_estimator: Optional[ShardEstimator] = None) -> None:
        self._topology = topology
        self._constraints = constraints
        self._pipeline_type = pipeline_type
        self._count_ephemeral = run_embedding_at_peak_memory
        self._is_inference = is_inference
        self._unique_ratios = unique_ratios
        self._sharder_data_map: Optional[SharderDataMap] = None  # of the last estimate
        self._torchrec = torchrec_estimator or EmbeddingStorageEstimator(
            topology=topology, constraints=constraints, pipeline_type=pipeline_type,
            run_embedding_at_peak_memory=run_embedding_at_peak_memory,
            is_inference=is_inference)

    @property
    def pipeline_type(self) -> PipelineType:
        return self._pipeline_type

    def footprint(self, option: ShardingOption, rank: int = 0,
                  sharder_data_map: Optional[SharderDataMap] = None) -> TableFootprint:
        """The :class:`TableFootprint` of one shard of a dynamic table's sharding option
        (``sharder_data_map``: default, the last :meth:`estimate`'s)."""
        module, config = _config_of(option)
        if sharder_data_map is None:
            sharder_data_map = self._sharder_data_map
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
            config, module.table_options[config.name],
            planned_optimizer(option, sharder_data_map),
            world_size=self._topology.world_size, rank=rank,
            input_lengths=option.input_lengths, num_poolings=num_poolings,
            batch_sizes=batch_sizes,
            unique_ratio=unique_ratio_of(self._unique_ratios, option.name),
            pipeline_type=self._pipeline_type,
            count_ephemeral_storage_cost=self._count_ephemeral,
            multipass_prefetch_max_pass=mpp.num_passes if mpp else None,
            is_inference=self._is_inference, compute_device=self._topology.compute_device,
            pooled=is_pooled(module))

    def estimate(self, sharding_options: List[ShardingOption],
                 sharder_data_map: Optional[SharderDataMap] = None) -> None:
        self._sharder_data_map = sharder_data_map
        ours = _estimate_others(self._torchrec, sharding_options, sharder_data_map)
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
    as the nearest TorchRec kernel, by where their storage policy reads rows
    (:class:`~dynemb.tables.policies.RowReads`): ``fused`` for rows on the device
    (HBM_DIRECT); on a CUDA topology ``fused_uvm_caching`` with the table's real device/total
    row ratio as cache load factor for rows cached on the device (CACHE and DEFAULT), and
    ``fused_uvm`` for rows in host memory (HOST_ONLY); then they get their
    ``customized_kernel`` label (and cache params) back. Other
    options go to TorchRec's estimator (``torchrec_estimator``, default a new
    ``EmbeddingPerfEstimator``) as they are.

    Example::

        >>> DynamicEmbPerfEstimator(topology, constraints).proxy_kernel(option)  # doctest: +SKIP
        ('fused_uvm_caching', 0.087...)     # a CACHE table: device rows / all rows
    """

    def __init__(self, topology: Topology,
                 constraints: Optional[Dict[str, ParameterConstraints]] = None,
                 is_inference: bool = False, *,
                 torchrec_estimator: Optional[ShardEstimator] = None) -> None:
        self._topology = topology
        self._torchrec = torchrec_estimator or EmbeddingPerfEstimator(
            topology=topology, constraints=constraints, is_inference=is_inference)

    def proxy_kernel(self, option: ShardingOption,
                     sharder_data_map: Optional[SharderDataMap] = None
                     ) -> Tuple[str, Optional[float]]:
        """The TorchRec kernel (and cache load factor) a dynamic table is timed as."""
        module, config = _config_of(option)
        layout = rank_layout(config, module.table_options[config.name],
                             planned_optimizer(option, sharder_data_map),
                             self._topology.world_size)
        reads = storage_policy(layout.mode).row_reads
        if reads is RowReads.DEVICE or self._topology.compute_device != "cuda":
            return EmbeddingComputeKernel.FUSED.value, None
        if reads is RowReads.HOST:  # every row read from host memory
            return EmbeddingComputeKernel.FUSED_UVM.value, None
        return (EmbeddingComputeKernel.FUSED_UVM_CACHING.value,
                layout.device_capacity / layout.target_rows)

    def estimate(self, sharding_options: List[ShardingOption],
                 sharder_data_map: Optional[SharderDataMap] = None) -> None:
        ours = _estimate_others(self._torchrec, sharding_options, sharder_data_map)
        if not ours:
            return
        saved = [(o, o.compute_kernel, o.cache_params) for o in ours]
        try:
            for option in ours:
                kernel, ratio = self.proxy_kernel(option, sharder_data_map)
                option.compute_kernel = kernel
                if ratio is not None:
                    option.cache_params = dataclasses.replace(
                        option.cache_params or CacheParams(), load_factor=ratio)
            self._torchrec.estimate(ours, sharder_data_map=sharder_data_map)
        finally:
            for option, kernel, cache_params in saved:
                option.compute_kernel = kernel
                option.cache_params = cache_params


class DynamicEmbStats(Stats):
    """Logs (logger ``dynemb.planning``, INFO) the footprint breakdown of the dynamic tables of
    the chosen plan, one line per table and rank, as
    :func:`~dynemb.planning.report.footprint_report` prints it. Use it next to TorchRec's
    ``EmbeddingStats`` (:func:`make_planner` does).

    Example::

        >>> stats = DynamicEmbStats(storage_estimator)  # doctest: +SKIP
        >>> EmbeddingShardingPlanner(..., stats=[EmbeddingStats(), stats]).plan(model, sharders)  # doctest: +SKIP
        >>> print(stats.last_report)  # doctest: +SKIP
    """

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

    Example::

        >>> model = torch.nn.Sequential(DynamicEmbCollection(tables=[EmbeddingConfig(
        ...     name="items", embedding_dim=16, num_embeddings=1024, feature_names=["item"])]))
        >>> constraints = dynemb_constraints(
        ...     model, {"items": ParameterConstraints(pooling_factors=[20.0])})
        >>> constraints["items"].sharding_types, constraints["items"].pooling_factors
        (['row_wise'], [20.0])
    """
    out = dict(constraints or {})
    for _, module in dynamic_collections(model):
        for config in module.table_configs():
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
                                 unique_ratios: UniqueRatios = None,
                                 run_embedding_at_peak_memory: bool = False,
                                 is_inference: bool = False) -> EmbeddingEnumerator:
    """TorchRec's ``EmbeddingEnumerator`` with :class:`DynamicEmbPerfEstimator` and
    :class:`DynamicEmbStorageEstimator` (pass it as ``enumerator=`` to any TorchRec
    planner built with the same topology, batch size and constraints).

    Example::

        >>> enumerator = dynamic_embedding_enumerator(topology, 512, constraints)  # doctest: +SKIP
        >>> EmbeddingShardingPlanner(topology=topology, batch_size=512,  # doctest: +SKIP
        ...                          constraints=constraints, enumerator=enumerator)
    """
    perf, storage = _estimators(topology, constraints, pipeline_type, unique_ratios,
                                run_embedding_at_peak_memory, is_inference)
    return EmbeddingEnumerator(topology=topology, batch_size=batch_size,
                               constraints=constraints, estimator=[perf, storage])


def make_planner(topology: Topology,
                 constraints: Optional[Dict[str, ParameterConstraints]] = None, *,
                 batch_size: int = 512, pipeline_type: PipelineType = PipelineType.NONE,
                 unique_ratios: UniqueRatios = None, run_embedding_at_peak_memory: bool = False,
                 is_inference: bool = False, log_footprint: bool = True,
                 **planner_kwargs) -> EmbeddingShardingPlanner:
    """An ``EmbeddingShardingPlanner`` whose enumerator uses the dynamic-table estimators
    and whose stats are TorchRec's ``EmbeddingStats`` plus (``log_footprint``)
    :class:`DynamicEmbStats`. ``batch_size`` is per rank; ``planner_kwargs`` go to the
    planner (``proposer``, ``partitioner``, ``storage_reservation``, ``debug``...).

    Example::

        >>> from torchrec.distributed.embedding import EmbeddingCollectionSharder
        >>> from dynemb.sharding.sharder import DynamicEmbCollectionSharder
        >>> model = torch.nn.Sequential(DynamicEmbCollection(tables=[EmbeddingConfig(
        ...     name="items", embedding_dim=16, num_embeddings=1024, feature_names=["item"])]))
        >>> planner = make_planner(Topology(world_size=1, compute_device="cpu"),
        ...                        dynemb_constraints(model), batch_size=256)
        >>> plan = planner.plan(model, [DynamicEmbCollectionSharder(),
        ...                             EmbeddingCollectionSharder()])
        >>> plan.plan["0"]["items"].compute_kernel
        'customized_kernel'
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
