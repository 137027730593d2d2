"""``ShardedDynamicEmbCollection``: a :class:`DynamicEmbCollection` split row-wise over ranks.

One step, for each group of tables with the same embedding dim:

1. ``input_dist``: each rank dedups its ids per table, routes every distinct id to its owner
   (:mod:`dynemb.sharding.routing`) and sends them with TorchRec's ``KJTAllToAll``;
2. ``prefetch`` / ``compute``: the owner resolves the ids it received in its local
   :class:`DynamicEmbCollection` (one table per rank's share), which gathers their rows;
3. ``output_dist``: TorchRec's sequence all-to-all returns the rows, and the ``gather`` index
   expands them to one per occurrence (its backward sums gradients per distinct id);
4. backward: the all-to-all returns the gradients to the owners, where the local collection
   applies the fused optimizer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torchrec.distributed.embedding import EmbeddingCollectionContext
from torchrec.distributed.embedding_sharding import KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import KJTList, ShardedEmbeddingModule
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingDist
from torchrec.distributed.sharding.sequence_sharding import SequenceShardingContext
from torchrec.distributed.types import (Awaitable, LazyAwaitable, ParameterSharding,
                                        ShardingEnv, ShardingType)
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from dynemb.modules.collection import DynamicEmbCollection
from dynemb.modules.collection_config import output_name_of, output_names_by_table
from dynemb.modules.jagged import cut_by_feature
from dynemb.optimizer_config import OptimizerConfig
from dynemb.sharding.input_dist import DedupRwSparseFeaturesDist
from dynemb.modules.rank_share import local_table_config, local_table_options
from dynemb.sharding.routing import RoutedIds
from dynemb.sharding.step_check import BackwardStepCheck
from dynemb.sharding.sharded_tables import SavedBySharded, ShardedTables, check_plan  # noqa: F401
from dynemb.foundations.validation import canonical_device, check_keys, check_kjt

@dataclass
class DynamicEmbShardingContext(EmbeddingCollectionContext):
    """TorchRec's EC context plus, per table group, the routing of the ids this rank sent
    and the lengths of each input feature."""

    routings: List[RoutedIds] = field(default_factory=list)
    feature_lengths: Dict[str, torch.Tensor] = field(default_factory=dict)
    feature_ids: Dict[str, torch.Tensor] = field(default_factory=dict)
    feature_order: List[str] = field(default_factory=list)
    received: Optional[KeyedJaggedTensor] = None
    batch: int = 0  # the number of the module's input dist (checked across ranks)

    def __post_init__(self) -> None:
        # TorchRec before 1.8 sets its context's fields in an __init__ of its own, which the
        # dataclass __init__ above does not call
        if not hasattr(self, "sharding_contexts"):
            EmbeddingCollectionContext.__init__(self)

    def record_stream(self, stream: torch.Stream) -> None:
        super().record_stream(stream)
        for routing in self.routings:
            for tensor in (routing.values, routing.counts, routing.lengths, routing.gather):
                tensor.record_stream(stream)
        for tensor in list(self.feature_lengths.values()) + list(self.feature_ids.values()):
            tensor.record_stream(stream)
        if self.received is not None:
            self.received.record_stream(stream)


class DynamicEmbOutputAwaitable(LazyAwaitable[Dict[str, JaggedTensor]]):
    """Waits for each group's sequence all-to-all and cuts the rows into one
    ``JaggedTensor`` per input feature."""

    def __init__(self, awaitables: List[Awaitable[torch.Tensor]],
                 ctx: DynamicEmbShardingContext, need_indices: bool,
                 check: BackwardStepCheck, feature_of: Dict[str, str]) -> None:
        super().__init__()
        self._awaitables = awaitables
        self._feature_of = feature_of  # output name -> the input feature it reads
        self._ctx = ctx
        self._need_indices = need_indices
        self._check = check

    def _wait_impl(self) -> Dict[str, JaggedTensor]:
        out: Dict[str, JaggedTensor] = {}
        received = self._check.attach([awaitable.wait() for awaitable in self._awaitables])
        for rows, routing in zip(received, self._ctx.routings):
            ids = self._ctx.feature_ids if self._need_indices else None
            out.update(cut_by_feature(rows, routing.segments,
                                      self._ctx.feature_lengths, ids, self._feature_of))
        return {f: out[f] for f in self._ctx.feature_order if f in out}


class LocalShardCollection(SavedBySharded, DynamicEmbCollection):
    """One rank's share of the tables: a :class:`DynamicEmbCollection` fed deduplicated ids
    whose KJT weights count their occurrences (so admission, LFU scores and the counters see
    every occurrence)."""

    _weights_are_counts = True


class ShardedDynamicEmbCollection(
        ShardedTables, ShardedEmbeddingModule[KJTList, List[torch.Tensor], Dict[str, JaggedTensor],
                               DynamicEmbShardingContext],
        FusedOptimizerModule):
    """The sharded form of :class:`DynamicEmbCollection` (built by
    :class:`~dynemb.sharding.DynamicEmbCollectionSharder`; not constructed by hand).

    Each rank holds its share of every table in :attr:`local` (a
    :class:`DynamicEmbCollection` with one feature per table), so ``stats()``,
    ``storage_modes()`` and ``read_rows`` work per rank. Features of the input KJT that
    belong to no table of this module are ignored, as TorchRec's sharded modules do (one KJT
    often feeds several modules); outputs are named and ordered as the unsharded module's
    (``feature@table`` for a feature that several tables read).
    """

    def __init__(self, module: DynamicEmbCollection,
                 table_name_to_parameter_sharding: Dict[str, ParameterSharding],
                 env: ShardingEnv, device: Optional[torch.device] = None,
                 module_fqn: Optional[str] = None,
                 optimizer: Optional[OptimizerConfig] = None) -> None:
        super().__init__()
        configs = module.embedding_configs()
        self._join(env, configs, table_name_to_parameter_sharding, module_fqn)
        pg = self._pg
        self._need_indices = module.need_indices()
        options = module.table_options
        device = canonical_device(device if device is not None else "cpu")
        self.local = LocalShardCollection(
            [local_table_config(c, self._world_size) for c in configs], device,
            table_options={c.name: local_table_options(options[c.name], self._world_size)
                           for c in configs},
            optimizer=(optimizer if optimizer is not None  # the sharder's fused_params
                       else module.optimizer_config if module.optimizer_given else None),
            validate_inputs=False,  # checked at input dist
            backend=module.backend, group_tables=module.group_tables)
        self._validate = module.validate_inputs
        self._features = {f for c in configs for f in c.feature_names}
        output_name = output_name_of(configs)
        self._output_names = [n for names in output_names_by_table(configs) for n in names]
        self._feature_of = {n: f for (_, f), n in output_name.items()}
        self._group_tables: List[List[str]] = []
        dims: Dict[int, List] = {}
        for c in configs:
            dims.setdefault(c.embedding_dim, []).append(c)
        input_dists, output_dists = [], []
        for dim in sorted(dims):
            group = dims[dim]
            self._group_tables.append([c.name for c in group])
            input_dists.append(DedupRwSparseFeaturesDist(
                pg, [(c.name, c.feature_names, options[c.name].sharding) for c in group],
                self._where, output_name))
            output_dists.append(RwSequenceEmbeddingDist(pg, len(group), device))
        # plain lists, as TorchRec's sharded modules keep theirs: their buffers (world-size
        # dependent permutations) are not model state and stay out of the state dict
        self._input_dists: List[torch.nn.Module] = input_dists
        self._output_dists: List[torch.nn.Module] = output_dists

    # -- TorchRec ShardedModule API (forward, compute_and_output_dist: ShardedTables) ---------
    def create_context(self) -> DynamicEmbShardingContext:
        return DynamicEmbShardingContext()

    def input_dist(self, ctx: DynamicEmbShardingContext,
                   features: KeyedJaggedTensor) -> Awaitable[Awaitable[KJTList]]:
        # on the sending rank, before any collective
        check_kjt(features, self.local.device, check_lengths=self._validate)
        mine = [f for f in features.keys() if f in self._features]
        jts = features.to_dict()
        if self._validate:
            for f in mine:
                check_keys(jts[f].values().to(torch.int64), jts[f].values().device,
                           name=f"ids of feature {f!r}")
        ctx.feature_order = [n for n in self._output_names if self._feature_of[n] in jts]
        ctx.batch = self._next_batch()
        ctx.feature_lengths = {f: jts[f].lengths() for f in mine}
        if self._need_indices:
            ctx.feature_ids = {f: jts[f].values() for f in mine}
        awaitables = []
        for dist in self._input_dists:
            awaitables.append(dist(features, ctx.batch))
            routing = dist.routing
            ctx.routings.append(routing)
            ctx.sharding_contexts.append(SequenceShardingContext(
                features_before_input_dist=features,
                unbucketize_permute_tensor=routing.gather))
        return KJTListSplitsAwaitable(awaitables, ctx, self._module_fqn,
                                      [ShardingType.ROW_WISE.value] * len(awaitables))

    def prefetch(self, dist_input: KJTList, forward_stream: Optional[torch.Stream] = None,
                 ctx: Optional[DynamicEmbShardingContext] = None) -> None:
        """Resolve the received ids to slots ahead of ``compute`` (called by TorchRec's
        prefetch pipeline on its prefetch stream); the next ``compute`` consumes it."""
        received = self._merge(dist_input)
        if ctx is not None:
            ctx.received = received
        self.local.prefetch(received, forward_stream)

    def compute(self, ctx: DynamicEmbShardingContext, dist_input: KJTList) -> List[torch.Tensor]:
        for kjt, sharding_ctx in zip(dist_input, ctx.sharding_contexts):
            sharding_ctx.lengths_after_input_dist = kjt.lengths().view(-1, kjt.stride())
        received = ctx.received if ctx.received is not None else self._merge(dist_input)
        rows = self.local(received)
        return [torch.cat([rows[t].values() for t in tables])
                for tables in self._group_tables]

    def output_dist(self, ctx: DynamicEmbShardingContext,
                    output: List[torch.Tensor]) -> LazyAwaitable[Dict[str, JaggedTensor]]:
        awaitables = [dist(rows, sharding_ctx) for dist, rows, sharding_ctx
                      in zip(self._output_dists, output, ctx.sharding_contexts)]
        return DynamicEmbOutputAwaitable(awaitables, ctx, self._need_indices,
                                         self._backward_check(ctx.batch), self._feature_of)

    @staticmethod
    def _merge(dist_input: KJTList) -> KeyedJaggedTensor:
        kjts = list(dist_input)
        return kjts[0] if len(kjts) == 1 else KeyedJaggedTensor.concat(kjts)

    # -- dynemb views (the rest come from ShardedTables) ------------------------------------
    def need_indices(self) -> bool:
        return self._need_indices

    def extra_repr(self) -> str:
        return f"world_size={self._world_size}, groups={self._group_tables}"

