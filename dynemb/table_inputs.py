"""From one input ``KeyedJaggedTensor`` to each table's ids: what a collection's prefetch
looks up (shared by the sequence and pooled collections)."""
from __future__ import annotations

from typing import Any, Dict, List

import torch
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb.validation import check_keys, check_kjt


def split_by_table(kjt: KeyedJaggedTensor, configs: List[BaseEmbeddingConfig],
                   device: torch.device, *, validate: bool, weights_are_counts: bool = False,
                   variable_batch: bool = False) -> Dict[str, Any]:
    """Validate ``kjt``, then concatenate each table's feature values as int64 ids.

    Returns, by table name, ``(ids, [(feature, number of ids), ...], occurrences)``, the
    features in the order their ids were concatenated; ``occurrences`` is the KJT's weights
    as int64 when ``weights_are_counts`` (how many times each id occurred), else None. Under
    ``"__lengths__"``: the KJT's lengths by feature (views). A feature read by several
    tables is in each of them; features no table reads are ignored, as TorchRec's modules do
    (one KJT often feeds several modules). ``variable_batch``: accept a KJT with a batch size per
    feature. Nothing changes anywhere: every check runs here, before any table is touched.

    Example::

        >>> config = EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=64,
        ...                          feature_names=["a", "b"])
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b", "c"],
        ...                                           torch.tensor([5, 6, 7, 8]),
        ...                                           torch.tensor([1, 2, 1]))
        >>> ids, segments, _ = split_by_table(kjt, [config], torch.device("cpu"),
        ...                                   validate=True)["t"]
        >>> ids.tolist(), segments
        ([5, 6, 7], [('a', 1), ('b', 2)])
    """
    check_kjt(kjt, device, check_lengths=validate, variable_batch=variable_batch)
    values = kjt.values()
    counted = weights_are_counts and kjt.weights_or_none() is not None
    features = list(kjt.keys())
    # one split of the ids (and lengths, weights) into per-feature views, not a
    # JaggedTensor per feature: with hundreds of features this is most of the cost
    sizes = kjt.length_per_key()
    ids = values.to(torch.int64)
    ids_of = dict(zip(features, ids.split(sizes)))
    strides = kjt.stride_per_key()
    lengths_of = dict(zip(features, kjt.lengths().split(strides)))
    weights_of = dict(zip(features, kjt.weights().split(sizes))) if counted else {}
    if validate and values.numel():  # one pass over every id; a bad one is named by table
        try:
            check_keys(ids.to(device), device)
        except ValueError:  # ids of features no table reads are ignored
            _name_table_of_bad_ids(ids_of, configs, device)
    out: Dict[str, Any] = {"__lengths__": lengths_of}
    empty = torch.empty(0, dtype=torch.int64, device=values.device)
    for config in configs:
        present = [f for f in config.feature_names if f in ids_of]
        parts = [ids_of[f] for f in present]
        keys = (parts[0] if len(parts) == 1 else torch.cat(parts) if parts else empty)
        if keys.device != device:  # check_kjt put the ids there: no call per table
            keys = keys.to(device)
        occurrences = None
        if counted:
            occurrences = (torch.cat([weights_of[f] for f in present]) if present else
                           torch.empty(0, device=values.device))
            occurrences = occurrences.to(device=device, dtype=torch.int64)
        out[config.name] = (keys, [(f, part.numel()) for f, part in zip(present, parts)],
                            occurrences)
    return out


def _name_table_of_bad_ids(ids_of: Dict[str, torch.Tensor], configs, device) -> None:
    """Raise the error of the first table whose ids hold a reserved key."""
    for config in configs:
        parts = [ids_of[f] for f in config.feature_names if f in ids_of]
        if parts:
            check_keys(torch.cat(parts).to(device), device, name=f"ids of table {config.name!r}")
