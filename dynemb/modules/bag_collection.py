"""``DynamicEmbBagCollection``: a drop-in ``EmbeddingBagCollection`` backed by dynamic tables.

It is the sibling of :class:`~dynemb.modules.collection.DynamicEmbCollection`: the same dynamic core
(tables, prefetch queue, pins, admission, scores, fused optimizers, checkpoints and memory
stashing, :mod:`dynemb.modules.dynamic_module`), pooling each feature's rows per sample
(:mod:`dynemb.modules.pooling`) instead of returning them one by one.
"""
# No ``from __future__ import annotations``: fx copies forward's annotations into a traced
# graph, and string ones make such a GraphModule fail to torch.save.

from typing import List, Mapping, Optional, Union

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from dynemb.modules.collection_config import check_configs, output_name_of, output_names_by_table
from dynemb.modules.dynamic_core import trains_now
from dynemb.modules.dynamic_module import DynamicModule
from dynemb.rows.optimizers import OptimizerConfig
from dynemb.options import DynamicEmbTableOptions
from dynemb.modules.pooling import Bags, PooledLookup, TableBags, pool_all
from dynemb.modules.prefetch import PrefetchState
from dynemb.modules.table_views import TableViews, table_views
from dynemb.modules.tracing import call_as_leaf, is_traced
from dynemb.foundations.validation import check_features_present, check_kjt

_MODES = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}


