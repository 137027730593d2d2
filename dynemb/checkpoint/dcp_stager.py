"""``DynamicEmbAsyncStager``: the stager for ``torch.distributed.checkpoint.async_save`` of a
model holding dynamic tables.

``async_save`` first *stages* the state dict (copies it to host memory, so that training may
change the model while the copy is written) with an ``AsyncStager``. A dynamic table's
entries are already host copies, made when ``state_dict()`` was called, and must stay
:class:`~dynemb.checkpoint.dcp_bytes.SavedAsBytes` to be saved as byte items. torch's
stagers do not keep them so: ``BlockingAsyncStager`` copies them into plain tensors (saved
as tensors sized by the saved entries, which a fresh module's load then refuses, ``Size
mismatch``), and torch's default stager of this version stops on TorchRec's own
``ShardedTensor`` (``torch function 'data_ptr' ... not supported for ShardedTensor``),
with or without dynamic tables. This stager hands the dynamic entries over as they are
(no second copy) and stages everything else with ``BlockingAsyncStager`` (TorchRec's
sharded tables, dense layers, optimizer state): one copy of the model in host memory,
taken before ``async_save`` returns.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

from torch.distributed.checkpoint.staging import BlockingAsyncStager

from dynemb.checkpoint.dcp_bytes import SavedAsBytes

_HANDED_OVER = object()  # where an entry was: nothing for the inner stager to copy


class DynamicEmbAsyncStager(BlockingAsyncStager):
    """Stages a state dict for ``dcp.async_save``: dynamic tables' entries as they are (host
    copies taken by ``state_dict()``), everything else copied to host memory by
    ``BlockingAsyncStager``. Staging is done when ``async_save`` returns: the model may
    train on while the checkpoint is written.

    Example::

        >>> import tempfile
        >>> import torch.distributed.checkpoint as dcp
        >>> from dynemb.checkpoint import DynamicEmbAsyncStager
        >>> ec = DynamicEmbCollection([EmbeddingConfig(name="t", embedding_dim=4,
        ...                                            num_embeddings=64, feature_names=["f"])],
        ...                           optimizer=OptimizerConfig())
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([1, 2]),
        ...                                           torch.tensor([2]))
        >>> ec(kjt)["f"].values().sum().backward()
        >>> path = tempfile.mkdtemp()
        >>> saving = dcp.async_save({"model": ec.state_dict()}, checkpoint_id=path,
        ...                         async_stager=DynamicEmbAsyncStager())
        >>> ec(kjt)["f"].values().sum().backward()       # training goes on
        >>> _ = saving.result()                          # the checkpoint is written
        >>> fresh = DynamicEmbCollection([EmbeddingConfig(
        ...     name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"])],
        ...     optimizer=OptimizerConfig())
        >>> state = {"model": fresh.state_dict()}
        >>> dcp.load(state, checkpoint_id=path)
        >>> fresh.load_state_dict(state["model"])
        <All keys matched successfully>
        >>> fresh.stats()["t"]["lookups"]                # one step, as when it was saved
        2
    """

    def __init__(self, type_check: bool = False):
        # no cached staging (BlockingAsyncStager's cache_staged_state_dict): the entries'
        # sizes follow the rows the tables hold, which change from one save to the next
        super().__init__(cache_staged_state_dict=False, type_check=type_check)

    def stage(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        entries: List[Tuple[Tuple, SavedAsBytes]] = []
        staged = super().stage(_hand_over(state_dict, (), entries))
        for path, tensor in entries:
            holder = staged
            for part in path[:-1]:
                holder = holder[part]
            holder[path[-1]] = tensor
        return staged


def _hand_over(obj: Any, path: Tuple, entries: List) -> Any:
    """``obj`` with each SavedAsBytes in its dicts and lists replaced by a marker (recorded
    in ``entries`` with its path)."""
    if isinstance(obj, SavedAsBytes):
        entries.append((path, obj))
        return _HANDED_OVER
    if isinstance(obj, dict):
        return {k: _hand_over(v, path + (k,), entries) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_hand_over(v, path + (i,), entries) for i, v in enumerate(obj)]
    return obj
