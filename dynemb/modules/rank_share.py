"""How a table's global sizes split over the ranks of a row-wise sharding."""
from __future__ import annotations

import dataclasses
import math

from torchrec.modules.embedding_configs import EmbeddingConfig

from dynemb.options import DynamicEmbTableOptions


def rows_per_rank(rows: int, world_size: int) -> int:
    """``ceil(rows / world_size)``: each rank's share of a global row count."""
    return max(1, math.ceil(rows / world_size))


def local_table_options(options: DynamicEmbTableOptions,
                        world_size: int) -> DynamicEmbTableOptions:
    """The options one rank applies to its shard of a table.

    Row counts in the options (``init_capacity``, ``max_capacity``, the admission counter's
    ``counter_capacity``) are global and split evenly; ``global_hbm_for_values`` becomes the
    rank's ``local_hbm_for_values`` (its share, at least 1 byte but for a global 0: HOST_ONLY
    on every rank) unless that is set already (per rank).
    """
    changes = {name: rows_per_rank(getattr(options, name), world_size)
               for name in ("init_capacity", "max_capacity")
               if getattr(options, name) is not None}
    if options.global_hbm_for_values is not None and options.local_hbm_for_values is None:
        share = options.global_hbm_for_values // world_size
        changes["local_hbm_for_values"] = max(1, share) if options.global_hbm_for_values else 0
        changes["global_hbm_for_values"] = None
    if options.admission is not None:
        changes["admission"] = dataclasses.replace(
            options.admission,
            counter_capacity=rows_per_rank(options.admission.counter_capacity, world_size))
    return dataclasses.replace(options, **changes)


def local_table_config(config: EmbeddingConfig, world_size: int) -> EmbeddingConfig:
    """One rank's config of ``config``'s table: a share of its rows, read by a single
    feature named after the table (the ids that reach a rank are per table, not per
    feature)."""
    return EmbeddingConfig(
        name=config.name, embedding_dim=config.embedding_dim,
        num_embeddings=rows_per_rank(config.num_embeddings, world_size),
        feature_names=[config.name], data_type=config.data_type)
