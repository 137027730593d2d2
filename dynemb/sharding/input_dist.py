"""Input distribution of a row-wise sharded dynamic table group: dedup, route, all-to-all."""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_sharding import BaseSparseFeaturesDist
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb.options import ShardingScheme
from dynemb.sharding.routing import RoutedIds, route_unique
from dynemb.sharding.step_check import StepCheckedKJTAllToAll


class DedupRwSparseFeaturesDist(BaseSparseFeaturesDist[KeyedJaggedTensor]):
    """Sends each distinct id of each table once to the rank that owns it.

    The KJT handed to TorchRec's :class:`KJTAllToAll` has one key per table and rank and a
    batch of one per rank (``values`` = that table's distinct ids for that rank, ``weights`` =
    how many times each occurred), so ranks with different batch sizes exchange the same
    shape of KJT. After ``forward``,
    :attr:`routing` holds what the output side needs to expand the answers back to one per
    occurrence (read it before the next call, as TorchRec does with its bucketize permute).

    Args:
        pg: the process group of the all-to-all.
        tables: ``(table name, feature names, sharding scheme)`` of each table in the group.
        where: what to call the module in errors (see :mod:`dynemb.sharding.step_check`).
        output_names: ``(table, feature) -> output name`` where they differ (a feature read
            by several tables: ``feature@table``); the routing's segments carry these names.
    """

    def __init__(self, pg: dist.ProcessGroup,
                 tables: Sequence[Tuple[str, Sequence[str], ShardingScheme]],
                 where: str = "a sharded dynamic module",
                 output_names: Optional[Mapping[Tuple[str, str], str]] = None) -> None:
        super().__init__()
        self._output_names = dict(output_names or {})
        self._world_size = pg.size()
        self._tables = [(name, list(features), scheme) for name, features, scheme in tables]
        self._table_names = [name for name, _, _ in self._tables]
        self._dist = StepCheckedKJTAllToAll(pg, [len(self._tables)] * self._world_size, where)
        self.routing: Optional[RoutedIds] = None

    def forward(self, sparse_features: KeyedJaggedTensor, batch: int = 0
                ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """Route ``sparse_features`` (features of other tables are ignored) and start the
        all-to-all of the module's ``batch``-th input dist; the result is an awaitable of
        the splits, then of the KJT received."""
        self.routing = self.route(sparse_features.to_dict())
        bucketized = KeyedJaggedTensor(
            keys=self._table_names * self._world_size,
            values=self.routing.values,
            lengths=self.routing.lengths,
            weights=self.routing.counts.to(torch.float32),
            stride=1,
        )
        self._dist.batch = batch
        return self._dist(bucketized)

    def route(self, jts: Dict[str, "torch.Tensor"]) -> RoutedIds:
        ids_per_table, schemes, segments = [], [], []
        device = next(iter(jts.values())).values().device if jts else torch.device("cpu")
        for table, features, scheme in self._tables:
            parts = []
            for feature in features:
                if feature in jts:
                    ids = jts[feature].values().to(torch.int64)
                    parts.append(ids)
                    name = self._output_names.get((table, feature), feature)
                    segments.append((name, ids.numel()))
            ids_per_table.append(torch.cat(parts) if parts else
                                 torch.empty(0, dtype=torch.int64, device=device))
            schemes.append(scheme)
        return route_unique(ids_per_table, schemes, self._world_size, segments)
