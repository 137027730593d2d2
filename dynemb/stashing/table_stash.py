"""``TableStash``: the device rows of a table, or of a table group, moved to host memory and
back.

A table's device rows are one tensor ``[capacity, width]`` (embedding columns, then optimizer
state; :class:`~dynemb.rows.flat_table.RowLayout`): its tier's ``flat.weights``. A table group
(:mod:`dynemb.tables.groups`) keeps its tables' rows in one tensor, its record's ``weights``
(:class:`~dynemb.tables.group_storage.GroupStorage`), each table's flat table a view of its
part; the group's rows go and come back as one. :meth:`TableStash.stash` copies the columns
its :class:`~dynemb.options.StashMode` names to a host buffer (columns kept on the device are
parked in a compact device buffer first) and releases the storage of that tensor and of every
table's view of it: each tensor keeps its identity and becomes empty (``[0, width]``), so no
byte stays. :meth:`TableStash.restore` gives the tensor new memory, copies everything back and
points the views at it again. The hash table (keys, scores, pins) never moves.

Nothing stands in for the rows while they are away, and the tables do not know they are:

- whoever reads or moves rows brings them back first. The module (:mod:`dynemb.modules`)
  does, through :class:`~dynemb.stashing.collection_stash.CollectionStash`: before an eval
  forward, the next training lookup, ``read_rows``, ``state_dict``, a load, ``flush``, a
  regroup, and (``rows_in_place``) the services that read a module's tables; before a
  training prefetch, for the tables whose prefetch reads or moves rows (a CACHE table's
  write-backs and loads, a table that can grow);
- the training prefetch of the other tables claims slots in the hash table and initializes
  the new rows. The group's record and the flat tables hold such initializations while their
  tensor is empty (:meth:`GroupStorage.write_new_rows
  <dynemb.tables.group_storage.GroupStorage.write_new_rows>`,
  :meth:`FlatTable.initialize_where <dynemb.rows.flat_table.FlatTable.initialize_where>`),
  and the restore makes them right after the rows are back (``take_held_writes``). Those
  rows are in unpinned slots, disjoint from the slots of the lookup awaiting its backward
  (pinned), so making them before that backward's update gives the rows an unstashed run
  has.

Rows are released only where nothing else holds their memory (a view kept across a step, a
numpy array of them): the stash lets go and sees whether the storage is still alive
(:func:`_other_holders`, a weak reference; nothing is counted). A reference to the table's
own tensor is no holder: the tensor is the table's, empty while away, refilled after.

CUDA ordering (see :class:`~dynemb.stashing.transfers.CudaTransfers`; no host waits):

- stash: the device-to-host stream waits for the forward stream (the lookup's reads) and the
  prefetch stream (rows it wrote), and for the last restore's copy (it read the host buffer),
  then copies; ``record_stream(d2h)`` before the storage is dropped makes the caching
  allocator hold the freed block until an event it records on the copy stream at the free
  has completed, i.e. until the copy has read all of it: no allocation can reuse the block
  earlier;
- restore: the rows' new block comes from the host-to-device stream's pool (so it waits
  for nobody's earlier work), the copy waits for the stash's event (the host buffer is
  complete), then the forward stream waits for the copy's event, and for the streams that
  made what the held initializations read, before it makes them; the current and prefetch
  streams wait for all of it.
"""
from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from dynemb.rows.flat_table import RowLayout
from dynemb.options import StashMode


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
class _View:
    """A table's flat table whose tensor views the stashed rows, and where it lay in them (to
    point it at the rows again when they are back)."""

    flat: object
    offset: int
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]


def _rows_of(rows) -> Tuple[torch.Tensor, List[object], List[object]]:
    """``(the rows tensor, the flat tables on it, the record)`` of a group's record (one
    tensor for all its tables, each table's flat table on its part) or of a table's tier."""
    if hasattr(rows, "tier_of"):
        return rows.weights, [rows.tier_of(table).flat for table in rows.tables], [rows]
    return rows.flat.weights, [rows.flat], []


