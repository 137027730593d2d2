"""dynemb: dynamic (hash-table-backed) embeddings for TorchRec.

- :class:`DynamicEmbCollection`: drop-in ``EmbeddingCollection`` whose tables are hash tables
  (any int64 id, rows created on first sight, evicted by score, fused optimizer in backward);
- :class:`DynamicEmbBagCollection`: the same for ``EmbeddingBagCollection`` (pooled bags,
  ``KeyedTensor`` out);
- :class:`DynamicEmbTableOptions` / :class:`StorageMode`: how each table stores its rows;
  :class:`StashMode`: what of them waits in host memory between forward and backward
  (:mod:`dynemb.stashing`);
- :class:`ScoredHashTable`: int64 key -> slot, with scores for eviction and pins;
- :class:`FlatTable`: the value rows (row = slot);
- :class:`Initializer`: deterministic initial rows from (seed, table, key);
- :mod:`dynemb.sharding`: the row-wise sharder for TorchRec's DistributedModelParallel.
"""
from dynemb.backing_store import BackingStore, HostBackingStore
from dynemb.bag_collection import DynamicEmbBagCollection
from dynemb.collection import DynamicEmbCollection
from dynemb.fused_optimizer import DynamicEmbFusedOptimizer
from dynemb.flat_table import FlatTable
from dynemb.hash_table import ScoredHashTable
from dynemb.initializers import Initializer, InitializerKind
from dynemb.optimizers import OptimizerConfig, OptimizerType, fused_update
from dynemb.options import (DynamicEmbTableOptions, FrequencyAdmission, ShardingScheme,
                            StashMode, StorageMode)
from dynemb.prefetch import PrefetchState
from dynemb.types import (EMPTY_KEY, RESERVED_KEYS, TOMBSTONE_KEY, EraseResult, ExportBatch,
                          FindOrInsertResult, ScorePolicy, TableFullError)

__all__ = [
    "DynamicEmbCollection", "DynamicEmbBagCollection", "DynamicEmbFusedOptimizer", "DynamicEmbTableOptions",
    "FrequencyAdmission", "ShardingScheme", "StashMode", "StorageMode", "PrefetchState", "BackingStore", "HostBackingStore",
    "OptimizerConfig", "OptimizerType", "fused_update",
    "EMPTY_KEY", "TOMBSTONE_KEY", "RESERVED_KEYS", "ScoredHashTable", "FlatTable", "Initializer",
    "InitializerKind", "ScorePolicy", "FindOrInsertResult", "EraseResult", "ExportBatch",
    "TableFullError",
]
