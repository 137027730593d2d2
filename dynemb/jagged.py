"""Cutting a table's rows back into one ``JaggedTensor`` per feature (shared by the
collection and its sharded form)."""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch
from torchrec.sparse.jagged_tensor import JaggedTensor


def cut_by_feature(rows: torch.Tensor, segments: Sequence[Tuple[str, int]],
                   lengths: Mapping[str, torch.Tensor],
                   ids: Optional[Mapping[str, torch.Tensor]] = None) -> Dict[str, JaggedTensor]:
    """``rows`` [N, dim] hold the features of ``segments`` (name, number of ids) one after the
    other; each becomes a JaggedTensor with its ``lengths`` (and its ``ids`` as weights, for
    ``need_indices``).

    Example::

        >>> out = cut_by_feature(torch.ones(3, 2), [("a", 1), ("b", 2)],
        ...                      {"a": torch.tensor([1, 0]), "b": torch.tensor([1, 1])})
        >>> out["b"].values().shape
        torch.Size([2, 2])
    """
    counts = [count for _, count in segments]
    # One split, not a slice per feature: the backward of a slice zero-fills a gradient as
    # large as all the rows, once per feature; a split's backward concatenates once, and a
    # single feature needs no cut at all.
    parts = [rows] if counts == [rows.shape[0]] else rows.split(counts)
    out: Dict[str, JaggedTensor] = {}
    for (feature, _), values in zip(segments, parts):
        out[feature] = JaggedTensor(values=values, lengths=lengths[feature],
                                    weights=None if ids is None else ids[feature])
    return out
