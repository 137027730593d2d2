"""dynemb: dynamic (hash-table-backed) embeddings for TorchRec.

The top level holds what a TorchRec user needs to swap ``EmbeddingCollection`` /
``EmbeddingBagCollection`` for dynamic ones and configure them, and nothing else:

- the drop-in modules: :class:`DynamicEmbCollection` (``EmbeddingCollection`` whose tables
  are hash tables: any int64 id, rows created on first sight, evicted by score, fused
  optimizer in backward), :class:`DynamicEmbBagCollection` (the same for
  ``EmbeddingBagCollection``: pooled bags, ``KeyedTensor`` out), and the optimizer object they
  expose, :class:`DynamicEmbFusedOptimizer`;
- their configuration: :class:`DynamicEmbTableOptions` per table and the values its fields
  take (:class:`StorageMode`, :class:`StashMode`, :class:`ShardingScheme`,
  :class:`ScorePolicy`, :class:`FrequencyAdmission`, :class:`Initializer` /
  :class:`InitializerKind`), and :class:`OptimizerConfig` / :class:`OptimizerType`;
- what they hand back: :class:`TableFullError` (a table with no slot left),
  :class:`PrefetchState` (what ``prefetch`` returns);
- :func:`warm_start`: a dynamic module's rows (and fused optimizer state) from a trained
  TorchRec ``EmbeddingCollection`` / ``EmbeddingBagCollection``.

Each service has its package: :mod:`dynemb.sharding` (the sharders for
``DistributedModelParallel``), :mod:`dynemb.planning` (TorchRec's planner with dynamic
tables), :mod:`dynemb.pipelines` (TorchRec's train pipelines, also on CPU),
:mod:`dynemb.checkpoint` (dumps, loads, resharding), :mod:`dynemb.serving` (export without a
hash table), :mod:`dynemb.stashing` (embedding memory stashing). The table-level API lives in
its own modules: :class:`~dynemb.rows.hash_table.ScoredHashTable`,
:class:`~dynemb.rows.flat_table.FlatTable`, :class:`~dynemb.stores.backing_store.BackingStore`,
:func:`~dynemb.rows.optimizers.fused_update`, and the key sentinels and results in
:mod:`dynemb.types` (``EMPTY_KEY``, ``ExportBatch``...).

Example::

    >>> import torch
    >>> from torchrec.modules.embedding_configs import EmbeddingConfig
    >>> ec = DynamicEmbCollection(
    ...     [EmbeddingConfig(name="t", embedding_dim=8, num_embeddings=1024,
    ...                      feature_names=["f"])],
    ...     device=torch.device("cpu"),
    ...     table_options={"t": DynamicEmbTableOptions(score_strategy=ScorePolicy.LFU)},
    ...     optimizer=OptimizerConfig(OptimizerType.ADAM, learning_rate=1e-3))
    >>> ec.embedding_configs()[0].name
    't'
"""
from dynemb.modules.bag_collection import DynamicEmbBagCollection
from dynemb.modules.collection import DynamicEmbCollection
from dynemb.rows.fused_optimizer import DynamicEmbFusedOptimizer
from dynemb.rows.initializers import Initializer, InitializerKind
from dynemb.optimizer_config import OptimizerConfig, OptimizerType
from dynemb.options import (DynamicEmbTableOptions, FrequencyAdmission, ShardingScheme,
                            StashMode, StorageMode)
from dynemb.modules.prefetch import PrefetchState
from dynemb.checkpoint.warm_start import warm_start
from dynemb.types import ScorePolicy, TableFullError

__all__ = [
    "DynamicEmbCollection", "DynamicEmbBagCollection", "DynamicEmbFusedOptimizer",
    "DynamicEmbTableOptions", "StorageMode", "StashMode", "ShardingScheme", "ScorePolicy",
    "FrequencyAdmission", "Initializer", "InitializerKind", "OptimizerConfig", "OptimizerType",
    "TableFullError", "PrefetchState", "warm_start",
]
