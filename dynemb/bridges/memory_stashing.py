"""Where dynamic tables meet TorchRec's memory stashing (``MemoryStashingManager``): every
use of its class-level state is here, so a TorchRec release that moves it changes one file.

Relies on the manager's private class attributes ``_embedding_weight_restore_callbacks`` (the
list ``restore_embedding_weights()`` pops and runs), ``_pending_stash_callbacks`` and
``_delay_stash`` (delayed stashing) and ``_stash_chunk_size_bytes`` (its copy trunk), because
TorchRec offers no public way to queue a restore that is not a fbgemm TBE's.

TorchRec's EMS pipelines (``TrainPipelineSparseDistEmbStash``, ``TrainPipelinePrefetchEMS``)
restore stashed weights by calling ``MemoryStashingManager.restore_embedding_weights()`` at
their injection site in backward; that call pops and runs the callbacks queued on the manager.
TorchRec's own sharded modules queue theirs from inside ``compute_and_output_dist`` through
``stash_embedding_weights(lookup)``, which reads fbgemm TBE internals (``weights_dev``) and
skips CPU tensors. A dynamic table has neither, so it stashes itself
(:mod:`dynemb.stashing.table_stash`) and queues its restore on the same list, where the
pipeline's hook finds it. In delayed-stash mode (``set_delay_stash(True)``) its stash joins
the manager's pending stashes instead and runs at ``execute_pending_stashes()``.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

try:  # TorchRec 1.8 and later
    from torchrec.distributed.memory_stashing import MemoryStashingManager, chunked_copy_
except ImportError:  # pragma: no cover - older TorchRec: no EMS to plug into
    MemoryStashingManager = None
    chunked_copy_ = None

#: TorchRec's default trunk of a bulk stash / restore copy (its ``_STASH_CHUNK_SIZE_BYTES``)
DEFAULT_CHUNK_BYTES = 32 * 1024 ** 2

RestoreCallback = Callable[[Optional[torch.Tensor], Optional["torch.cuda.Event"]], None]


def manager_enabled() -> bool:
    """True once a TorchRec EMS pipeline (or the user) has set the manager's CUDA streams."""
    return MemoryStashingManager is not None and MemoryStashingManager.is_enabled()


def manager_streams():
    """``(device-to-host, host-to-device)`` streams of the manager, or ``(None, None)``."""
    if not manager_enabled():
        return None, None
    return MemoryStashingManager.d2h_stream(), MemoryStashingManager.h2d_stream()


def chunk_bytes() -> int:
    """The manager's trunk size for bulk copies (``set_trunk_size``)."""
    return int(getattr(MemoryStashingManager, "_stash_chunk_size_bytes", DEFAULT_CHUNK_BYTES))


def copy_in_chunks(dst: torch.Tensor, src: torch.Tensor) -> None:
    """TorchRec's ``chunked_copy_`` (trunks with a tiny kernel between them, so other streams'
    small copies interleave) on the current stream; a plain non-blocking copy without it."""
    if chunked_copy_ is None:
        dst.copy_(src, non_blocking=True)
    else:
        chunked_copy_(dst, src, chunk_size_bytes=chunk_bytes(), non_blocking=True)


def _restore_list() -> List[RestoreCallback]:
    callbacks = getattr(MemoryStashingManager, "_embedding_weight_restore_callbacks", None)
    if not isinstance(callbacks, list):  # pragma: no cover - a TorchRec that moved it
        raise RuntimeError("this TorchRec's MemoryStashingManager keeps no list of embedding "
                           "restore callbacks; dynamic tables cannot join its EMS pipelines")
    return callbacks


def queue_restore(callback: RestoreCallback) -> None:
    """Queue ``callback`` for the next ``restore_embedding_weights()``, once: a callback
    still queued (its restore not yet called, e.g. after an exception) is not queued twice."""
    callbacks = _restore_list()
    if not any(c is callback or c == callback for c in callbacks):
        callbacks.append(callback)


def delay_stash_enabled() -> bool:
    """True when the manager defers stashes to ``execute_pending_stashes()``."""
    return MemoryStashingManager is not None and bool(
        getattr(MemoryStashingManager, "_delay_stash", False))


def queue_pending_stash(stash: Callable[[Optional[torch.Tensor]], None]) -> None:
    """Queue ``stash`` for the manager's next ``execute_pending_stashes()``."""
    pending = getattr(MemoryStashingManager, "_pending_stash_callbacks", None)
    if not isinstance(pending, list):  # pragma: no cover
        raise RuntimeError("this TorchRec's MemoryStashingManager keeps no pending stashes")
    pending.append(stash)
