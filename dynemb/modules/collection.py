"""``DynamicEmbCollection``: a drop-in ``EmbeddingCollection`` backed by dynamic tables."""
# No ``from __future__ import annotations``: fx copies forward's annotations into a traced
# graph, and string ones make such a GraphModule fail to torch.save.

from typing import Any, Dict, List, Mapping, Optional, Union

import torch
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollectionInterface
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from dynemb.modules.collection_config import check_configs, output_name_of, output_names_by_table
from dynemb.modules.dynamic_core import trains_now
from dynemb.modules.dynamic_module import DynamicModule
from dynemb.modules.jagged import meta_outputs
from dynemb.modules.occurrence_lookup import OccurrenceLookup
from dynemb.rows.optimizers import OptimizerConfig
from dynemb.options import DynamicEmbTableOptions
from dynemb.modules.prefetch import PrefetchState
from dynemb.modules.table_views import TableViews, table_views
from dynemb.tables.lookup_batch import LookupBatch
from dynemb.modules.tracing import call_as_leaf, is_traced, traced_outputs
from dynemb.foundations.validation import check_kjt


class DynamicEmbCollection(EmbeddingCollectionInterface, DynamicModule):
    """``torchrec.EmbeddingCollection`` with hash-table rows: any int64 id, rows created on
    first sight, evicted by score, trained by a fused optimizer in backward.

    Same input and output as ``EmbeddingCollection``: ``forward(kjt)`` returns one
    ``JaggedTensor`` of float32 embeddings per feature, with the KJT's lengths.

    Args:
        tables: TorchRec ``EmbeddingConfig``s. The default ``max_capacity`` has room for
            ``num_embeddings`` distinct ids without evicting; several features may share a
            table, and a feature read by several tables gives one output per table,
            ``feature@table`` (TorchRec's names). Initial rows follow the config's
            ``weight_init_min/max`` (or ``init_fn``) as TorchRec's do.
        device: where the tables live.
        table_options: one :class:`DynamicEmbTableOptions` for every table, or a dict by
            table name (tables left out get the defaults).
        optimizer: the fused optimizer (:class:`~dynemb.rows.optimizers.OptimizerConfig`); its
            learning rate can be changed between steps through :attr:`fused_optimizer`.
        need_indices: also return the ids as the ``weights`` of each JaggedTensor.
        validate_inputs: check each KJT (features, dtype, lengths, reserved ids) before any
            table changes. On CUDA this reads the lengths on the host; turn it off for a
            sync-free step once inputs are trusted.
        backend: "cpu" or "cuda" to override the kernels picked by device (e.g. "cuda" to
            run the CUDA kernels under numba's simulator).
        group_tables: train the tables that share a shape (dim, dtype, optimizer, score
            policy, fixed capacity, ...) as one group, one kernel call per phase for all of
            them (:mod:`dynemb.tables.groups`); every table keeps its own rows, capacity,
            counters and checkpoint entries. False: every table runs alone (the same results,
            table by table).

    On ``device="meta"`` no table is allocated: the module only describes its tables, for
    :class:`~dynemb.sharding.DynamicEmbCollectionSharder` to build them on each rank; its
    ``forward`` returns meta outputs of the right shapes, as TorchRec's does.

    Example::

        >>> ec = DynamicEmbCollection(
        ...     tables=[EmbeddingConfig(name="t", embedding_dim=8, num_embeddings=1024,
        ...                             feature_names=["f"])],
        ...     optimizer=OptimizerConfig(OptimizerType.ADAM, learning_rate=1e-3))
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([10**12, 7]),
        ...                                           torch.tensor([1, 1]))
        >>> ec(kjt)["f"].values().shape
        torch.Size([2, 8])
    """

    def __init__(self, tables: List[EmbeddingConfig], device: Optional[torch.device] = None, *,
                 table_options: Union[DynamicEmbTableOptions,
                                      Mapping[str, DynamicEmbTableOptions], None] = None,
                 optimizer: Optional[OptimizerConfig] = None, need_indices: bool = False,
                 validate_inputs: bool = True, backend: Optional[str] = None,
                 group_tables: bool = True):
        super().__init__()
        configs = check_configs(tables, EmbeddingConfig)
        self._build_core(configs, device, table_options=table_options, optimizer=optimizer,
                         validate_inputs=validate_inputs, backend=backend,
                         group_tables=group_tables)
        self._need_indices = need_indices
        self._output_name = output_name_of(configs)  # (table, feature) -> output
        self._output_names = [n for names in output_names_by_table(configs) for n in names]

    # -- TorchRec's EmbeddingCollectionInterface ---------------------------------------------
    def embedding_configs(self) -> List[EmbeddingConfig]:
        return self._core.configs

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        dims = sorted({c.embedding_dim for c in self._core.configs})
        if len(dims) > 1:
            raise ValueError(f"tables have different embedding dims {dims}")
        return dims[0]

    def embedding_names_by_table(self) -> List[List[str]]:  # TorchRec's (feature@table)
        return output_names_by_table(self._core.configs)

    @property
    def embeddings(self) -> TableViews:
        """Each table's device, dtype and size where TorchRec's module has its
        ``nn.Embedding``: ``embeddings[name].weight.device`` and so on; no values
        (:mod:`dynemb.modules.table_views`)."""
        return table_views(self._core.configs, self._core.table_options, self._core.device)

    # -- forward -----------------------------------------------------------------------------
    # numba kernels and host-side bookkeeping: torch.compile runs this eagerly (graph break)
    @torch.compiler.disable
    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        """Embeddings of ``features`` (a KJT; TorchRec's argument name) per feature.

        A training forward with autograd on consumes the oldest prefetched state (or
        prefetches inline when none is queued) and its rows stay pinned until its backward or
        the next training forward, whichever comes first. In eval mode or under
        ``torch.no_grad()`` the lookup is read-only: nothing is inserted, rescored or
        updated, unseen ids get the eval initializer, and queued training batches are left
        for the training forward they were prefetched for."""
        kjt = features
        if is_traced(kjt):  # symbolic tracing: one call_module node (dynemb.modules.tracing)
            return traced_outputs(call_as_leaf(self, kjt), self._output_names)
        if self._core.is_meta:
            check_kjt(kjt, kjt.values().device, check_lengths=False, variable_batch=True)
            return meta_outputs(kjt, self._core.configs, self._output_name, self._need_indices)
        trains = trains_now(self)
        out: Dict[str, Any] = {}
        with self._core.lookup(kjt, trains) as state:
            for batch in state.distinct_batches():
                out.update(self._outputs(batch, state, trains, kjt))
        return {n: out[n] for n in self._output_names if n in out}

    def _outputs(self, batch: LookupBatch, state: PrefetchState, trains: bool,
                 kjt: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        """The outputs of a batch's tables (a group's, or one table's) from one gather,
        split straight into one part per feature. In training their backward hands the
        output gradients to the fused optimizer kernel, which clips and sums them per row
        itself."""
        segments = [(name, feature, count) for name in batch.names
                    for feature, count in state.features[name]]
        sizes = [count for _, _, count in segments]
        if trains:
            anchor = torch.empty(0, device=self._core.device, requires_grad=True)
            part_tables = [batch.names.index(name) for name, _, _ in segments]
            parts = OccurrenceLookup.apply(anchor, self._core, batch, sizes, part_tables)
        else:
            parts = batch.lookup_occurrences(sizes)
        lengths = state.lengths
        return {self._output_name[(name, feature)]: JaggedTensor(
                    values=values, lengths=lengths[feature],
                    weights=kjt[feature].values() if self._need_indices else None)
                for (name, feature, _), values in zip(segments, parts)}
