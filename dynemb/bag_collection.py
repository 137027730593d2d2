"""``DynamicEmbBagCollection``: a drop-in ``EmbeddingBagCollection`` backed by dynamic tables.

It is a :class:`~dynemb.collection.DynamicEmbCollection` (same tables, prefetch queue, pins,
admission, scores, fused optimizers, checkpoints and memory stashing) that pools each
feature's rows per sample instead of returning them one by one.

Shapes: B samples, F features, U unique ids of a table in the batch, N ids of a table (all its
features), D a table's embedding dim.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Union

import torch
import torch.nn.functional as F
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from dynemb.collection import DynamicEmbCollection
from dynemb.collection_config import check_configs
from dynemb.optimizers import OccurrenceGrads, OptimizerConfig, occurrence_csr
from dynemb.options import DynamicEmbTableOptions
from dynemb.prefetch import PrefetchState
from dynemb.tables import DynamicTable, TableBatch
from dynemb.validation import check_kjt

_MODES = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}


class DynamicEmbBagCollection(DynamicEmbCollection, EmbeddingBagCollectionInterface):
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
        device, table_options, optimizer, validate_inputs, backend: as for
            :class:`~dynemb.collection.DynamicEmbCollection`.

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

    _config_type = EmbeddingBagConfig
    # the pooled output is [B, sum of dims]: one batch size for every feature
    _variable_batch = False

    def __init__(self, tables: List[EmbeddingBagConfig], is_weighted: bool = False,
                 device: Optional[torch.device] = None, *,
                 table_options: Union[DynamicEmbTableOptions,
                                      Mapping[str, DynamicEmbTableOptions], None] = None,
                 optimizer: Optional[OptimizerConfig] = None, validate_inputs: bool = True,
                 backend: Optional[str] = None):
        for config in check_configs(tables, EmbeddingBagConfig):
            if config.pooling not in _MODES:
                raise ValueError(f"table {config.name!r}: pooling must be PoolingType.SUM or "
                                 f"PoolingType.MEAN, got {config.pooling}")
            if is_weighted and config.pooling != PoolingType.SUM:
                raise ValueError(f"table {config.name!r}: a weighted collection pools by "
                                 f"SUM only (per-id weights with {config.pooling.name} are "
                                 f"not supported, as in EmbeddingBagCollection)")
        super().__init__(tables, device, table_options=table_options, optimizer=optimizer,
                         need_indices=False, validate_inputs=validate_inputs, backend=backend)
        self._is_weighted = bool(is_weighted)
        self._embedding_names = list(self._output_names)  # output keys, config order
        self._features = list(dict.fromkeys(f for c in self._configs for f in c.feature_names))
        self._dims = [c.embedding_dim for c in self._configs for _ in c.feature_names]
        self._mode_of_table = {c.name: _MODES[c.pooling] for c in self._configs}
        self._column = {}  # each output's first column
        for feature, dim in zip(self._embedding_names, self._dims):
            self._column[feature] = sum(self._dims[:len(self._column)])

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    def forward(self, kjt: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of ``kjt``: a ``KeyedTensor`` [B, sum of dims] keyed by feature.

        Lookups, pins, prefetch and eval behave as in
        :meth:`DynamicEmbCollection.forward <dynemb.collection.DynamicEmbCollection.forward>`.
        """
        return super().forward(kjt)

    # -- input checks (run before any table changes: prefetch and forward both come here) --
    def _split_by_table(self, kjt: KeyedJaggedTensor):
        if isinstance(kjt, KeyedJaggedTensor):  # anything else: the shared check names it
            check_bag_kjt(kjt, self._features, self._is_weighted)
        return super()._split_by_table(kjt)

    def _meta_outputs(self, kjt: KeyedJaggedTensor) -> KeyedTensor:
        """``forward`` on the meta device: a meta [B, sum of dims] ``KeyedTensor``, as
        TorchRec's ``EmbeddingBagCollection`` gives there; no table is read."""
        check_kjt(kjt, kjt.values().device, check_lengths=False)
        check_bag_kjt(kjt, self._features, self._is_weighted)
        values = torch.empty(kjt.stride(), sum(self._dims), device="meta")
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._dims,
                           values=values)

    # -- pooling -----------------------------------------------------------------------------
    def _table_outputs(self, name: str, state: PrefetchState, kjt: KeyedJaggedTensor,
                       trains: bool) -> Dict[str, Any]:
        """One table's bags: their offsets, lengths and weights over its ids (feature by
        feature); :meth:`_collect_outputs` pools every table into one output."""
        segments = state.features[name]
        lengths = torch.cat([state.lengths[f] for f, _ in segments]).to(
            device=self._device, dtype=torch.int64)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=self._device)
        torch.cumsum(lengths, 0, out=offsets[1:])
        weights = None
        if self._is_weighted:
            jts = kjt.to_dict()
            weights = torch.cat([jts[f].weights() for f, _ in segments]).to(
                device=self._device, dtype=torch.float32)
        first = self._output_name[(name, segments[0][0])]
        return {name: _Bags(offsets, lengths, weights, self._mode_of_table[name],
                            self._column[first], len(segments))}

    def _collect_outputs(self, out: Dict[str, Any], state: PrefetchState,
                         kjt: KeyedJaggedTensor, trains: bool) -> KeyedTensor:
        """Every table's bags pooled into one [B, sum of dims] output, each feature in its
        columns. In training its backward hands each bag's gradient (divided by its length
        for MEAN) to the fused optimizer kernel, which clips it, scales it by each id's
        weight and sums it per row: no per-table output, concatenation or [U, D] gradient."""
        tables = [(name, state.batches[name], out[name]) for name in self.tables]
        if trains:
            anchor = torch.empty(0, device=self._device, requires_grad=True)
            values = _PooledLookup.apply(anchor, self, tables, kjt.stride())
        else:
            values = _pool_all(self, tables, kjt.stride())
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._dims,
                           values=values)



