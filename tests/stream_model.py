"""A model of CUDA streams, events and the caching allocator's block reuse, for checking the
ordering of memory stashing where no GPU is present.

:class:`ModelTransfers` has the interface of :class:`dynemb.stashing.transfers.HostTransfers`,
so :class:`~dynemb.stashing.TableStash` runs its real stash and restore sequences against it.
Tensors are CPU tensors; what a stream does is queued and runs later, in the order the test
chooses (a slow copy stream, a fast one...):

- a stream runs its operations in order; ``wait_event`` blocks it until the event's stream has
  run everything queued before the event was recorded;
- a copy reads its source when it runs. If the source's block was handed to another
  allocation and written before that (the hazard TorchRec's EMS once hit), the copy reads
  someone else's data: the model writes NaN;
- the allocator: a freed block goes back to the pool of the stream it was allocated on; if
  ``record_stream`` named other streams, events are recorded on them at the free and the
  block is reused only once they have completed (CUDA's caching allocator does this);
  otherwise it may be reused at once by an allocation on that stream;
- new blocks and host buffers start as NaN (undefined contents);
- host work done "on" a stream (the replay of row initializations) runs after everything
  queued on that stream: entering ``on(stream)``, or waiting on it there, runs the stream
  (and whatever it waits for) to the end first.

Nothing here can block the host: the interface has no such operation, which is the point.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set

import torch


class ModelStream:
    def __init__(self, name: str):
        self.name = name
        self.ops: List[Callable[[], bool]] = []  # each returns False while it cannot run yet
        self.done = 0

    def __repr__(self) -> str:
        return f"<stream {self.name}: {self.done}/{len(self.ops)} run>"


@dataclass
class ModelEvent:
    stream: ModelStream
    position: int

    @property
    def complete(self) -> bool:
        return self.stream.done >= self.position


@dataclass
class Block:
    stream: ModelStream                    # allocated on (its pool)
    uses: Set[ModelStream] = field(default_factory=set)  # record_stream
    free_events: Optional[List[ModelEvent]] = None  # set when freed
    writes: int = 0                        # writes by later owners of the memory
    nbytes: int = 0

    def reusable(self) -> bool:
        return self.free_events is not None and all(e.complete for e in self.free_events)


class ModelTransfers:
    """See the module docstring. ``record_streams=False`` drops ``record_stream`` calls and
    ``ignored_waits`` the waits on events of the named streams (to show what they prevent)."""

    def __init__(self, *, record_streams: bool = True, ignored_waits=()):
        self.streams = {n: ModelStream(n) for n in ("compute", "prefetch", "d2h", "h2d")}
        self._current = self.streams["compute"]
        self._entered: List[ModelStream] = []
        self._blocks: Dict[int, Block] = {}   # by data pointer of the tensor's storage
        self._alive: List[torch.Tensor] = []  # no address is reused while the model runs
        self._record_streams = record_streams
        self._ignored = set(ignored_waits)
        self.reused_blocks = 0
        #: every host buffer handed out, in order: where a test reads what a stash copied
        self.host_buffers: List[torch.Tensor] = []

    # -- bookkeeping ---------------------------------------------------------------------------
    def adopt(self, tensor: torch.Tensor, stream: str = "compute") -> None:
        """Say that ``tensor`` lives in a block allocated on ``stream``."""
        self._block(tensor, self.streams[stream])

    def _block(self, tensor: torch.Tensor, stream: Optional[ModelStream] = None) -> Block:
        key = tensor.untyped_storage().data_ptr()
        self._alive.append(tensor.detach())
        if key not in self._blocks or stream is not None:
            self._blocks[key] = Block(stream or self._current,
                                      nbytes=tensor.untyped_storage().nbytes())
        return self._blocks[key]

    def run(self, name: str, limit: Optional[int] = None) -> None:
        """Run stream ``name`` as far as it can (at most ``limit`` operations)."""
        stream = self.streams[name]
        ran = 0
        while stream.done < len(stream.ops) and (limit is None or ran < limit):
            if not stream.ops[stream.done]():
                return
            stream.done += 1
            ran += 1

    def finish(self, order=("compute", "prefetch", "h2d", "d2h")) -> None:
        """Run every stream to the end (round robin in ``order``, then the others)."""
        order = tuple(order) + tuple(n for n in self.streams if n not in order)
        while any(s.done < len(s.ops) for s in self.streams.values()):
            before = sum(s.done for s in self.streams.values())
            for name in order:
                self.run(name)
            if sum(s.done for s in self.streams.values()) == before:
                raise RuntimeError(f"deadlock: {list(self.streams.values())}")

    def _drain(self, stream: ModelStream) -> None:
        """Host work about to run on ``stream``: everything queued there runs first."""
        while stream.done < len(stream.ops):
            self.finish()

    def launch(self, name: str, fn: Callable[[], None]) -> None:
        """Queue a kernel ``fn`` on stream ``name``."""
        self.streams[name].ops.append(lambda: (fn(), True)[1])

    def allocate(self, nbytes: int, name: str = "compute") -> bool:
        """An allocation on stream ``name`` (e.g. an activation of the dense forward) whose
        kernel then writes it. Takes a reusable freed block of that stream's pool if there
        is one; returns whether it did."""
        stream = self.streams[name]
        for key, block in list(self._blocks.items()):
            if block.stream is stream and block.nbytes >= nbytes and block.reusable():
                del self._blocks[key]
                block.free_events = None
                self.reused_blocks += 1
                stream.ops.append(lambda b=block: (setattr(b, "writes", b.writes + 1), True)[1])
                return True
        return False

    # -- the HostTransfers interface -----------------------------------------------------------
    def current_stream(self):
        return self._current

    def side_streams(self):
        return self.streams["d2h"], self.streams["h2d"]

    def record_event(self, stream):
        return ModelEvent(stream, len(stream.ops))

    def wait_event(self, stream, event) -> None:
        if stream is None or event is None or event.stream.name in self._ignored:
            return
        stream.ops.append(lambda: event.complete)
        if stream in self._entered:
            self._drain(stream)

    def wait_stream(self, waiter, waited) -> None:
        if waiter is not waited:
            self.wait_event(waiter, self.record_event(waited))

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        if self._record_streams:
            self._block(tensor).uses.add(stream)

    @contextlib.contextmanager
    def on(self, stream):
        previous, self._current = self._current, stream
        self._entered.append(stream)
        self._drain(stream)
        try:
            yield
        finally:
            self._entered.pop()
            self._current = previous

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        source, target = src.detach(), dst.detach()  # the memory as of now, as a kernel sees it
        block = self._blocks.get(src.untyped_storage().data_ptr())
        writes = None if block is None else block.writes

        def op() -> bool:
            if block is not None and block.writes != writes:
                target.fill_(float("nan"))  # the block held another allocation's data
            else:
                target.copy_(source)
            return True

        stream.ops.append(op)

    def host_buffer(self, shape, dtype) -> torch.Tensor:
        buffer = torch.full(shape, float("nan"), dtype=dtype)  # undefined until a copy fills it
        self.host_buffers.append(buffer)
        return buffer

    def device_buffer(self, shape, dtype, device, stream) -> torch.Tensor:
        tensor = torch.full(shape, float("nan"), dtype=dtype)
        self._block(tensor, stream)
        return tensor

    def release(self, tensor: torch.Tensor) -> None:
        block = self._block(tensor)
        # CUDA's allocator records an event on each recorded stream when the block is freed
        block.free_events = [self.record_event(s) for s in block.uses if s is not block.stream]
        tensor.set_(torch.empty((0,) + tuple(tensor.shape[1:]), dtype=tensor.dtype))

    def reallocate(self, tensor: torch.Tensor, shape, stream) -> None:
        fresh = torch.full(shape, float("nan"), dtype=tensor.dtype)
        tensor.set_(fresh)
        self._block(tensor, stream)
