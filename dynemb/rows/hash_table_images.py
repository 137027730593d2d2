"""Images of a hash table's slot arrays: functions over the
:class:`~dynemb.backends.protocol.TableArrays` a
:class:`~dynemb.rows.hash_table.ScoredHashTable` keeps (its explicit storage record). What a
checkpoint saves of them (:func:`arrays_image`) and how it goes back in
(:func:`load_arrays_image`), the move into other storage (a table group's views, see
:mod:`dynemb.tables.groups`) and the reset to empty. The table calls them on its own arrays
and keeps its clock and undo state itself. Also what a table and a table group share for
growth remaps and restored scores."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from dynemb.backends.protocol import TableArrays
from dynemb.types import EMPTY_KEY, TOMBSTONE_KEY, ScorePolicy, pack_lfu_lru, unpack_lfu_lru


def arrays_image(arrays: TableArrays) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(keys, scores)`` of ``arrays`` (views, not copies): slot ``s`` holds ``keys[s]``
    (``EMPTY_KEY`` / ``TOMBSTONE_KEY`` when free) with ``scores[s]``."""
    return arrays.keys, arrays.scores


def move_arrays(current: TableArrays, storage: TableArrays) -> TableArrays:
    """Copy keys, scores, pins and size of ``current`` into ``storage`` (of the same capacity
    and bucket size, e.g. views of a table group's arrays) and return ``storage``. Storage of
    another shape raises ``ValueError`` and nothing is copied."""
    if (storage.capacity, storage.bucket_size) != (current.capacity, current.bucket_size):
        raise ValueError(f"storage of {storage.capacity} slots in buckets of "
                         f"{storage.bucket_size} cannot hold a table of {current.capacity} in "
                         f"buckets of {current.bucket_size}")
    for new, now in zip(storage[:4], current[:4]):
        if new.data_ptr() != now.data_ptr():
            new.copy_(now)
    return storage


def load_arrays_image(arrays: TableArrays, keys: torch.Tensor, scores: torch.Tensor) -> None:
    """Make ``arrays`` hold exactly the image ``(keys, scores)`` (:func:`arrays_image` of
    arrays of the same capacity): every key in its saved slot with its score, no pins, the
    size recounted. A ``keys`` or ``scores`` not int64 of one entry per slot raises
    ``ValueError`` and ``arrays`` stay as they were."""
    capacity = arrays.capacity
    for name, t in (("keys", keys), ("scores", scores)):
        if t.dtype != torch.int64 or t.shape != (capacity,):
            raise ValueError(f"{name} must be int64 of shape [{capacity}] (one entry "
                             f"per slot), got {t.dtype} {tuple(t.shape)}")
    if keys.data_ptr() != arrays.keys.data_ptr():
        arrays.keys.copy_(keys)
    if scores.data_ptr() != arrays.scores.data_ptr():
        arrays.scores.copy_(scores)
    arrays.refcnt.zero_()
    arrays.size.copy_(((arrays.keys != EMPTY_KEY) & (arrays.keys != TOMBSTONE_KEY)).sum())


def empty_arrays(arrays: TableArrays) -> None:
    """Free every slot of ``arrays`` in place: no key, score 0, no pin, size 0."""
    arrays.keys.fill_(EMPTY_KEY)
    arrays.scores.zero_()
    arrays.refcnt.zero_()
    arrays.size.zero_()


def compose_remaps(first: Optional[torch.Tensor], then: torch.Tensor) -> torch.Tensor:
    """Remap of two successive growths (``first`` may be None)."""
    if first is None:
        return then
    out = first.clone()
    live = first >= 0
    out[live] = then[first[live]]
    return out


def restore_scores_at(table_scores: torch.Tensor, policy: ScorePolicy, slots: torch.Tensor,
                      scores: torch.Tensor) -> None:
    """:meth:`~dynemb.rows.hash_table.ScoredHashTable.restore_scores` on a score array
    ``table_scores`` (a table's, or a table group's holding several tables of one
    ``policy``), unchecked."""
    if policy is ScorePolicy.LFU:
        table_scores.index_add_(0, slots, scores)
    elif policy is ScorePolicy.LFU_LRU:  # counts add up, the new last use stays
        counts, clocks = unpack_lfu_lru(table_scores[slots])
        table_scores.index_copy_(0, slots, pack_lfu_lru(counts + unpack_lfu_lru(scores)[0],
                                                        clocks))
    elif policy is ScorePolicy.STEP:
        table_scores.index_copy_(0, slots, scores)