class DynamicEmbBagCollection(EmbeddingBagCollectionInterface, DynamicModule):
    """``torchrec.EmbeddingBagCollection`` with hash-table rows: any int64 id, rows created on
    first sight, evicted by score, trained by a fused optimizer in backward.

    Same input and output as ``EmbeddingBagCollection``: ``forward(kjt)`` returns a
    ``KeyedTensor`` whose keys are the output names in config order (table by table: the
    feature's name, ``feature@table`` for a feature that several tables read) and whose
    values [B, sum of the features' dims] hold, per sample and feature, the SUM (times
    the KJT's per-id weights when ``is_weighted``) or the MEAN of the feature's rows. An empty
    bag gives zeros. In backward each row of a bag gets the bag's gradient (times its weight,
    divided by the bag length for MEAN), summed per unique id, then the fused update.

    Args:
        tables: TorchRec ``EmbeddingBagConfig``s with ``pooling`` SUM or MEAN;
            the default ``max_capacity`` has room for ``num_embeddings`` distinct ids; several
            features may share a table, and a feature may feed several tables.
        is_weighted: the KJT carries one weight per id (SUM pooling only); an unweighted
            collection ignores the KJT's weights, as ``EmbeddingBagCollection`` does.
        device, table_options, optimizer, validate_inputs, backend, group_tables: as for
            :class:`~dynemb.modules.collection.DynamicEmbCollection`.

    Every feature of the collection must be in each KJT (as ``EmbeddingBagCollection``
    requires; features of no table are ignored); a KJT without one, or without weights on a
    weighted collection, raises ``ValueError`` before any table changes. KJTs with a batch
    size per feature (variable batch) are refused: the pooled output has one batch size.
    On ``device="meta"`` ``forward`` returns a meta ``KeyedTensor`` of the right shape.

    Example::

        >>> ebc = DynamicEmbBagCollection(
        ...     tables=[EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=1024,
        ...                                feature_names=["f", "g"], pooling=PoolingType.MEAN)],
        ...     optimizer=OptimizerConfig(OptimizerType.ADAM, learning_rate=1e-3))
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(
        ...     ["f", "g"], torch.tensor([10**12, 7, 7]), torch.tensor([2, 0, 1, 0]))
        >>> out = ebc(kjt)
        >>> out.keys(), out.values().shape
        (['f', 'g'], torch.Size([2, 16]))
        >>> out["f"][1].abs().sum().item()  # sample 1 has no id of "f"
        0.0
        >>> out.values().sum().backward()  # Adam updates the rows of ids 10**12 and 7
    """

    # the pooled output is [B, sum of dims]: one batch size for every feature
    _variable_batch = False

    def __init__(self, tables: List[EmbeddingBagConfig], is_weighted: bool = False,
                 device: Optional[torch.device] = None, *,
                 table_options: Union[DynamicEmbTableOptions,
                                      Mapping[str, DynamicEmbTableOptions], None] = None,
                 optimizer: Optional[OptimizerConfig] = None, validate_inputs: bool = True,
                 backend: Optional[str] = None, group_tables: bool = True):
        super().__init__()
        configs = check_configs(tables, EmbeddingBagConfig)
        for config in configs:
            if config.pooling not in _MODES:
                raise ValueError(f"table {config.name!r}: pooling must be PoolingType.SUM or "
                                 f"PoolingType.MEAN, got {config.pooling}")
            if is_weighted and config.pooling != PoolingType.SUM:
                raise ValueError(f"table {config.name!r}: a weighted collection pools by "
                                 f"SUM only (per-id weights with {config.pooling.name} are "
                                 f"not supported, as in EmbeddingBagCollection)")
        self._build_core(configs, device, table_options=table_options, optimizer=optimizer,
                         validate_inputs=validate_inputs, backend=backend,
                         group_tables=group_tables)
        self._is_weighted = bool(is_weighted)
        # output keys in config order (table by table; feature@table where several tables
        # read a feature), each output's dim and first column
        self._embedding_names = [n for names in output_names_by_table(configs) for n in names]
        self._features = list(dict.fromkeys(f for c in configs for f in c.feature_names))
        self._dims = [c.embedding_dim for c in configs for _ in c.feature_names]
        self._mode_of_table = {c.name: _MODES[c.pooling] for c in configs}
        self._output_name = output_name_of(configs)  # (table, feature) -> output
        self._column = {}
        for feature, dim in zip(self._embedding_names, self._dims):
            self._column[feature] = sum(self._dims[:len(self._column)])

    # -- TorchRec's EmbeddingBagCollectionInterface ------------------------------------------
    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._core.configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def embedding_bags(self) -> TableViews:
        """Each table's device, dtype and size where TorchRec's module has its
        ``nn.EmbeddingBag``: ``embedding_bags[name].weight.device`` and so on; no values
        (:mod:`dynemb.modules.table_views`)."""
        return table_views(self._core.configs, self._core.table_options, self._core.device)

    # -- forward -----------------------------------------------------------------------------
    @torch.compiler.disable
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of ``features`` (a KJT; TorchRec's argument name): a
        ``KeyedTensor`` [B, sum of dims] keyed by feature.

        Lookups, pins, prefetch and eval behave as in
        :meth:`DynamicEmbCollection.forward
        <dynemb.modules.collection.DynamicEmbCollection.forward>`.
        """
        kjt = features
        if is_traced(kjt):  # symbolic tracing: one call_module node (dynemb.modules.tracing)
            return call_as_leaf(self, kjt)
        if self._core.is_meta:
            return self._meta_outputs(kjt)
        self._check_input(kjt)
        trains = trains_now(self)
        with self._core.lookup(kjt, trains) as state:
            tables = [(name, state.batches[name], self._table_bags(name, state, kjt))
                      for name in self._core.tables]
            values = self._pool(tables, kjt.stride(), trains)
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._dims,
                           values=values)

    def _check_input(self, kjt: KeyedJaggedTensor) -> None:
        # runs before any table changes (prefetch and forward both come here)
        if isinstance(kjt, KeyedJaggedTensor):  # anything else: the shared check names it
            check_bag_kjt(kjt, self._features, self._is_weighted)

    def _meta_outputs(self, kjt: KeyedJaggedTensor) -> KeyedTensor:
        """``forward`` on the meta device: a meta [B, sum of dims] ``KeyedTensor``, as
        TorchRec's ``EmbeddingBagCollection`` gives there; no table is read."""
        check_kjt(kjt, kjt.values().device, check_lengths=False)
        check_bag_kjt(kjt, self._features, self._is_weighted)
        values = torch.empty(kjt.stride(), sum(self._dims), device="meta")
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._dims,
                           values=values)

    # -- pooling -----------------------------------------------------------------------------
    def _table_bags(self, name: str, state: PrefetchState, kjt: KeyedJaggedTensor) -> Bags:
        """One table's bags: their offsets, lengths and weights over its ids (feature by
        feature)."""
        device = self._core.device
        segments = state.features[name]
        lengths = torch.cat([state.lengths[f] for f, _ in segments]).to(
            device=device, dtype=torch.int64)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=device)
        torch.cumsum(lengths, 0, out=offsets[1:])
        weights = None
        if self._is_weighted:
            jts = kjt.to_dict()
            weights = torch.cat([jts[f].weights() for f, _ in segments]).to(
                device=device, dtype=torch.float32)
        first = self._output_name[(name, segments[0][0])]
        return Bags(offsets, lengths, weights, self._mode_of_table[name], self._column[first],
                    len(segments))

    def _pool(self, tables: List[TableBags], size: int, trains: bool) -> torch.Tensor:
        """Every table's bags pooled into one [B, sum of dims] output, each feature in its
        columns. In training its backward hands each bag's gradient (divided by its length
        for MEAN) to the fused optimizer kernel, which clips it, scales it by each id's
        weight and sums it per row: no per-table output, concatenation or [U, D] gradient."""
        columns = sum(self._dims)
        if trains:
            anchor = torch.empty(0, device=self._core.device, requires_grad=True)
            return PooledLookup.apply(anchor, self._core, tables, size, columns)
        return pool_all(self._core, tables, size, columns)


def check_bag_kjt(kjt: KeyedJaggedTensor, features: List[str], is_weighted: bool) -> None:
    """Raise unless ``kjt`` has every one of ``features`` (a
    :class:`~dynemb.foundations.validation.MissingFeatureError`), and per-id weights when
    ``is_weighted``
    (a ``ValueError``; an unweighted collection ignores them, as TorchRec's does)."""
    check_features_present(kjt.keys(), features)
    has_weights = kjt.weights_or_none() is not None
    if is_weighted and not has_weights:
        raise ValueError("this collection is weighted (is_weighted=True) but the KJT has no "
                         "weights; give one weight per id")
