"""TorchRec's default planner, able to plan dynamic tables.

``DistributedModelParallel`` without a plan builds ``EmbeddingShardingPlanner(topology=...)``
itself, whose ``EmbeddingEnumerator`` (built without estimators) uses TorchRec's default perf
and storage estimators. The perf one looks ``customized_kernel`` up in TorchRec's kernel
bandwidth table, finds nothing and raises; the storage one would size a dynamic table as a
``num_embeddings x dim`` tensor on the device, which is not what it allocates (no hash
metadata or optimizer state, and a CACHE or DEFAULT table's whole height on the device).

:func:`install_default_estimators` makes such an enumerator wrap its two default estimators in
:class:`~dynemb.planning.estimators.DynamicEmbPerfEstimator` and
:class:`~dynemb.planning.estimators.DynamicEmbStorageEstimator`. Those estimate the options of
dynamic tables and hand every other option to the very TorchRec estimator they wrap, so a
model without dynamic tables gets exactly TorchRec's estimates. An enumerator given its own
estimators is left alone. Building a dynemb sharder installs it.
"""
from __future__ import annotations

import functools
from typing import List

from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.estimator.estimator import (
    EmbeddingPerfEstimator as HardwarePerfEstimator)
from torchrec.distributed.planner.shard_estimators import (EmbeddingPerfEstimator,
                                                           EmbeddingStorageEstimator)
from torchrec.distributed.planner.types import ShardEstimator, Topology
from torchrec.distributed.types import PipelineType

from dynemb.planning.estimators import DynamicEmbPerfEstimator, DynamicEmbStorageEstimator

_MARK = "_dynemb_wraps_default_estimators"


def with_dynamic_tables(estimators: List[ShardEstimator], topology: Topology,
                        constraints=None) -> List[ShardEstimator]:
    """``estimators`` with TorchRec's perf and storage estimators wrapped in dynemb's (which
    delegate every option that is not a dynamic table to them); others kept.

    Example::

        >>> topology = Topology(world_size=2, compute_device="cpu")
        >>> [type(e).__name__ for e in with_dynamic_tables(
        ...     EmbeddingEnumerator(topology, 64)._estimators, topology)]
        ['DynamicEmbPerfEstimator', 'DynamicEmbStorageEstimator']
    """
    out: List[ShardEstimator] = []
    for estimator in estimators:
        if isinstance(estimator, (EmbeddingPerfEstimator, HardwarePerfEstimator)):
            estimator = DynamicEmbPerfEstimator(
                topology, constraints, is_inference=getattr(estimator, "_is_inference", False),
                torchrec_estimator=estimator)
        elif isinstance(estimator, EmbeddingStorageEstimator):
            estimator = DynamicEmbStorageEstimator(
                topology, constraints,
                pipeline_type=getattr(estimator, "_pipeline_type", PipelineType.NONE),
                run_embedding_at_peak_memory=getattr(
                    estimator, "_run_embedding_at_peak_memory", False),
                is_inference=getattr(estimator, "_is_inference", False),
                torchrec_estimator=estimator)
        out.append(estimator)
    return out


def install_default_estimators() -> None:
    """Make every ``EmbeddingEnumerator`` built from now on without ``estimator=`` (TorchRec's
    default planner, DMP without a plan) estimate dynamic tables with dynemb's estimators
    (:func:`with_dynamic_tables`). Idempotent.

    Example::

        >>> install_default_estimators()
        >>> enumerator = EmbeddingEnumerator(Topology(world_size=1, compute_device="cpu"), 64)
        >>> type(enumerator._estimators[1]).__name__
        'DynamicEmbStorageEstimator'
    """
    original = EmbeddingEnumerator.__init__
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def __init__(self, topology, batch_size, constraints=None, estimator=None, *args,
                 **kwargs):
        original(self, topology, batch_size, constraints, estimator, *args, **kwargs)
        if not estimator:
            self._estimators = with_dynamic_tables(self._estimators, topology, constraints)

    setattr(__init__, _MARK, True)
    EmbeddingEnumerator.__init__ = __init__
