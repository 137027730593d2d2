"""``TableStash``: one table's device rows moved to host memory and back.

A table's device rows are one tensor, ``table.tier.flat.weights`` ``[capacity, width]``
(embedding columns, then optimizer state; :class:`~dynemb.rows.flat_table.RowLayout`).
:meth:`TableStash.stash` copies the columns its :class:`~dynemb.options.StashMode` names to a
host buffer and releases the tensor's storage (the tensor object stays, with an empty
storage: ``weights.untyped_storage().nbytes() == 0``); columns kept on the device are parked
in a compact device buffer first. :meth:`TableStash.restore` gives the tensor new memory and
copies everything back. The hash table (keys, scores, pins) never moves.

While the rows are away the tier's ``flat`` is a :class:`StashedRows` stand-in. Every row
access of every storage mode, and of checkpoints, goes through ``tier.flat``, so the stand-in
sees all of them:

- ``initialize_where`` (new rows of the next batch's prefetch) is recorded and replayed on
  the real rows right after they come back. Those rows are in unpinned slots, disjoint from
  the slots of the lookup awaiting its backward (pinned), so replaying them after that
  backward's update gives the rows an unstashed run has;
- anything else (``weights``, ``gather``, ``scatter``, ``remap`` after the hash table grew,
  a CACHE write-back or load, ``read_rows``, ``state_dict``, an eval lookup) restores first;
- sizes and layout (``capacity``, ``layout``, ``dim``...) answer without restoring.

A table group (:mod:`dynemb.tables.groups`) keeps its tables' rows in one tensor, each
table's flat table a view of its part; its stash is one ``TableStash`` over the group's
:class:`~dynemb.tables.group_storage.GroupRows`. The stash copies and releases the group's
tensor and every table's view (so no byte stays), makes each table's ``flat`` a
:class:`PartStashed` meanwhile, and points the views at the rows again when they are back;
the group's own row writes go through its ``flat``'s ``write_new_rows``, recorded while the
rows are away like ``initialize_where``.

CUDA ordering (see :class:`~dynemb.stashing.transfers.CudaTransfers`; no host waits):

- stash: the device-to-host stream waits for the forward stream (the lookup's reads) and the
  prefetch stream (rows it wrote), and for the last restore's copy (it read the host buffer),
  then copies; ``record_stream(d2h)`` before the storage is dropped makes the caching
  allocator hold the freed block until an event it records on the copy stream at the free
  has completed, i.e. until the copy has read all of it: no allocation can reuse the block
  earlier;
- restore: the rows' new block comes from the host-to-device stream's pool (so it waits
  for nobody's earlier work), the copy waits for the stash's event (the host buffer is
  complete), then the forward, current and prefetch streams wait for the copy's event.
"""
from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from dynemb.rows.flat_table import RowLayout
from dynemb.options import StashMode

#: FlatTable attributes that describe rows without reading them
_SHAPE_ONLY = ("layout", "dim", "optimizer_state_dim", "backend")


def stashed_columns(mode: StashMode, row: RowLayout) -> Tuple[Tuple[int, int],
                                                               Optional[Tuple[int, int]]]:
    """``(stashed, kept)`` physical column ranges of a row under ``mode``; ``kept`` is None
    when whole rows go.

    Example::

        >>> row = RowLayout(dim=8, state_dim=16)  # Adam: 8 values, 16 state columns
        >>> stashed_columns(StashMode.VALUES, row)
        ((0, 8), (8, 24))
        >>> stashed_columns(StashMode.ALL, row)
        ((0, 24), None)
    """
    width, values = row.width, row.embedding_columns
    if mode is StashMode.ALL or (mode is StashMode.VALUES and values == width):
        return (0, width), None
    if mode is StashMode.VALUES:
        return (0, values), (values, width)
    if mode is StashMode.OPTIMIZER_STATE:
        if values == width:
            raise ValueError("StashMode.OPTIMIZER_STATE on rows without optimizer state")
        return (values, width), (0, values)
    raise ValueError(f"nothing to stash for {mode}")


def stashed_bytes_per_row(mode: StashMode, row: RowLayout) -> int:
    """Device bytes one row frees while stashed (and the host buffer holds).

    Example::

        >>> stashed_bytes_per_row(StashMode.OPTIMIZER_STATE, RowLayout(dim=8, state_dim=1))
        4
    """
    if mode is StashMode.NONE:
        return 0
    (start, stop), _ = stashed_columns(mode, row)
    return (stop - start) * row.element_size


def _other_holders(released: "weakref.ref") -> int:
    """Holders of the rows' memory besides the table, once the table's own tensors have let
    go of it (``released``: a weak reference to that storage): 1 while something still
    holds it (a view of the rows kept across a step, a numpy array of them), else 0. Torch
    keeps a storage's Python object for as long as any tensor uses the storage, so the weak
    reference dies exactly when the memory does: nothing is counted."""
    return 0 if released() is None else 1


