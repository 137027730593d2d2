"""Plan models with dynamic tables using TorchRec's planner, with their true memory footprint
(see ``docs/planner.md``). One job a module:

- :mod:`~dynemb.planning.footprint`: the bytes one rank spends on one table
  (:func:`table_footprint`, :func:`footprints`, :func:`rank_layout`), from the table layer's
  sizing rules;
- :mod:`~dynemb.planning.estimators`: TorchRec's planner using it
  (:class:`DynamicEmbStorageEstimator`, :class:`DynamicEmbPerfEstimator`,
  :class:`DynamicEmbStats`, :func:`dynemb_constraints`, :func:`make_planner`);
- :mod:`~dynemb.planning.report`: footprints and measured allocations as text
  (:func:`footprint_report`, :func:`measure_allocated`).

Example::

    >>> planner = make_planner(Topology(world_size=8, compute_device="cuda"),  # doctest: +SKIP
    ...                        batch_size=512, constraints=dynemb_constraints(model),
    ...                        pipeline_type=PipelineType.TRAIN_SPARSE_DIST)
    >>> plan = planner.collective_plan(model, [DynamicEmbCollectionSharder(),  # doctest: +SKIP
    ...                                        EmbeddingCollectionSharder()], pg)
    >>> print(footprint_report(model, world_size=8, batch_size=512,  # doctest: +SKIP
    ...                        pipeline_type=PipelineType.TRAIN_SPARSE_DIST))
"""
from dynemb.planning.estimators import (DynamicEmbPerfEstimator, DynamicEmbStats,
                                        DynamicEmbStorageEstimator, dynamic_embedding_enumerator,
                                        dynemb_constraints, make_planner)
from dynemb.planning.footprint import TableFootprint, footprints, rank_layout, table_footprint
from dynemb.planning.report import (AllocatedBytes, footprint_report, format_allocated,
                                    format_footprints, measure_allocated, measure_table)

__all__ = [
    "TableFootprint", "AllocatedBytes", "table_footprint", "rank_layout", "footprints",
    "footprint_report", "format_footprints", "measure_table", "measure_allocated",
    "format_allocated", "DynamicEmbStorageEstimator", "DynamicEmbPerfEstimator",
    "DynamicEmbStats", "dynemb_constraints", "dynamic_embedding_enumerator", "make_planner",
]
