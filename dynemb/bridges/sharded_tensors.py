"""The rows of a TorchRec table's weight held on this rank, whatever the tensor:
TorchRec's sharded modules hand out torch's ``ShardedTensor`` (``torch.distributed._shard``,
which torch keeps private) in their ``state_dict`` and their fused optimizer's state."""
from __future__ import annotations

import warnings
from typing import List, Tuple

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor


def row_pieces(tensor, name: str) -> Tuple[int, List[Tuple[int, torch.Tensor]]]:
    """``(global rows, [(first row, rows), ...])`` of ``tensor`` on this rank: a plain tensor
    is one piece at row 0; a ``ShardedTensor`` its local shards, each whole rows (row-wise
    or table-wise sharding). A shard that holds part of the columns (column-wise sharding)
    or another kind of tensor raises ``ValueError`` naming ``name``.

    Example::

        >>> rows, pieces = row_pieces(torch.ones(5, 2), "t")
        >>> rows, [(first, piece.shape) for first, piece in pieces]
        (5, [(0, torch.Size([5, 2]))])
    """
    if isinstance(tensor, ShardedTensor):
        with warnings.catch_warnings():  # torch deprecates it to TorchRec, who hands it out
            warnings.simplefilter("ignore", FutureWarning)
            size, shards = tensor.size(), tensor.local_shards()
        pieces = []
        for shard in shards:
            offsets = shard.metadata.shard_offsets
            if any(offsets[1:]) or list(shard.metadata.shard_sizes[1:]) != list(size[1:]):
                raise ValueError(f"{name}: a shard holds columns {offsets[1:]} of a "
                                 f"{list(size)} tensor (column-wise sharding); only whole rows "
                                 f"import: gather the table first")
            pieces.append((int(offsets[0]), shard.tensor))
        return int(size[0]), pieces
    if type(tensor) is torch.Tensor or isinstance(tensor, torch.nn.Parameter):
        return int(tensor.shape[0]), [(0, tensor)]
    raise ValueError(f"{name}: a {type(tensor).__name__} (only plain tensors and TorchRec's "
                     f"ShardedTensor import)")
