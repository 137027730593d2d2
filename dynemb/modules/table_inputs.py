"""From one input ``KeyedJaggedTensor`` to each table's ids: what a collection's prefetch
looks up (shared by the sequence and pooled collections)."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple, Union

import torch
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb.foundations.validation import check_features_present, check_keys, check_kjt

#: per table: (table name, [(feature, its position in the KJT's keys), ...])
Plan = List[Tuple[str, List[Tuple[str, int]]]]


class TableInputs:
    """Which of a KJT's features each table reads, worked out once per order of the KJT's
    keys (a model sends the same keys step after step) rather than per table per step.

    Example::

        >>> config = EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=64,
        ...                          feature_names=["b", "a"])
        >>> TableInputs([config]).plan(("a", "b", "c"))
        [('t', [('b', 1), ('a', 0)])]
    """

    #: key orders remembered; past that the cache starts over
    MAX_PLANS = 64

    def __init__(self, configs: Sequence[BaseEmbeddingConfig]):
        self.configs = list(configs)
        self._tables = [(c.name, tuple(c.feature_names)) for c in self.configs]
        self._features = list(dict.fromkeys(f for _, names in self._tables for f in names))
        self._plans: Dict[Tuple[str, ...], Plan] = {}

    def plan(self, features: Tuple[str, ...]) -> Plan:
        """Each table's features with their positions in ``features`` (the KJT's keys, in
        order), in the table's feature order. A feature a table reads that ``features``
        lacks raises :class:`~dynemb.foundations.validation.MissingFeatureError` (a ``KeyError``, as
        TorchRec's collections raise)."""
        plan = self._plans.get(features)
        if plan is None:
            position = {f: i for i, f in enumerate(features)}
            check_features_present(features, self._features)
            plan = [(name, [(f, position[f]) for f in names]) for name, names in self._tables]
            if len(self._plans) >= self.MAX_PLANS:
                self._plans.clear()
            self._plans[features] = plan
        return plan


def split_by_table(kjt: KeyedJaggedTensor,
                   tables: Union[TableInputs, Sequence[BaseEmbeddingConfig]],
                   device: torch.device, *, validate: bool, weights_are_counts: bool = False,
                   variable_batch: bool = False) -> Dict[str, Any]:
    """Validate ``kjt``, then concatenate each table's feature values as int64 ids.

    ``tables``: the tables' configs, or their :class:`TableInputs` (which keeps the work of
    matching features to tables from one call to the next). Returns, by table name,
    ``(ids, [(feature, number of ids), ...], occurrences)``, the features in the order
    their ids were concatenated; ``occurrences`` is the KJT's weights as int64 when
    ``weights_are_counts`` (how many times each id occurred), else None. Under
    ``"__lengths__"``: the KJT's lengths by feature (views). A feature read by several
    tables is in each of them; features no table reads are ignored, as TorchRec's modules do
    (one KJT often feeds several modules); a feature a table reads must be there. ``variable_batch``: accept a KJT with a batch size per
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
    if not isinstance(tables, TableInputs):
        tables = TableInputs(tables)
    check_kjt(kjt, device, check_lengths=validate, variable_batch=variable_batch)
    values = kjt.values()
    counted = weights_are_counts and kjt.weights_or_none() is not None
    features = tuple(kjt.keys())
    # one split of the ids (and lengths, weights) into per-feature views, not a
    # JaggedTensor per feature: with hundreds of features this is most of the cost
    sizes = kjt.length_per_key()
    ids = values.to(torch.int64)
    if ids.device != device:  # check_kjt found them on it: "cuda" against "cuda:0"
        ids = ids.to(device)
    id_parts = ids.split(sizes)
    out: Dict[str, Any] = {"__lengths__": dict(zip(features, kjt.lengths().split(
        kjt.stride_per_key())))}
    weight_parts = kjt.weights().split(sizes) if counted else ()
    if validate and values.numel():  # one pass over every id; a bad one is named by table
        try:
            check_keys(ids, device)
        except ValueError:  # ids of features no table reads are ignored
            _name_table_of_bad_ids(dict(zip(features, id_parts)), tables.configs, device)
    for name, present in tables.plan(features):
        if len(present) == 1:  # the common case: a table of one feature, a view
            feature, i = present[0]
            keys, segments = id_parts[i], [(feature, sizes[i])]
        else:
            keys = torch.cat([id_parts[i] for _, i in present])
            segments = [(feature, sizes[i]) for feature, i in present]
        occurrences = None
        if counted:
            occurrences = torch.cat([weight_parts[i] for _, i in present]).to(
                device=device, dtype=torch.int64)
        out[name] = (keys, segments, occurrences)
    return out


def _name_table_of_bad_ids(ids_of: Dict[str, torch.Tensor], configs, device) -> None:
    """Raise the error of the first table whose ids hold a reserved key."""
    for config in configs:
        parts = [ids_of[f] for f in config.feature_names if f in ids_of]
        if parts:
            check_keys(torch.cat(parts).to(device), device, name=f"ids of table {config.name!r}")