@dataclass
class _JournaledWrite:
    """One row initialization made while the rows were away: ``replay(flat)`` makes it on
    the rows once they are back."""

    replay: Callable[[object], None]
    tensors: Tuple[torch.Tensor, ...]  # what it reads
    ready: object  # event on the stream that made the tensors (None on CPU)
    stream: object


@dataclass
class _Part:
    """A tier whose flat table holds a stashed record's rows (a table of a group): a view of
    its part, and where that lies, to point it at the rows again when they are back; or
    (``view`` False, a group of one on its table's own arrays) the record's tensor itself."""

    tier: object
    flat: object
    view: bool
    offset: int
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]


class TableStash:
    """The stash of one table's device tier (built by
    :class:`~dynemb.stashing.CollectionStash`).

    Args:
        name: the table, for messages.
        tier: the table's device :class:`~dynemb.tables.tier.Tier`, or the rows of a table
            group (:class:`~dynemb.tables.group_storage.GroupRows`: one tensor for all its
            tables, whose tiers, its ``parts()``, view it; they go and come back together).
        mode: what to stash (not ``NONE``).
        row: the table's physical :class:`RowLayout`.
        transfers: :class:`~dynemb.stashing.transfers.HostTransfers` or ``CudaTransfers``.
        extra_streams: other streams that write or read the rows (the collection's prefetch
            stream); the stash waits for them, they wait for the restore.

    Example::

        >>> from dynemb.stashing.transfers import HostTransfers
        >>> from dynemb.tables.tier import Tier
        >>> from dynemb.options import choose_storage_mode
        >>> options = DynamicEmbTableOptions()
        >>> layout = choose_storage_mode(options, name="t", num_embeddings=128, width=4,
        ...                              config_dtype=torch.float32)
        >>> tier = Tier(layout, 128, 4, 0, options, torch.device("cpu"), None)
        >>> tier.flat.weights[:] = 1.5
        >>> stash = TableStash("t", tier, StashMode.ALL, RowLayout(4), HostTransfers())
        >>> stash.stash()
        True
        >>> stash.rows().untyped_storage().nbytes(), tier.flat.capacity  # rows() reads in place
        (0, 128)
        >>> float(tier.flat.weights.sum())  # any row access brings the rows back first
        768.0
        >>> stash.stashed, stash.rows().untyped_storage().nbytes()
        (False, 2048)
    """

    def __init__(self, name: str, tier, mode: StashMode, row: RowLayout, transfers,
                 extra_streams: Sequence = ()):
        self.name = name
        self.tier = tier
        self.mode = mode
        self._cols, self._keep = stashed_columns(mode, row)
        self._t = transfers
        self._extra = [s for s in extra_streams if s is not None]
        self._flat = None                   # the real FlatTable while stashed
        self._stand_in: Optional[StashedRows] = None
        self._host: Optional[torch.Tensor] = None  # reused from stash to stash
        self._kept: Optional[torch.Tensor] = None
        self._shape: Tuple[int, int] = (0, 0)
        self._stashed_event = None          # the device-to-host copy has finished
        self._restored_event = None         # the host-to-device copy has finished
        self._forward = None                # the stream of the stashing forward
        self._journal: List[_JournaledWrite] = []
        self._parts: List[_Part] = []       # the group's tables while stashed
        self._warned = False
        #: how many times the rows went away / came back, how many of those returns an access
        #: other than a restore call caused, and how many row initializations waited for one
        #: (for tests and reports)
        self.stashes = 0
        self.restores = 0
        self.restores_on_access = 0
        self.replayed_inits = 0

    # -- state ---------------------------------------------------------------------------------
    @property
    def stashed(self) -> bool:
        return self._flat is not None

    @property
    def stashed_bytes(self) -> int:
        """Bytes of rows this table moves per stash (its host buffer's size)."""
        weights = self._flat.weights if self.stashed else self.tier.flat.weights
        rows = self._shape[0] if self.stashed else weights.shape[0]
        return rows * (self._cols[1] - self._cols[0]) * weights.element_size()

    def rows(self) -> torch.Tensor:
        """The rows' tensor, for inspection, without bringing the rows back (empty while
        stashed). Holding it across a training forward keeps the table from being stashed."""
        return self._flat.weights if self.stashed else self.tier.flat.weights

    def device_bytes(self) -> int:
        """Bytes the rows hold on the device right now (0 while stashed; the columns parked on
        the device meanwhile not included), read without bringing them back."""
        weights = self._flat.weights if self.stashed else self.tier.flat.weights
        return weights.untyped_storage().nbytes()

    @property
    def parked_bytes(self) -> int:
        """Bytes of the columns parked on the device while the rest is stashed (VALUES or
        OPTIMIZER_STATE)."""
        return 0 if self._kept is None else self._kept.numel() * self._kept.element_size()

    @property
    def host_buffer_bytes(self) -> int:
        """Host memory held for this table's stashes (kept between steps)."""
        return 0 if self._host is None else self._host.numel() * self._host.element_size()

    def _part(self, weights: torch.Tensor, cols: Tuple[int, int]) -> torch.Tensor:
        start, stop = cols
        return weights if (start, stop) == (0, weights.shape[1]) else weights[:, start:stop]

    # -- stash ---------------------------------------------------------------------------------
    def stash(self) -> bool:
        """Copy the stashed columns to host memory and release the rows' device storage.
        Returns False (and warns once) when something else holds that storage, e.g. a view
        of the rows kept across a training step: it would keep the memory and go stale, so
        the rows stay (a ``state_dict`` holds copies: it does not).

        Whether anything else holds it is known only once the table's own tensors have let
        go (:func:`_other_holders`); the rows are then put back as they were, and the copy
        made meanwhile is dropped."""
        if self.stashed:
            return True
        flat = self.tier.flat
        weights = flat.weights
        t = self._t
        d2h, _ = t.side_streams()
        forward = t.current_stream()
        t.wait_stream(d2h, forward)        # the lookup has read the rows
        for stream in self._extra:         # rows a prefetch wrote are in place
            t.wait_stream(d2h, stream)
        t.wait_event(d2h, self._restored_event)  # the last restore has read the host buffer
        self._copy_out(weights, d2h)
        stashed_event = t.record_event(d2h)
        # the block may serve another allocation only after the copy stream has passed the
        # event the allocator records there when the block is freed, i.e. after the copy
        t.record_stream(weights, d2h)
        shape = tuple(weights.shape)
        place = (weights.storage_offset(), shape, tuple(weights.stride()))
        parts = self._parts_of(weights)
        storage = weights.untyped_storage()
        released = weakref.ref(storage)
        t.release(weights)
        for part in parts:  # the tables' views of the group's rows go too
            if part.view:
                t.release(part.flat.weights)
        del storage
        others = _other_holders(released)
        if others:
            self._put_back(released(), weights, place, parts)
            self._kept = None
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"table {self.name!r}: other tensors besides the table view its rows (a "
                    f"view of its weights kept across a training step?), so its rows stay on "
                    f"the device this step instead of being stashed", RuntimeWarning,
                    stacklevel=3)
            return False
        self._stashed_event, self._shape, self._parts = stashed_event, shape, parts
        for part in parts:
            part.tier.flat = PartStashed(part, self)
        self._flat, self._forward = flat, forward
        self._stand_in = StashedRows(flat, self)
        self.tier.flat = self._stand_in
        self.stashes += 1
        return True

    def _copy_out(self, weights: torch.Tensor, d2h) -> None:
        """Enqueue the copy of the stashed columns to the host buffer, and of the kept ones
        to a compact device buffer (no view of the rows outlives it)."""
        t = self._t
        t.copy(self._host_buffer(weights), self._part(weights, self._cols), d2h)
        if self._keep is not None:
            keep = self._part(weights, self._keep)
            self._kept = t.device_buffer(keep.shape, weights.dtype, weights.device, d2h)
            t.copy(self._kept, keep, d2h)

    @staticmethod
    def _put_back(storage, weights: torch.Tensor, place, parts: List[_Part]) -> None:
        """Point the released tensors at ``storage`` again, as they were (``place``: the
        rows' offset, shape and stride in it)."""
        weights.set_(storage, *place)
        for part in parts:
            if part.view:
                part.flat.weights.set_(storage, part.offset, part.shape, part.stride)

    def _part_tiers(self) -> List:
        parts = getattr(self.tier, "parts", None)
        return [] if parts is None else parts()

    def _parts_of(self, weights: torch.Tensor) -> List[_Part]:
        """The record's parts, as they hold ``weights``."""
        parts = []
        for tier in self._part_tiers():
            view = tier.flat.weights
            parts.append(_Part(tier, tier.flat, view is not weights, view.storage_offset(),
                               tuple(view.shape), tuple(view.stride())))
        return parts

    def _host_buffer(self, weights: torch.Tensor) -> torch.Tensor:
        shape = (weights.shape[0], self._cols[1] - self._cols[0])
        if self._host is None or tuple(self._host.shape) != shape or \
                self._host.dtype != weights.dtype:
            self._host = None  # the old buffer goes before the new one is allocated
            self._host = self._t.host_buffer(shape, weights.dtype)
        return self._host

    # -- restore -------------------------------------------------------------------------------
    def restore(self, sync_event=None) -> None:
        """Bring the rows back (no-op when they are in place), replay the row
        initializations made meanwhile, and order the streams that use the rows after it.
        ``sync_event``: an event the copy must also wait for (TorchRec's threaded restore)."""
        if not self.stashed:
            return
        t = self._t
        flat, forward = self._flat, self._forward
        weights = flat.weights
        _, h2d = t.side_streams()
        t.reallocate(weights, self._shape, h2d)
        t.wait_event(h2d, sync_event)
        t.wait_event(h2d, self._stashed_event)  # the host buffer is complete
        t.copy(self._part(weights, self._cols), self._host, h2d)
        if self._kept is not None:
            t.copy(self._part(weights, self._keep), self._kept, h2d)
            t.record_stream(self._kept, h2d)
            self._kept = None
        self._restored_event = t.record_event(h2d)
        t.wait_event(forward, self._restored_event)
        storage = weights.untyped_storage()
        for part in self._parts:  # the tables' views see the rows again
            if part.view:
                part.flat.weights.set_(storage, part.offset, part.shape, part.stride)
            if isinstance(part.tier.flat, PartStashed):
                part.tier.flat = part.flat
        self._parts = []
        if self.tier.flat is self._stand_in:
            self.tier.flat = flat
        self._flat, self._stand_in = None, None
        journal, self._journal = self._journal, []
        with t.on(forward):
            for entry in journal:
                t.wait_event(forward, entry.ready)
                entry.replay(flat)
                for tensor in entry.tensors:
                    t.record_stream(tensor, forward)
        self.replayed_inits += len(journal)
        ready = t.record_event(forward)
        for stream in {t.current_stream(), *self._extra} - {forward, None}:
            t.wait_event(stream, ready)
        self.restores += 1

    def journal(self, replay: Callable[[object], None], tensors: Sequence[torch.Tensor]) -> None:
        """Record a row initialization made while the rows are away: ``replay(flat)`` makes it
        on the rows once they are back (``tensors``: what it reads)."""
        stream = self._t.current_stream()
        self._journal.append(_JournaledWrite(replay, tuple(tensors),
                                             self._t.record_event(stream), stream))

    def real_rows(self):
        """The tier's FlatTable with its rows in place (restoring them if away)."""
        flat = self._flat
        if flat is None:
            return self.tier.flat
        self.restores_on_access += 1
        self.restore()
        return flat


