"""Input distribution of row-wise sharded pooled tables: every id goes to the rank that owns
it, keeping its bag.

Unlike the sequence path (:mod:`dynemb.sharding.input_dist`), ids are not deduplicated before
they travel: the owner pools each (sample, feature) bag from the ids it received, so it needs
them per bag, and what comes back is one partial sum per (sample, feature, owner).
"""
from __future__ import annotations

from typing import Dict, Sequence

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_sharding import BaseSparseFeaturesDist
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb.options import ShardingScheme
from dynemb.sharding.routing import owner_ranks
from dynemb.sharding.step_check import StepCheckedKJTAllToAll


def bucketize_by_owner(kjt: KeyedJaggedTensor, schemes: Sequence[ShardingScheme],
                       world_size: int) -> KeyedJaggedTensor:
    """``kjt`` (F features, batch B) as one KJT of ``world_size * F`` keys (rank by rank, the
    features in order), batch B: key ``r * F + f`` holds, per sample, the ids of feature
    ``f`` that rank ``r`` owns, in their original order (and their weights). ``schemes[f]``
    is feature ``f``'s :class:`ShardingScheme`. Ids and lengths come out int64 and weights
    float32 whatever they were, so every rank sends the same dtypes.

    One pass of fbgemm's ``block_bucketize_sparse_features`` over the owner ranks (bucket
    size 1) orders the ids; its ``unbucketize_permute`` moves the ids themselves.

    Example::

        >>> kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([4, 3, 6]),
        ...                                           torch.tensor([2, 1]))
        >>> out = bucketize_by_owner(kjt, [ShardingScheme.MOD], 2)
        >>> out.keys(), out.values().tolist(), out.lengths().tolist()
        (['f', 'f'], [4, 6, 3], [1, 1, 1, 0])
        >>> bucketize_by_owner(KeyedJaggedTensor.from_lengths_sync(
        ...     ["f"], torch.tensor([4, 3], dtype=torch.int32),
        ...     torch.tensor([1, 1], dtype=torch.int32)), [ShardingScheme.MOD], 2).values().dtype
        torch.int64
    """
    keys = list(kjt.keys())
    # every rank must put the same dtypes on the wire: the receiver sizes its buffers by
    # its own tensors, so an int32 rank and an int64 rank would mix up their bytes
    values = kjt.values().to(torch.int64)
    lengths = kjt.lengths().to(torch.int64)
    weights = kjt.weights_or_none()
    if weights is not None:
        weights = weights.to(torch.float32)
    if len(set(schemes)) <= 1:
        owners = owner_ranks(values, world_size, schemes[0] if schemes else ShardingScheme.HASH)
    else:
        owners = torch.cat([owner_ranks(part, world_size, scheme) for part, scheme
                            in zip(values.split(kjt.length_per_key()), schemes)])
    new_lengths, _, new_weights, _, permute = torch.ops.fbgemm.block_bucketize_sparse_features(
        lengths, owners, False, True,
        torch.ones(len(keys), dtype=torch.int64, device=values.device), world_size,
        weights, None, -1, None, True)
    new_values = torch.empty_like(values)
    new_values[permute] = values
    return KeyedJaggedTensor(keys=keys * world_size, values=new_values, lengths=new_lengths,
                             weights=new_weights, stride=kjt.stride())


class RwBagSparseFeaturesDist(BaseSparseFeaturesDist[KeyedJaggedTensor]):
    """Sends each id of the module's features (with its weight) to its owner rank, with the
    bag it belongs to; the owner receives a KJT of the same features whose batch is every
    rank's samples, rank after rank (TorchRec's ``KJTAllToAll`` carries each rank's batch
    size, so ranks may hold different batch sizes).

    Args:
        pg: the process group of the all-to-all.
        features: the module's feature names, in the order of its output.
        schemes: each feature's :class:`ShardingScheme` (its table's).
        where: what to call the module in errors (see :mod:`dynemb.sharding.step_check`).
    """

    def __init__(self, pg: dist.ProcessGroup, features: Sequence[str],
                 schemes: Dict[str, ShardingScheme],
                 where: str = "a sharded dynamic module") -> None:
        super().__init__()
        self._world_size = pg.size()
        self._features = list(features)
        self._schemes = [schemes[f] for f in self._features]
        self._dist = StepCheckedKJTAllToAll(pg, [len(self._features)] * self._world_size,
                                            where)

    def forward(self, sparse_features: KeyedJaggedTensor, batch: int = 0
                ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """Bucketize ``sparse_features`` (its features in this module's order, as
        :meth:`select` returns them) and start the all-to-all of the module's ``batch``-th
        input dist."""
        self._dist.batch = batch
        return self._dist(bucketize_by_owner(sparse_features, self._schemes, self._world_size))
