"""The moves a stash is made of, on each kind of device.

:class:`~dynemb.stashing.table_stash.TableStash` writes the stash and restore sequences once,
against the small interface below (streams, events, copies, freeing and reallocating a
storage), so the CPU runs the same sequence as CUDA:

- :class:`HostTransfers` (tables in host memory): every copy has finished when it returns;
  there are no streams (``None``) and no events (``None``), waits do nothing.
- :class:`CudaTransfers`: copies are enqueued on side streams (TorchRec's
  ``MemoryStashingManager`` streams when its EMS pipeline has set them, else a pair of its
  own), ordered by events; nothing waits on the host.

Tests drive the same sequences through a model of CUDA's streams and caching allocator
(``tests/stream_model.py``) to check their ordering where no GPU is present.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch

from dynemb.bridges import memory_stashing


class HostTransfers:
    """Tables in host memory: synchronous copies, no streams, no events."""

    def current_stream(self):
        return None

    def side_streams(self) -> Tuple[None, None]:
        """``(device-to-host, host-to-device)`` copy streams."""
        return None, None

    def wait_stream(self, waiter, waited) -> None:
        pass

    def record_event(self, stream):
        return None

    def wait_event(self, stream, event) -> None:
        pass

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        pass

    def on(self, stream):
        """Context in which ``stream`` is the current stream."""
        return contextlib.nullcontext()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        """``dst.copy_(src)`` ordered on ``stream``."""
        dst.copy_(src)

    def host_buffer(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def device_buffer(self, shape, dtype: torch.dtype, device: torch.device,
                      stream) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    def release(self, tensor: torch.Tensor) -> None:
        """Drop ``tensor``'s storage: it keeps its identity and becomes empty ``[0, ...]``;
        the memory goes back once nothing else holds the old storage. (``set_`` rather than
        ``untyped_storage().resize_(0)``: a storage that has been seen through ``.numpy()``,
        as the CPU kernels see the rows, refuses to be resized.)"""
        tensor.set_(torch.empty((0,) + tuple(tensor.shape[1:]), dtype=tensor.dtype,
                                device=tensor.device))

    def reallocate(self, tensor: torch.Tensor, shape, stream) -> None:
        """Give the released ``tensor`` new memory of ``shape`` (contents undefined)."""
        tensor.set_(torch.empty(shape, dtype=tensor.dtype, device=tensor.device))


class CudaTransfers(HostTransfers):
    """Tables on a CUDA device. Copies run on side streams; host buffers are pinned (a copy
    from or to pageable memory would block the host).

    ``copy_streams``: ``(device-to-host, host-to-device)``; by default TorchRec's manager
    streams whenever they are set (an EMS pipeline's: the restore then queues behind the
    batch copies on its memcpy stream, as TorchRec's own stashes do), else two of its own.
    """

    def __init__(self, device: torch.device,
                 copy_streams: Optional[Tuple[torch.cuda.Stream, torch.cuda.Stream]] = None):
        self.device = torch.device(device)
        self._given = copy_streams
        self._own: Optional[Tuple[torch.cuda.Stream, torch.cuda.Stream]] = None

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def side_streams(self):
        if self._given is not None:
            return self._given
        d2h, h2d = memory_stashing.manager_streams()
        if d2h is not None:
            return d2h, h2d
        if self._own is None:
            self._own = (torch.cuda.Stream(device=self.device),
                         torch.cuda.Stream(device=self.device))
        return self._own

    def wait_stream(self, waiter, waited) -> None:
        if waiter is not None and waited is not None and waiter != waited:
            waiter.wait_stream(waited)

    def record_event(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream, event) -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)

    def on(self, stream):
        return torch.cuda.stream(stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        with torch.cuda.stream(stream):
            memory_stashing.copy_in_chunks(dst, src)

    def host_buffer(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def device_buffer(self, shape, dtype, device, stream) -> torch.Tensor:
        with torch.cuda.stream(stream):
            return torch.empty(shape, dtype=dtype, device=device)

    def reallocate(self, tensor: torch.Tensor, shape, stream) -> None:
        # the caching allocator serves the block from ``stream``'s pool
        with torch.cuda.stream(stream):
            super().reallocate(tensor, shape, stream)


def transfers_for(device: torch.device) -> HostTransfers:
    """The transfers of tables on ``device``."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaTransfers(device)
    if device.type == "cpu":
        return HostTransfers()
    raise ValueError(f"memory stashing runs on CPU or CUDA tables, not {device.type}")
