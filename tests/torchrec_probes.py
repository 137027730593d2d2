"""What the tests observe of TorchRec's planner, train pipelines and memory stashing, in one
place: a TorchRec upgrade that moves any of it changes this file only.

Public TorchRec API gives most of it:

- :class:`SearchSpaceRecorder`: the options the planner's enumerator searched, read from the
  enumerator TorchRec hands to its :class:`~torchrec.distributed.planner.types.Stats` after a
  plan (``EmbeddingEnumerator.last_stored_search_space``);
- :func:`sharder_data_map`: what an estimator's ``estimate`` takes, built from an enumerator's
  public ``sharder_map`` as the enumerator builds its own;
- :func:`pipelined_module_types`: the modules a train pipeline runs its input distribution
  for ahead of the forward, i.e. those whose ``forward`` it replaced with one of its
  ``BaseForward`` callables.

One read has no public counterpart, :func:`queued_weight_restores`: see its docstring.
"""
from typing import Any, Dict, List, Optional

import torch
from torchrec.distributed.memory_stashing import MemoryStashingManager
from torchrec.distributed.planner.stats import EmbeddingStats
from torchrec.distributed.planner.types import Enumerator, ShardingOption, Stats
from torchrec.distributed.planner.utils import build_sharder_data_map
from torchrec.distributed.train_pipeline.runtime_forwards import BaseForward


class SearchSpaceRecorder(Stats):
    """Pass as a planner's ``stats`` (beside TorchRec's default ``EmbeddingStats``, see
    :meth:`planner_stats`); after ``plan()``, :attr:`search_space` holds the options the
    planner's enumerator searched.

    Example::

        >>> recorder = SearchSpaceRecorder()
        >>> recorder.search_space is None
        True
    """

    def __init__(self):
        self.enumerator: Optional[Enumerator] = None

    def planner_stats(self) -> List[Stats]:
        """TorchRec's default stats (they only log) and this recorder."""
        return [EmbeddingStats(), self]

    @property
    def search_space(self) -> Optional[List[ShardingOption]]:
        return None if self.enumerator is None else self.enumerator.last_stored_search_space

    def log(self, *args: Any, enumerator: Optional[Enumerator] = None, **kwargs: Any) -> None:
        self.enumerator = enumerator


def sharder_data_map(enumerator) -> Dict[str, Any]:
    """The sharder data an estimator's ``estimate`` takes, for the sharders of the
    enumerator's last ``enumerate`` (what the enumerator hands its own estimators)."""
    return build_sharder_data_map(enumerator.sharder_map)


def pipelined_module_types(model: torch.nn.Module) -> List[str]:
    """The type names of the modules of ``model`` a train pipeline has taken over (their
    input distribution runs a batch ahead), after its first ``progress``."""
    return [type(module).__name__ for module in model.modules()
            if isinstance(module.forward, BaseForward)]


def queued_weight_restores() -> int:
    """How many embedding-weight restores TorchRec's ``MemoryStashingManager`` holds queued
    for its next ``restore_embedding_weights()``. TorchRec keeps them in a private class
    attribute with no public count; a test reads it to show a stashed collection queues one
    restore per stash (not one per forward) and that the manager's restore empties it."""
    return len(MemoryStashingManager._embedding_weight_restore_callbacks)