def check_bag_kjt(kjt: KeyedJaggedTensor, features: List[str], is_weighted: bool) -> None:
    """Raise ``ValueError`` unless ``kjt`` has every one of ``features``, and per-id weights
    when ``is_weighted`` (an unweighted collection ignores them, as TorchRec's does)."""
    keys = set(kjt.keys())
    missing = [f for f in features if f not in keys]
    if missing:
        raise ValueError(f"features {missing} of this collection are not in the KJT (its "
                         f"features: {list(kjt.keys())}); every feature must be given, with "
                         f"zero-length bags where it has no ids")
    has_weights = kjt.weights_or_none() is not None
    if is_weighted and not has_weights:
        raise ValueError("this collection is weighted (is_weighted=True) but the KJT has no "
                         "weights; give one weight per id")


@dataclass
class _Bags:
    """One table's bags in a batch: ``offsets`` [F * B + 1] and ``lengths`` [F * B] over its
    ids (feature by feature), per-id ``weights`` [N] or None, ``mode`` "sum" or "mean", and
    the first output column of its ``num_features`` features (their columns are adjacent)."""

    offsets: torch.Tensor
    lengths: torch.Tensor
    weights: Optional[torch.Tensor]
    mode: str
    column: int
    num_features: int

    def pool_into(self, out: torch.Tensor, table: DynamicTable, batch: TableBatch) -> None:
        """Write the bags into their columns of ``out`` [B, C]: straight from the table's
        rows by a kernel when they can be read in place, else by ``embedding_bag`` over the
        looked-up unique rows."""
        size, dim = out.shape[0], table.dim
        in_place = table.rows_in_place(batch)
        if in_place is not None:
            weights, occ_slots = in_place
            cols = self.column + dim * torch.arange(self.num_features, device=out.device)
            scale = (self.weights if self.weights is not None else
                     torch.empty(0, dtype=torch.float32, device=out.device))
            table.kernels.pool_bags(weights, occ_slots, self.offsets, scale,
                                    self.mode == "mean", size, cols, dim, out)
            return
        pooled = F.embedding_bag(batch.inverse, table.lookup(batch), self.offsets,
                                 mode=self.mode, per_sample_weights=self.weights,
                                 include_last_offset=True)  # [F * B, D]
        out[:, self.column:self.column + self.num_features * dim] = (
            pooled.view(self.num_features, size, dim).transpose(0, 1).reshape(size, -1))

    def occurrence_grads(self, grad_out: torch.Tensor, inverse: torch.Tensor, num_rows: int,
                         dim: int, clip: Optional[float], strided: bool) -> OccurrenceGrads:
        """Each id's gradient as the kernel sums it, from the output's gradient [B, C]: its
        bag's gradient (divided by the bag length for MEAN: the gradient of the sum, where
        fbgemm clips), times the id's weight. ``strided``: the kernel may read the bags'
        gradients in place from ``grad_out``'s columns. No host sync."""
        size = grad_out.shape[0]
        cols = grad_out[:, self.column:self.column + self.num_features * dim]
        if self.num_features == 1:
            grad_bags = cols if strided else cols.contiguous()
        else:  # bag i * B + b is feature i of sample b
            grad_bags = cols.reshape(size, self.num_features, dim).transpose(0, 1).reshape(
                -1, dim)
        scale = self.weights
        if self.mode == "mean":
            per_bag = self.lengths.clamp(min=1).to(torch.float32)
            if clip is not None:  # clipped after the division: divide the bags' gradients
                grad_bags = grad_bags / per_bag.unsqueeze(1)
            else:  # no clipping: the division rides on each id's scale
                bag_scale = (1.0 / per_bag).repeat_interleave(self.lengths,
                                                              output_size=inverse.numel())
                scale = bag_scale if scale is None else scale * bag_scale
        bag_of_id = torch.repeat_interleave(
            torch.arange(self.lengths.numel(), device=inverse.device), self.lengths,
            output_size=inverse.numel())
        offsets, order = occurrence_csr(inverse, num_rows)
        return OccurrenceGrads(grad_bags.to(torch.float32), offsets,
                               bag_of_id[order].contiguous(),
                               None if scale is None else scale[order].contiguous(), clip)


def _pool_all(module: DynamicEmbBagCollection, tables, size: int) -> torch.Tensor:
    out = torch.empty(size, sum(module._dims), device=module._device)
    for name, batch, bags in tables:
        bags.pool_into(out, module.tables[name], batch)
    return out


class _PooledLookup(torch.autograd.Function):
    """Every table's bags [B, sum of dims]; backward applies each table's fused optimizer
    straight from the output's gradient (no per-table gradient or [U, D] tensor)."""

    @staticmethod
    def forward(ctx, anchor, module: DynamicEmbBagCollection, tables, size: int):
        ctx.module, ctx.tables = module, tables
        ctx.generation = module._generation
        return _pool_all(module, tables, size)

    @staticmethod
    def backward(ctx, grad_out):
        module = ctx.module
        if module._stash is not None:  # stashed rows come back now at the latest
            module._stash.restore()
        clip = module._optimizer_config.max_gradient
        for name, batch, bags in ctx.tables:
            table = module.tables[name]
            grads = bags.occurrence_grads(grad_out, batch.inverse, batch.keys.numel(),
                                          table.dim, clip, table.kernels.name == "cpu")
            module._apply_gradients(name, batch, grads, ctx.generation)
        return None, None, None, None
