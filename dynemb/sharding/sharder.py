"""``DynamicEmbCollectionSharder`` and ``DynamicEmbBagCollectionSharder``: let TorchRec's
planner and DistributedModelParallel shard :class:`DynamicEmbCollection` and
:class:`DynamicEmbBagCollection` modules."""
from __future__ import annotations

from typing import Dict, List, Optional, Type

import torch
from torchrec.distributed.types import (EmbeddingModuleShardingPlan, ModuleSharder,
                                        ShardingEnv)
from torchrec.modules.embedding_configs import data_type_to_dtype

from dynemb.bag_collection import DynamicEmbBagCollection
from dynemb.collection import DynamicEmbCollection
from dynemb.sharding.sharded_bag_collection import ShardedDynamicEmbBagCollection
from dynemb.sharding.sharded_collection import ShardedDynamicEmbCollection
from dynemb.sharding.sharded_tables import SUPPORTED_COMPUTE_KERNELS, SUPPORTED_SHARDING_TYPES


class DynamicEmbCollectionSharder(ModuleSharder[DynamicEmbCollection]):
    """Shards every table of a :class:`DynamicEmbCollection` row-wise over all ranks.

    The planner sees each table as a ``num_embeddings x embedding_dim`` parameter on the meta
    device (nothing is allocated), sharding type ``row_wise`` and compute kernel
    ``customized_kernel``; constrain dynamic tables to those. Which rank owns a key is the
    table's :attr:`DynamicEmbTableOptions.sharding`.

    Example::

        >>> sharders = [DynamicEmbCollectionSharder(), EmbeddingCollectionSharder()]  # doctest: +SKIP
        >>> plan = planner.collective_plan(model, sharders, pg)  # doctest: +SKIP
        >>> model = DistributedModelParallel(model, plan=plan, sharders=sharders)  # doctest: +SKIP
    """

    def shard(self, module: DynamicEmbCollection, params: EmbeddingModuleShardingPlan,
              env: ShardingEnv, device: Optional[torch.device] = None,
              module_fqn: Optional[str] = None) -> ShardedDynamicEmbCollection:
        return ShardedDynamicEmbCollection(module, dict(params), env, device, module_fqn)

    @property
    def module_type(self) -> Type[DynamicEmbCollection]:
        return DynamicEmbCollection

    def shardable_parameters(self, module: DynamicEmbCollection) -> Dict[str, torch.nn.Parameter]:
        return {c.name: torch.nn.Parameter(
                    torch.empty(c.num_embeddings, c.embedding_dim, device="meta",
                                dtype=data_type_to_dtype(c.data_type)), requires_grad=False)
                for c in module.embedding_configs()}

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return list(SUPPORTED_SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return list(SUPPORTED_COMPUTE_KERNELS)


class DynamicEmbBagCollectionSharder(DynamicEmbCollectionSharder):
    """Shards every table of a :class:`DynamicEmbBagCollection` row-wise over all ranks, as
    :class:`DynamicEmbCollectionSharder` does for the sequence module; the pooled outputs
    come back through TorchRec's row-wise reduce-scatter.

    Example::

        >>> sharders = [DynamicEmbBagCollectionSharder(), EmbeddingBagCollectionSharder()]  # doctest: +SKIP
        >>> model = DistributedModelParallel(model, plan=plan, sharders=sharders)  # doctest: +SKIP
    """

    def shard(self, module: DynamicEmbBagCollection, params: EmbeddingModuleShardingPlan,
              env: ShardingEnv, device: Optional[torch.device] = None,
              module_fqn: Optional[str] = None) -> ShardedDynamicEmbBagCollection:
        return ShardedDynamicEmbBagCollection(module, dict(params), env, device, module_fqn)

    @property
    def module_type(self) -> Type[DynamicEmbBagCollection]:
        return DynamicEmbBagCollection
