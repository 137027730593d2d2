"""TorchRec's EMS train pipelines built where there are no CUDA streams (CPU).

``TrainPipelineSparseDistEmbStash.__init__`` (and ``TrainPipelinePrefetchEMS``'s, which is
the same) creates a CUDA stream for the ``MemoryStashingManager``, so it cannot run on a CPU.
:func:`init_without_streams` does what it does less the streams, which means setting the
private attributes its hooks read later (``_injection_site``, ``_delay_stash``,
``_stash_site_fqn``, ``_stash_hook_handle``) and calling its ``_log_ems_config``; a TorchRec
release that renames them breaks ``tests/test_bridges.py``.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Union

import torch
from torch import nn
from torchrec.distributed.train_pipeline.backward_injection import (FirstGradTensorFinder,
                                                                   InjectionSite,
                                                                   InjectionTargetType)
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDist

from dynemb.bridges.memory_stashing import MemoryStashingManager

#: the attributes TorchRec's EMS constructor sets beyond ``TrainPipelineSparseDist``'s
EMS_ATTRIBUTES = ("_injection_site", "_delay_stash", "_stash_site_fqn", "_stash_hook_handle")


def injection_site(site_fqn: Union[str, InjectionSite]) -> InjectionSite:
    """TorchRec's site for a module name: the gradient of its first parameter.

    Example::

        >>> injection_site("over").fqn
        'over'
    """
    if not isinstance(site_fqn, str):
        return site_fqn
    return InjectionSite(fqn=site_fqn, tensor_finder=FirstGradTensorFinder(),
                         target_type=InjectionTargetType.PARAM_GRAD)


def init_without_streams(pipeline, model: nn.Module, optimizer: torch.optim.Optimizer,
                         device: torch.device, site_fqn: Union[str, InjectionSite], *,
                         delay_stash: bool = False, stash_site_fqn: Optional[str] = None,
                         kwargs: Dict[str, Any]) -> None:
    """What ``TrainPipelineSparseDistEmbStash.__init__`` does to ``pipeline``, less the CUDA
    streams; ``kwargs`` go to ``TrainPipelineSparseDist``."""
    TrainPipelineSparseDist.__init__(pipeline, model=model, optimizer=optimizer, device=device,
                                     **kwargs)
    pipeline._injection_site = injection_site(site_fqn)
    pipeline._delay_stash = delay_stash
    pipeline._stash_site_fqn = stash_site_fqn
    pipeline._stash_hook_handle = None
    if delay_stash:
        MemoryStashingManager.set_delay_stash(True)
    pipeline._log_ems_config()
