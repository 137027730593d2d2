"""TorchRec's train pipelines for models with dynamic tables, also on CPU.

- :class:`PrefetchTrainPipelineSparseDist`: TorchRec's prefetch pipeline (the next batch's
  rows are prefetched while this one trains); on a device without streams (CPU) it calls each
  module's ``prefetch`` inline at the same point of the step;
- :class:`TrainPipelineSparseDistEmbStash` and :class:`TrainPipelinePrefetchEMS`: TorchRec's
  embedding memory stashing (EMS) pipelines, which restore stashed rows at the backward of
  ``site_fqn`` (see :mod:`dynemb.stashing`). TorchRec's constructors create CUDA streams for
  the ``MemoryStashingManager``; on CPU these skip them (host copies need none). Either way
  they tell the model's dynamic tables to queue their restores on the manager, where the
  pipeline's backward hook at ``site_fqn`` finds them (with TorchRec's own classes on CUDA that
  happens by itself once the manager's streams are set).

On CUDA each is TorchRec's pipeline with the same schedule and hooks.

Example::

    >>> pipeline = TrainPipelineSparseDistEmbStash(model, optimizer, torch.device("cpu"),
    ...                                            site_fqn="over")  # doctest: +SKIP
    >>> loss, out = pipeline.progress(batches)  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn
from torchrec.distributed.train_pipeline import experimental_pipelines as experimental
from torchrec.distributed.train_pipeline.backward_injection import InjectionSite

from dynemb.bridges.ems_pipelines import init_without_streams
from dynemb.bridges.prefetch_pipeline import PrefetchTrainPipelineSparseDist
from dynemb.stashing import collection_stashes

__all__ = ["PrefetchTrainPipelineSparseDist", "TrainPipelineSparseDistEmbStash",
           "TrainPipelinePrefetchEMS", "hand_restores_to_torchrec"]


def hand_restores_to_torchrec(model: nn.Module) -> int:
    """Make every stashing dynamic collection in ``model`` queue its restores on TorchRec's
    ``MemoryStashingManager``; returns how many there are.

    Example::

        >>> hand_restores_to_torchrec(torch.nn.Linear(2, 2))  # no dynamic table stashes
        0
    """
    stashes = collection_stashes(model)
    for stash in stashes:
        stash.hand_restores_to_torchrec = True
    return len(stashes)


class TrainPipelineSparseDistEmbStash(experimental.TrainPipelineSparseDistEmbStash):
    """TorchRec's ``TrainPipelineSparseDistEmbStash`` (restore at the backward of
    ``site_fqn``, e.g. the over-arch), also on CPU; same arguments."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device, site_fqn: Union[str, InjectionSite], *,
                 delay_stash: bool = False, stash_site_fqn: Optional[str] = None, **kwargs):
        if device.type == "cuda":
            super().__init__(model, optimizer, device, site_fqn, delay_stash=delay_stash,
                             stash_site_fqn=stash_site_fqn, **kwargs)
        else:
            init_without_streams(self, model, optimizer, device, site_fqn,
                                 delay_stash=delay_stash, stash_site_fqn=stash_site_fqn,
                                 kwargs=kwargs)
        hand_restores_to_torchrec(model)


class TrainPipelinePrefetchEMS(experimental.TrainPipelinePrefetchEMS):
    """TorchRec's ``TrainPipelinePrefetchEMS`` (restore, then prefetch the next batch, before
    each backward), also on CPU; same arguments."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device, site_fqn: Union[str, InjectionSite], **kwargs):
        if device.type == "cuda":
            super().__init__(model, optimizer, device, site_fqn, **kwargs)
        else:
            init_without_streams(self, model, optimizer, device, site_fqn, kwargs=kwargs)
        hand_restores_to_torchrec(model)
