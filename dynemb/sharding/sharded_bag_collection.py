"""``ShardedDynamicEmbBagCollection``: a :class:`~dynemb.DynamicEmbBagCollection` split
row-wise over ranks, with TorchRec's pooled row-wise output path.

One step:

1. ``input_dist``: every id of the module's features goes to the rank that owns it, in its
   bag (:mod:`dynemb.sharding.bag_input_dist`), through TorchRec's ``KJTAllToAll``;
2. ``prefetch`` / ``compute``: the owner looks the ids up in its share of the tables and
   pools each bag it received by SUM (times the per-id weights): one partial sum per
   (sample, feature) of every rank's batch;
3. ``output_dist``: TorchRec's pooled reduce-scatter adds the owners' partial sums and hands
   each rank its samples' bags; MEAN features are then divided by their bag lengths (as
   TorchRec's row-wise EBC does), on the rank whose samples they are;
4. backward: the reduce-scatter's all-gather returns each bag's gradient to every owner,
   which applies the fused optimizer to its rows.

What travels back is one vector per (sample, feature, rank), not one per id. Ranks may hold
different batch sizes: the partial sums of each rank's samples are padded to the largest
batch, so the collective is the even reduce-scatter (gloo has no uneven all-gather for its
backward).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torchrec.distributed.dist_data import PooledEmbeddingsReduceScatter
from torchrec.distributed.embedding_sharding import (EmbeddingShardingContext,
                                                     KJTListSplitsAwaitable)
from torchrec.distributed.embedding_types import KJTList, ShardedEmbeddingModule
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionContext
from torchrec.distributed.types import (Awaitable, LazyAwaitable, ParameterSharding,
                                        ShardingEnv, ShardingType)
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from dynemb.modules.bag_collection import DynamicEmbBagCollection, check_bag_kjt
from dynemb.modules.collection_config import output_names_by_table
from dynemb.optimizer_config import OptimizerConfig
from dynemb.sharding.bag_input_dist import RwBagSparseFeaturesDist
from dynemb.modules.rank_share import local_table_options, rows_per_rank
from dynemb.sharding.sharded_tables import SavedBySharded, ShardedTables
from dynemb.sharding.step_check import BackwardStepCheck
from dynemb.foundations.validation import canonical_device, check_keys, check_kjt


@dataclass
class DynamicEmbBagShardingContext(EmbeddingBagCollectionContext):
    """TorchRec's EBC context plus this rank's batch size and the divisor of its MEAN
    features ([B, sum of dims]: the bag length under MEAN features' columns, 1 elsewhere)."""

    batch_size: int = 0
    divisor: Optional[torch.Tensor] = None
    received: Optional[KeyedJaggedTensor] = None
    batch: int = 0  # the number of the module's input dist (checked across ranks)

    def record_stream(self, stream: torch.Stream) -> None:
        super().record_stream(stream)
        if self.divisor is not None:
            self.divisor.record_stream(stream)
        if self.received is not None:
            self.received.record_stream(stream)


class _PooledOutputAwaitable(LazyAwaitable[KeyedTensor]):
    """Waits for the reduce-scatter, drops the padding, divides MEAN bags, keys the result."""

    def __init__(self, awaitable: Awaitable[torch.Tensor], ctx: DynamicEmbBagShardingContext,
                 keys: List[str], dims: List[int], check: BackwardStepCheck) -> None:
        super().__init__()
        self._awaitable, self._ctx, self._keys, self._dims = awaitable, ctx, keys, dims
        self._check = check

    def _wait_impl(self) -> KeyedTensor:
        values = self._check.attach([self._awaitable.wait()])[0][:self._ctx.batch_size]
        if self._ctx.divisor is not None:
            values = values / self._ctx.divisor
        return KeyedTensor(keys=self._keys, length_per_key=self._dims, values=values)


class LocalBagShard(SavedBySharded, DynamicEmbBagCollection):
    """One rank's share of the tables: a :class:`DynamicEmbBagCollection` with the module's
    features, pooling every bag by SUM (MEAN is applied after the reduce-scatter)."""


def local_bag_config(config: EmbeddingBagConfig, world_size: int,
                     feature_names: Optional[List[str]] = None) -> EmbeddingBagConfig:
    """One rank's config of ``config``'s table: a share of its rows, pooled by SUM, read by
    ``feature_names`` (default: the table's; the sharded module passes its output names, so
    that a feature read by several tables reaches each under its own name)."""
    return EmbeddingBagConfig(
        name=config.name, embedding_dim=config.embedding_dim,
        num_embeddings=rows_per_rank(config.num_embeddings, world_size),
        feature_names=list(feature_names or config.feature_names), data_type=config.data_type,
        pooling=PoolingType.SUM)


class ShardedDynamicEmbBagCollection(
        ShardedTables,
        ShardedEmbeddingModule[KJTList, List[torch.Tensor], KeyedTensor,
                               DynamicEmbBagShardingContext],
        FusedOptimizerModule):
    """The sharded form of :class:`~dynemb.DynamicEmbBagCollection` (built by
    :class:`~dynemb.sharding.DynamicEmbBagCollectionSharder`; not constructed by hand).

    ``forward(kjt)`` returns what the unsharded module would for this rank's samples: a
    ``KeyedTensor`` [B, sum of dims] keyed by feature in config order. Each rank holds its
    share of every table in :attr:`local`, so ``stats()``, ``storage_modes()`` and
    ``read_rows`` work per rank. Features of the input KJT that belong to no table of this
    module are ignored (one KJT often feeds several modules); every feature of the module
    must be there. A feature read by several tables travels once per table, under its
    output name (``feature@table``); an unweighted module drops the KJT's weights before
    they travel.
    """

    def __init__(self, module: DynamicEmbBagCollection,
                 table_name_to_parameter_sharding: Dict[str, ParameterSharding],
                 env: ShardingEnv, device: Optional[torch.device] = None,
                 module_fqn: Optional[str] = None,
                 optimizer: Optional[OptimizerConfig] = None) -> None:
        super().__init__()
        configs = module.embedding_bag_configs()
        self._join(env, configs, table_name_to_parameter_sharding, module_fqn)
        pg = self._pg
        self._is_weighted = module.is_weighted()
        options = module.table_options
        device = canonical_device(device if device is not None else "cpu")
        names = output_names_by_table(configs)
        self.local = LocalBagShard(
            [local_bag_config(c, self._world_size, n) for c, n in zip(configs, names)],
            is_weighted=self._is_weighted, device=device,
            table_options={c.name: local_table_options(options[c.name], self._world_size)
                           for c in configs},
            optimizer=(optimizer if optimizer is not None  # the sharder's fused_params
                       else module.optimizer_config if module.optimizer_given else None),
            validate_inputs=False,  # checked at input dist
            backend=module.backend, group_tables=module.group_tables)
        self._validate = module.validate_inputs
        # outputs (and what travels) in config order; each reads its source feature
        self._features = [n for table_names in names for n in table_names]
        self._sources = [f for c in configs for f in c.feature_names]
        self._dims = [c.embedding_dim for c in configs for _ in c.feature_names]
        self._mean_features = {n for c, table_names in zip(configs, names)
                               if c.pooling == PoolingType.MEAN for n in table_names}
        # plain lists, as TorchRec's sharded modules keep theirs (out of the state dict)
        self._input_dists: List[torch.nn.Module] = [RwBagSparseFeaturesDist(
            pg, self._features,
            {n: options[c.name].sharding for c, table_names in zip(configs, names)
             for n in table_names},
            self._where)]
        self._output_dists: List[torch.nn.Module] = [PooledEmbeddingsReduceScatter(pg)]

    # -- TorchRec ShardedModule API (forward, compute_and_output_dist: ShardedTables) ---------
    def create_context(self) -> DynamicEmbBagShardingContext:
        return DynamicEmbBagShardingContext()

    def input_dist(self, ctx: DynamicEmbBagShardingContext,
                   features: KeyedJaggedTensor) -> Awaitable[Awaitable[KJTList]]:
        mine = self._select(features)
        ctx.batch_size = mine.stride()
        ctx.divisor = self._divisor(mine)
        ctx.batch = self._next_batch()
        ctx.sharding_contexts.append(EmbeddingShardingContext())
        return KJTListSplitsAwaitable([self._input_dists[0](mine, ctx.batch)], ctx,
                                      self._module_fqn,
                                      [ShardingType.ROW_WISE.value])

    def _select(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """This module's features of ``features``, in config order under their output names
        (a feature of several tables once per table), checked (on the sending rank, before
        any collective, so a bad batch changes no rank's tables). An unweighted module drops
        the weights: every rank must send the same kind of KJT."""
        check_kjt(features, self.local.device, check_lengths=self._validate)
        check_bag_kjt(features, list(dict.fromkeys(self._sources)), self._is_weighted)
        index = {f: i for i, f in enumerate(features.keys())}
        order = [index[f] for f in self._sources]
        mine = features if order == list(range(len(index))) else features.permute(order)
        if mine.keys() != self._features or (not self._is_weighted
                                             and mine.weights_or_none() is not None):
            mine = KeyedJaggedTensor(
                keys=self._features, values=mine.values(), lengths=mine.lengths(),
                weights=mine.weights_or_none() if self._is_weighted else None,
                stride=mine.stride())
        if self._validate:
            check_keys(mine.values().to(torch.int64), mine.values().device,
                       name=f"ids of features {self._features}")
        return mine

    def _divisor(self, mine: KeyedJaggedTensor) -> Optional[torch.Tensor]:
        if not self._mean_features:
            return None
        lengths = mine.lengths().view(len(self._features), -1).to(torch.float32)
        is_mean = torch.tensor([f in self._mean_features for f in self._features],
                               device=lengths.device).unsqueeze(1)
        per_bag = torch.where(is_mean, lengths.clamp(min=1), torch.ones_like(lengths))
        return per_bag.t().repeat_interleave(
            torch.tensor(self._dims, device=lengths.device), dim=1)

    def prefetch(self, dist_input: KJTList, forward_stream: Optional[torch.Stream] = None,
                 ctx: Optional[DynamicEmbBagShardingContext] = None) -> None:
        """Resolve the received ids to slots ahead of ``compute`` (called by TorchRec's
        prefetch pipeline on its prefetch stream); the next ``compute`` consumes it."""
        received = dist_input[0]
        if ctx is not None:
            ctx.received = received
        self.local.prefetch(received, forward_stream)

    def compute(self, ctx: DynamicEmbBagShardingContext,
                dist_input: KJTList) -> List[torch.Tensor]:
        received = ctx.received if ctx.received is not None else dist_input[0]
        return [self.local(received).values()]

    def output_dist(self, ctx: DynamicEmbBagShardingContext,
                    output: List[torch.Tensor]) -> LazyAwaitable[KeyedTensor]:
        batch_sizes = ctx.sharding_contexts[0].batch_size_per_rank or [ctx.batch_size]
        partial = pad_per_rank(output[0], batch_sizes)
        return _PooledOutputAwaitable(self._output_dists[0](partial), ctx, self._features,
                                      self._dims, self._backward_check(ctx.batch))

    # -- dynemb views (the rest come from ShardedTables) ------------------------------------
    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return list(self._configs)

    def is_weighted(self) -> bool:
        return self._is_weighted

    def extra_repr(self) -> str:
        return f"world_size={self._world_size}, features={self._features}"


def pad_per_rank(rows: torch.Tensor, batch_sizes: List[int]) -> torch.Tensor:
    """``rows`` [sum of batch_sizes, D] (rank after rank) as [world * max batch, D], each
    rank's block zero-padded to the largest batch (unchanged when all are equal).

    Example::

        >>> pad_per_rank(torch.tensor([[1.], [2.], [3.]]), [1, 2]).flatten().tolist()
        [1.0, 0.0, 2.0, 3.0]
    """
    largest = max(batch_sizes)
    if all(b == largest for b in batch_sizes):
        return rows
    blocks = rows.split(list(batch_sizes))
    return torch.cat([torch.nn.functional.pad(b, (0, 0, 0, largest - b.shape[0]))
                      for b in blocks])
