"""Cutting a table's rows back into one ``JaggedTensor`` per feature (shared by the
collection and its sharded form)."""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from dynemb.foundations.validation import check_features_present


def cut_by_feature(rows: torch.Tensor, segments: Sequence[Tuple[str, int]],
                   lengths: Mapping[str, torch.Tensor],
                   ids: Optional[Mapping[str, torch.Tensor]] = None,
                   feature_of: Optional[Mapping[str, str]] = None) -> Dict[str, JaggedTensor]:
    """``rows`` [N, dim] hold the outputs of ``segments`` (name, number of ids) one after the
    other; each becomes a JaggedTensor under its name, with its feature's ``lengths`` (and
    its feature's ``ids`` as weights, for ``need_indices``). ``feature_of`` maps an output
    name to the input feature it was read from where they differ (``feature@table``: a
    feature read by several tables).

    Example::

        >>> out = cut_by_feature(torch.ones(3, 2), [("a", 1), ("b@t", 2)],
        ...                      {"a": torch.tensor([1, 0]), "b": torch.tensor([1, 1])},
        ...                      feature_of={"b@t": "b"})
        >>> out["b@t"].values().shape
        torch.Size([2, 2])
    """
    counts = [count for _, count in segments]
    # One split, not a slice per feature: the backward of a slice zero-fills a gradient as
    # large as all the rows, once per feature; a split's backward concatenates once, and a
    # single feature needs no cut at all.
    parts = [rows] if counts == [rows.shape[0]] else rows.split(counts)
    out: Dict[str, JaggedTensor] = {}
    for (name, _), values in zip(segments, parts):
        feature = name if feature_of is None else feature_of.get(name, name)
        out[name] = JaggedTensor(values=values, lengths=lengths[feature],
                                 weights=None if ids is None else ids[feature])
    return out


def meta_outputs(kjt: KeyedJaggedTensor, configs: Sequence[BaseEmbeddingConfig],
                 output_name: Mapping[Tuple[str, str], str],
                 need_indices: bool = False) -> Dict[str, JaggedTensor]:
    """What a sequence collection on the meta device returns for ``kjt``, as TorchRec's
    ``EmbeddingCollection`` does there: per output (``output_name[(table, feature)]``, config
    order) a JaggedTensor of empty meta rows [ids, dim] with the feature's lengths (and ids
    as weights with ``need_indices``). For tracing and shape inference; nothing is read.

    Example::

        >>> config = EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=8,
        ...                          feature_names=["f"])
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([1, 2]),
        ...                                           torch.tensor([2]))
        >>> meta_outputs(kjt, [config], {("t", "f"): "f"})["f"].values()
        tensor(..., device='meta', size=(2, 4))
    """
    check_features_present(kjt.keys(), [f for c in configs for f in c.feature_names])
    jts = kjt.to_dict()
    out: Dict[str, JaggedTensor] = {}
    for config in configs:
        for feature in config.feature_names:
            jt = jts[feature]
            rows = torch.empty(jt.values().numel(), config.embedding_dim, device="meta")
            out[output_name[(config.name, feature)]] = JaggedTensor(
                values=rows, lengths=jt.lengths(),
                weights=jt.values() if need_indices else None)
    return out
