"""What ``nn.Module`` conversions (``.to()``, ``.half()``, ``.cuda()``...) may do to a module
whose tables are not parameters: nothing, or raise; and what pickling it takes."""
from __future__ import annotations

from typing import Optional

import torch


_DEVICE_HOW = ("build it on the target device (DynamicEmbCollection(..., device=...)), or build "
               "it on the meta device and shard it with DistributedModelParallel(..., "
               "device=...)")


def check_conversion(fn, device: torch.device) -> None:
    """Raise if ``fn`` (an ``nn.Module._apply`` function) would move or cast a float32 tensor
    on ``device``: the tables would not follow.

    ``.to()``, ``.cuda()``, ``.half()``, ``.to_empty()``... reach a dynamic collection through
    ``nn.Module._apply``. Its tables are not parameters, so these calls could not move or
    convert them: any that would change the device or the dtype raises instead of being
    ignored. Calls that change nothing (``.float()``, ``.cpu()`` on CPU, ``.to(own
    device)``, what ``DistributedModelParallel`` does) pass.

    Example::

        >>> ec = DynamicEmbCollection(tables=[EmbeddingConfig(
        ...     name="t", embedding_dim=8, num_embeddings=1024, feature_names=["f"])])
        >>> ec.half()
        Traceback (most recent call last):
        RuntimeError: DynamicEmbCollection cannot be converted to torch.float16 ...
    """
    probe, out = _probe(fn, device)
    if not isinstance(out, torch.Tensor):
        return
    if out.device != probe.device or device.type == "meta" and probe.device.type != "meta":
        materialize = (", or materialize it there with .to_empty(device=...)"
                       if device.type == "meta" else "")
        raise RuntimeError(
            f"DynamicEmbCollection is on {device} and cannot be moved to {out.device} by "
            f".to()/.cuda()/.cpu()/.to_empty(): its tables are hash tables, not parameters, "
            f"and would stay where they are. Instead, {_DEVICE_HOW}{materialize}")
    if out.dtype != probe.dtype:
        raise RuntimeError(
            f"DynamicEmbCollection cannot be converted to {out.dtype} by .to(dtype)/.half()/"
            f".bfloat16()/.double(): its tables are not parameters and would keep their dtype "
            f"(forward always returns float32 embeddings). Choose the storage dtype at "
            f"construction: DynamicEmbTableOptions(embedding_dtype=...), one of torch.float32, "
            f"torch.float16, torch.bfloat16")


def materialized_device(fn, device: torch.device) -> Optional[torch.device]:
    """The real device to which ``fn`` (an ``nn.Module._apply`` function) materializes a
    module on ``device`` meta, as ``to_empty(device=...)`` does: ``fn`` takes a meta tensor
    to another device without reading it (``.to()`` cannot copy out of meta and raises).
    None for any other call, or a module not on meta.

    Example::

        >>> materialized_device(lambda t: torch.empty_like(t, device="cpu"),
        ...                     torch.device("meta"))
        device(type='cpu')
        >>> materialized_device(lambda t: t.to("cpu"), torch.device("meta")) is None
        True
    """
    if device.type != "meta":
        return None
    probe = torch.zeros(1, device=device)
    try:
        out = fn(probe)
    except Exception:  # .to()/.cuda() of a meta tensor: not a materialization
        return None
    if (isinstance(out, torch.Tensor) and out.device.type != "meta"
            and out.dtype == probe.dtype):
        return out.device
    return None


def _probe(fn, device: torch.device):
    """``(probe, fn(probe))`` for a float32 tensor on ``device`` (on CPU where nothing can be
    copied out of meta, to learn where ``fn`` goes)."""
    try:
        probe = torch.zeros(1, device=device)
        return probe, fn(probe)
    except Exception as err:
        failure = err
    if device.type == "meta":
        probe = torch.zeros(1)
        try:
            return probe, fn(probe)
        except Exception:
            pass
    raise RuntimeError(
        f"DynamicEmbCollection on {device} cannot be moved or converted by this call "
        f"({type(failure).__name__}: {failure}); its tables are not parameters. To use another "
        f"device, {_DEVICE_HOW}") from failure


def prepare_pickle(module) -> None:
    """Ready a dynamic collection for ``torch.save(module)``, which pickles it whole as it
    stands (rows, optimizer state, scores, counters, queued prefetches and their pins):
    stashed rows come back from host memory first. A module on CUDA cannot be pickled (its
    prefetch stream and events are CUDA objects): raise naming what to save instead."""
    if module.device.type == "cuda":
        raise TypeError(
            f"{type(module).__name__} on {module.device} cannot be pickled (its prefetch "
            f"stream and events are CUDA objects); save module.state_dict() with torch.save, "
            f"or dynemb.checkpoint.dump(module, path)")
    if module.memory_stash is not None and module.memory_stash.stashed:
        module.memory_stash.restore()
