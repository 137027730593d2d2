"""Row-wise sharding of :class:`~dynemb.DynamicEmbCollection` and
:class:`~dynemb.DynamicEmbBagCollection` for TorchRec's ``DistributedModelParallel`` and train
pipelines: the sharders to pass it, the sharded modules it builds (not constructed by hand)
and the error ranks out of step raise. Which rank owns a key:
:func:`dynemb.sharding.routing.owner_ranks`."""
from dynemb.sharding.sharded_bag_collection import ShardedDynamicEmbBagCollection
from dynemb.sharding.sharded_collection import ShardedDynamicEmbCollection
from dynemb.sharding.sharder import DynamicEmbBagCollectionSharder, DynamicEmbCollectionSharder
from dynemb.sharding.step_check import RankDesyncError

__all__ = ["DynamicEmbBagCollectionSharder", "DynamicEmbCollectionSharder", "RankDesyncError",
           "ShardedDynamicEmbBagCollection", "ShardedDynamicEmbCollection"]