class TableStash:
    """The stash of one table's device tier, or of a table group's rows (built by
    :class:`~dynemb.stashing.CollectionStash`).

    Args:
        name: the table (or the group's tables), for messages.
        tier: where the rows live: a table's device :class:`~dynemb.tables.tier.Tier`, or a
            table group's :class:`~dynemb.tables.group_storage.GroupStorage` (one tensor for
            all its tables, each table's flat table a view of its part).
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
        >>> tier.flat.weights.shape, tier.hash.capacity  # the same tensor, empty; the keys stay
        (torch.Size([0, 4]), 128)
        >>> stash.restore()
        >>> float(tier.flat.weights.sum()), stash.rows() is tier.flat.weights
        (768.0, True)
    """

    def __init__(self, name: str, tier, mode: StashMode, row: RowLayout, transfers,
                 extra_streams: Sequence = ()):
        self.name = name
        self.tier = tier
        self.mode = mode
        self._cols, self._keep = stashed_columns(mode, row)
        self._t = transfers
        self._extra = [s for s in extra_streams if s is not None]
        self._away: Optional[torch.Tensor] = None  # the released rows tensor while stashed
        self._views: List[_View] = []       # the tables' views of it, released too
        self._host: Optional[torch.Tensor] = None  # reused from stash to stash
        self._kept: Optional[torch.Tensor] = None
        self._shape: Tuple[int, int] = (0, 0)
        self._stashed_event = None          # the device-to-host copy has finished
        self._restored_event = None         # the host-to-device copy has finished
        self._forward = None                # the stream of the stashing forward
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
        return self._away is not None

    @property
    def stashed_bytes(self) -> int:
        """Bytes of rows this table moves per stash (its host buffer's size)."""
        weights = self.rows()
        rows = self._shape[0] if self.stashed else weights.shape[0]
        return rows * (self._cols[1] - self._cols[0]) * weights.element_size()

    def rows(self) -> torch.Tensor:
        """The rows' tensor, for inspection (empty while stashed: the same tensor). Holding a
        view of it across a training forward keeps the table from being stashed."""
        return self._away if self.stashed else _rows_of(self.tier)[0]

    def device_bytes(self) -> int:
        """Bytes the rows hold on the device right now (0 while stashed; the columns parked on
        the device meanwhile not included)."""
        return self.rows().untyped_storage().nbytes()

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
        weights, flats, _ = _rows_of(self.tier)
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
        place = (weights.storage_offset(), tuple(weights.shape), tuple(weights.stride()))
        views = [_View(flat, flat.weights.storage_offset(), tuple(flat.weights.shape),
                       tuple(flat.weights.stride()))
                 for flat in flats if flat.weights is not weights]
        storage = weights.untyped_storage()
        released = weakref.ref(storage)
        t.release(weights)
        for view in views:  # the tables' views of the group's rows go too
            t.release(view.flat.weights)
        del storage
        if _other_holders(released):
            self._put_back(released(), weights, place, views)
            self._kept = None
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"table {self.name!r}: other tensors besides the table view its rows (a "
                    f"view of its weights kept across a training step?), so its rows stay on "
                    f"the device this step instead of being stashed", RuntimeWarning,
                    stacklevel=3)
            return False
        self._away, self._views, self._shape = weights, views, place[1]
        self._stashed_event, self._forward = stashed_event, forward
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
    def _put_back(storage, weights: torch.Tensor, place, views: List[_View]) -> None:
        """Point the released tensors at ``storage`` again, as they were (``place``: the
        rows' offset, shape and stride in it)."""
        weights.set_(storage, *place)
        for view in views:
            view.flat.weights.set_(storage, view.offset, view.shape, view.stride)

    def _host_buffer(self, weights: torch.Tensor) -> torch.Tensor:
        shape = (weights.shape[0], self._cols[1] - self._cols[0])
        if self._host is None or tuple(self._host.shape) != shape or \
                self._host.dtype != weights.dtype:
            self._host = None  # the old buffer goes before the new one is allocated
            self._host = self._t.host_buffer(shape, weights.dtype)
        return self._host

    # -- restore -------------------------------------------------------------------------------
    def restore(self, sync_event=None, *, on_access: bool = False) -> None:
        """Bring the rows back (no-op when they are in place), make the row initializations
        held meanwhile, and order the streams that use the rows after it. ``sync_event``: an
        event the copy must also wait for (TorchRec's threaded restore); ``on_access``: an
        access to the rows, not a restore call, asks (counted in ``restores_on_access``)."""
        if not self.stashed:
            return
        t = self._t
        weights, forward = self._away, self._forward
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
        for view in self._views:  # the tables' views see the rows again
            view.flat.weights.set_(storage, view.offset, view.shape, view.stride)
        self._away, self._views = None, []
        self._write_held(forward)
        ready = t.record_event(forward)
        for stream in {t.current_stream(), *self._extra} - {forward, None}:
            t.wait_event(stream, ready)
        self.restores += 1
        self.restores_on_access += on_access

    def _write_held(self, forward) -> None:
        """Make, on the forward stream, the row initializations the record and the flat
        tables held while the rows were away, in the order they came."""
        _, flats, record = _rows_of(self.tier)
        held = [(source, write, tensors) for source in record + flats
                for write, tensors in source.take_held_writes()]
        if not held:
            return
        t = self._t
        # what the initializations read was made on the prefetch (or current) stream
        makers = {t.current_stream(), *self._extra} - {forward, None}
        with t.on(forward):
            for stream in makers:
                t.wait_stream(forward, stream)
            for source, write, tensors in held:
                write(source)
                for tensor in tensors:
                    t.record_stream(tensor, forward)
        self.replayed_inits += len(held)
