"""TorchRec's EMS train pipelines, made to run where there are no CUDA streams (CPU).

``TrainPipelineSparseDistEmbStash`` and ``TrainPipelinePrefetchEMS``
(``torchrec.distributed.train_pipeline.experimental_pipelines``) create a CUDA stream for
TorchRec's ``MemoryStashingManager`` in their constructor, so they cannot be built on a CPU.
These subclasses keep TorchRec's schedule and hooks unchanged: on CUDA they are TorchRec's
pipelines; on CPU the constructor skips the streams (host copies need none). Either way they
tell the model's dynamic tables to queue their restores on the manager, where the pipeline's
backward hook at ``site_fqn`` finds them (with TorchRec's own classes on CUDA that happens by
itself once the manager's streams are set).

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
from torchrec.distributed.train_pipeline.backward_injection import (FirstGradTensorFinder,
                                                                   InjectionSite,
                                                                   InjectionTargetType)
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDist

from dynemb.stashing import torchrec_bridge


def hand_restores_to_torchrec(model: nn.Module) -> int:
    """Make every stashing dynamic collection in ``model`` queue its restores on TorchRec's
    ``MemoryStashingManager``; returns how many there are."""
    from dynemb.stashing import collection_stashes
    stashes = collection_stashes(model)
    for stash in stashes:
        stash.hand_restores_to_torchrec = True
    return len(stashes)


def _init_without_streams(pipeline, model, optimizer, device, site_fqn, delay_stash: bool,
                          stash_site_fqn: Optional[str], kwargs) -> None:
    """What ``TrainPipelineSparseDistEmbStash.__init__`` does, less the CUDA streams."""
    TrainPipelineSparseDist.__init__(pipeline, model=model, optimizer=optimizer, device=device,
                                     **kwargs)
    pipeline._injection_site = (
        InjectionSite(fqn=site_fqn, tensor_finder=FirstGradTensorFinder(),
                      target_type=InjectionTargetType.PARAM_GRAD)
        if isinstance(site_fqn, str) else site_fqn)
    pipeline._delay_stash = delay_stash
    pipeline._stash_site_fqn = stash_site_fqn
    pipeline._stash_hook_handle = None
    if delay_stash:
        torchrec_bridge.MemoryStashingManager.set_delay_stash(True)
    pipeline._log_ems_config()


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
            _init_without_streams(self, model, optimizer, device, site_fqn, delay_stash,
                                  stash_site_fqn, kwargs)
        hand_restores_to_torchrec(model)


class TrainPipelinePrefetchEMS(experimental.TrainPipelinePrefetchEMS):
    """TorchRec's ``TrainPipelinePrefetchEMS`` (restore, then prefetch the next batch, before
    each backward), also on CPU; same arguments."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device, site_fqn: Union[str, InjectionSite], **kwargs):
        if device.type == "cuda":
            super().__init__(model, optimizer, device, site_fqn, **kwargs)
        else:
            _init_without_streams(self, model, optimizer, device, site_fqn, False, None, kwargs)
        hand_restores_to_torchrec(model)
