"""``DynamicEmbCollectionSharder`` and ``DynamicEmbBagCollectionSharder``: let TorchRec's
planner and DistributedModelParallel shard :class:`DynamicEmbCollection` and
:class:`DynamicEmbBagCollection` modules."""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Type

import torch
from torchrec.distributed.types import (EmbeddingModuleShardingPlan, ModuleSharder,
                                        QuantizedCommCodecs, ShardingEnv)
from torchrec.modules.embedding_configs import data_type_to_dtype

from dynemb.modules.bag_collection import DynamicEmbBagCollection
from dynemb.modules.collection import DynamicEmbCollection
from dynemb.planning.defaults import install_default_estimators
from dynemb.optimizer_config import OptimizerConfig
from dynemb.modules.fused_params import (checked_fused_params, fused_params_optimizer,
                                 sharded_optimizer)
from dynemb.sharding.sharded_bag_collection import ShardedDynamicEmbBagCollection
from dynemb.sharding.sharded_collection import ShardedDynamicEmbCollection
from dynemb.sharding.sharded_tables import SUPPORTED_COMPUTE_KERNELS, SUPPORTED_SHARDING_TYPES


class DynamicEmbCollectionSharder(ModuleSharder[DynamicEmbCollection]):
    """Shards every table of a :class:`DynamicEmbCollection` row-wise over all ranks.

    The planner sees each table as a ``num_embeddings x embedding_dim`` parameter on the meta
    device (nothing is allocated), sharding type ``row_wise`` and compute kernel
    ``customized_kernel`` (the only ones it offers). Which rank owns a key is the table's
    :attr:`DynamicEmbTableOptions.sharding`.

    Args:
        fused_params: TorchRec's sharder ``fused_params``; the optimizer keys
            (``optimizer``, ``learning_rate``, ``eps``, ...) configure the tables' fused
            optimizer (:func:`~dynemb.modules.fused_params.fused_params_optimizer`), which
            must then agree with any ``optimizer=`` given to the module; other keys are
            ignored. Checked here: an unsupported optimizer raises at construction. An
            optimizer marked on the module's table parameters by
            ``apply_optimizer_in_backward`` overrides these keys, as in TorchRec.
        qcomm_codecs_registry: accepted as TorchRec's sharders do; unused (ids and rows
            travel unquantized).

    Building one also lets TorchRec's default planner (``DistributedModelParallel``
    without a plan, ``EmbeddingShardingPlanner()``) estimate dynamic tables
    (:func:`~dynemb.planning.defaults.install_default_estimators`).

    Example::

        >>> from fbgemm_gpu.split_embedding_configs import EmbOptimType
        >>> sharder = DynamicEmbCollectionSharder(fused_params={
        ...     "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1})
        >>> sharder.optimizer_config.type
        <OptimizerType.ROWWISE_ADAGRAD: 'rowwise_adagrad'>
        >>> model = DistributedModelParallel(model, sharders=[sharder])  # doctest: +SKIP
    """

    def __init__(self, fused_params: Optional[Mapping[str, Any]] = None,
                 qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None
                 ) -> None:
        super().__init__(qcomm_codecs_registry=qcomm_codecs_registry)
        self._fused_params = checked_fused_params(fused_params)
        self._fused_optimizer = fused_params_optimizer(self._fused_params)
        install_default_estimators()

    @property
    def fused_params(self) -> Optional[Dict[str, Any]]:
        return self._fused_params

    @property
    def optimizer_config(self) -> Optional[OptimizerConfig]:
        """The optimizer ``fused_params`` configure (None: they configure none)."""
        return self._fused_optimizer

    def shard(self, module: DynamicEmbCollection, params: EmbeddingModuleShardingPlan,
              env: ShardingEnv, device: Optional[torch.device] = None,
              module_fqn: Optional[str] = None) -> ShardedDynamicEmbCollection:
        return ShardedDynamicEmbCollection(module, dict(params), env, device, module_fqn,
                                           **self._override(module, module_fqn))

    def _override(self, module: DynamicEmbCollection, module_fqn: Optional[str]) -> dict:
        """The sharded module's ``optimizer=`` when ``fused_params`` or the marks of
        ``apply_optimizer_in_backward`` on the module's table parameters configure one (else
        the module's own applies). A mark wins over ``fused_params`` key by key, as in
        TorchRec (``merge_fused_params``); the result must agree with the module's own
        ``optimizer=`` if it has one."""
        optimizer = sharded_optimizer(module, self._fused_params, module_fqn)
        return {} if optimizer is None else {"optimizer": optimizer}

    @property
    def module_type(self) -> Type[DynamicEmbCollection]:
        return DynamicEmbCollection

    def shardable_parameters(self, module: DynamicEmbCollection) -> Dict[str, torch.nn.Parameter]:
        return {c.name: torch.nn.Parameter(
                    torch.empty(c.num_embeddings, c.embedding_dim, device="meta",
                                dtype=data_type_to_dtype(c.data_type)), requires_grad=False)
                for c in module.table_configs()}

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
        return ShardedDynamicEmbBagCollection(module, dict(params), env, device, module_fqn,
                                              **self._override(module, module_fqn))

    @property
    def module_type(self) -> Type[DynamicEmbBagCollection]:
        return DynamicEmbBagCollection
