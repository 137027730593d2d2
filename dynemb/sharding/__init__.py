"""Row-wise sharding of :class:`~dynemb.DynamicEmbCollection` for TorchRec's
``DistributedModelParallel`` and train pipelines."""
from dynemb.sharding.routing import owner_ranks
from dynemb.sharding.sharded_collection import ShardedDynamicEmbCollection
from dynemb.sharding.sharder import DynamicEmbCollectionSharder

__all__ = ["DynamicEmbCollectionSharder", "ShardedDynamicEmbCollection", "owner_ranks"]
