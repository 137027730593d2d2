"""``PrefetchState``: what ``prefetch`` resolved for one batch, waiting for ``forward``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb.bridges.device_assert import assert_on_device
from dynemb.options import StorageMode
from dynemb.tables import TableBatch
from dynemb.tables.lookup_batch import LookupBatch


@dataclass
class PrefetchState:
    """One prefetched batch: per table, its batch (a
    :class:`~dynemb.tables.lookup_batch.LookupBatch`: the tables of a group share one, a
    table alone has its own), plus how to cut the table's rows back into features.

    ``values`` are the input ids (forward checks its input against them). ``features`` lists,
    per table, ``(feature name, number of values)`` in the order the
    table's keys were concatenated. ``ready`` is the CUDA event recorded on the prefetch
    stream (None on CPU); forward waits on it before reading the slots.
    """

    batches: Dict[str, LookupBatch]
    features: Dict[str, List[Tuple[str, int]]]
    feature_order: Tuple[str, ...]
    training: bool
    ready: Optional[torch.cuda.Event] = None
    lengths: Dict[str, torch.Tensor] = field(default_factory=dict)
    values: Optional[torch.Tensor] = None  # the input ids, to match forward's input
    all_lengths: Optional[torch.Tensor] = None  # the input lengths, likewise

    @property
    def table_names(self) -> List[str]:
        return list(self.batches)

    @property
    def table_ids(self) -> Dict[str, int]:
        """Position of each table in the collection's table list."""
        return {name: i for i, name in enumerate(self.batches)}

    @property
    def storage_modes(self) -> Dict[str, StorageMode]:
        return {name: b.mode for name, b in self.batches.items()}

    @property
    def unique_keys(self) -> Dict[str, torch.Tensor]:
        return {name: self.table_batch(name).keys for name in self.batches}

    @property
    def slots(self) -> Dict[str, Optional[torch.Tensor]]:
        return {name: self.table_batch(name).slots for name in self.batches}

    def table_batch(self, name: str) -> TableBatch:
        """Table ``name``'s part of the batch, as a :class:`TableBatch` of its own (a
        grouped table's is a copy, see :meth:`dynemb.tables.groups.GroupBatch.member`)."""
        return self.batches[name].member(name)

    def distinct_batches(self) -> List[LookupBatch]:
        """Each batch once, in the order of its first table."""
        return list({id(batch): batch for batch in self.batches.values()}.values())


_IN_ORDER = ("call forward in the order of prefetch (training and eval prefetches each in their "
             "own order), with the KeyedJaggedTensor given to it (nothing changed; "
             "clear_prefetched() drops the queued batches)")


def check_state_matches(state: PrefetchState, kjt: KeyedJaggedTensor, *,
                        sync_free: bool = False) -> None:
    """Raise ``ValueError`` unless ``kjt`` is the batch ``state`` was prefetched for: the same
    features in the same order, the same ids and the same lengths. Nothing is changed.

    ``sync_free``: on CUDA, compare on the device (a mismatch surfaces at the next sync)
    instead of reading the comparison on the host."""
    oldest = f"the oldest batch prefetched in {'training' if state.training else 'eval'} mode"
    if tuple(kjt.keys()) != state.feature_order:
        raise ValueError(f"forward got features {list(kjt.keys())} but {oldest} has "
                         f"{list(state.feature_order)}; {_IN_ORDER}")
    expected = state.values.numel()
    values = kjt.values()
    if values.numel() != expected or not _same(values, state.values, sync_free):
        raise ValueError(f"forward got other ids ({values.numel()}) than {oldest} "
                         f"({expected}); {_IN_ORDER}")
    lengths = kjt.lengths()
    if (lengths.shape != state.all_lengths.shape
            or not _same(lengths, state.all_lengths, sync_free)):
        raise ValueError(f"forward got the ids of {oldest} but other lengths; {_IN_ORDER}")


def _same(got: torch.Tensor, expected: torch.Tensor, sync_free: bool) -> bool:
    """Equal tensors of equal shape; on CUDA with ``sync_free``, asserted on the device."""
    if got is expected:
        return True
    if not sync_free or got.device.type != "cuda":
        return torch.equal(got, expected.to(got.device))
    assert_on_device((got == expected).all(),
                     "forward got other ids or lengths than the oldest prefetched batch")
    return True


def prefetch_on_stream(run: Callable[[], PrefetchState], kjt: KeyedJaggedTensor,
                       stream: torch.cuda.Stream, device: torch.device,
                       forward_stream: Optional[torch.cuda.Stream]) -> PrefetchState:
    """``run()`` (a collection's prefetch of ``kjt``) on the side ``stream``, after the
    current stream and ``forward_stream``; the state's ``ready`` event marks its end."""
    # the input is ready on the calling stream (TorchRec's prefetch pipeline calls from its
    # own); table updates of earlier steps run on the forward stream
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)
    if forward_stream is not None and forward_stream != current:
        stream.wait_stream(forward_stream)
    with torch.cuda.stream(stream):
        state = run()
        state.ready = torch.cuda.Event()
        state.ready.record(stream)
    for tensor in kjt.values(), kjt.lengths():
        tensor.record_stream(stream)
    return state