class StashedRows:
    """Stands in for a tier's :class:`~dynemb.rows.flat_table.FlatTable` while its rows are
    stashed: see the module docstring for what it answers, records or restores."""

    def __init__(self, flat, stash: TableStash):
        object.__setattr__(self, "_flat", flat)
        object.__setattr__(self, "_stash", stash)

    @property
    def capacity(self) -> int:
        return self._stash._shape[0]

    @property
    def device(self) -> torch.device:
        return self._flat.weights.device

    @property
    def stands_in_for(self):
        """The flat table whose rows are away (read without bringing them back)."""
        return self._flat

    def initialize_where(self, slots, keys, mask, initializer, *, seed, table_id) -> None:
        self._stash.journal(lambda flat: flat.initialize_where(
            slots, keys, mask, initializer, seed=seed, table_id=table_id), (slots, keys, mask))

    def write_new_rows(self, write, tensors) -> None:
        """A table group's initialization of new rows (see
        :class:`~dynemb.tables.group_storage.GroupFlat`), made once the rows are back."""
        self._stash.journal(write, tensors)

    def __getattr__(self, name):
        if name in _SHAPE_ONLY:
            return getattr(self._flat, name)
        return getattr(self._stash.real_rows(), name)

    def __setattr__(self, name, value):
        setattr(self._stash.real_rows(), name, value)

    def __repr__(self) -> str:
        return f"StashedRows({self._stash.name!r}, {self.capacity} rows away)"


class PartStashed(StashedRows):
    """Stands in for the flat table of a table of a group while the group's rows are
    stashed: its sizes answer as they were, an ``initialize_where`` is recorded and made
    once the rows are back, anything else brings the group's rows back first."""

    def __init__(self, part: _Part, stash: TableStash):
        super().__init__(part.flat, stash)
        object.__setattr__(self, "_rows", part.shape[0])

    @property
    def capacity(self) -> int:
        return self._rows

    def initialize_where(self, slots, keys, mask, initializer, *, seed, table_id) -> None:
        flat = self._flat
        self._stash.journal(lambda _: flat.initialize_where(
            slots, keys, mask, initializer, seed=seed, table_id=table_id), (slots, keys, mask))

    def __getattr__(self, name):
        if name in _SHAPE_ONLY:
            return getattr(self._flat, name)
        self._stash.real_rows()
        return getattr(self._flat, name)

    def __setattr__(self, name, value):
        self._stash.real_rows()
        setattr(self._flat, name, value)

    def __repr__(self) -> str:
        return f"PartStashed({self._stash.name!r}, {self.capacity} rows away)"
