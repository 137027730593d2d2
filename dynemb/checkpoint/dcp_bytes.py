"""``SavedAsBytes``: a tensor that ``torch.distributed.checkpoint`` saves as one byte item.

A table share's per-entry tensors (``keys``, ``scores``, ``slots``, ``rows``,
``tombstones``; see :mod:`dynemb.checkpoint.table_state`) hold as many items as the tier
has live entries (or erased slots), a number the module that loads them cannot know (a
fresh one holds none). DCP's default planner takes a saved *tensor*'s size from the module
it loads into and stops on any other (``Size mismatch between saved ... and current``),
and it refuses at save time a tensor whose chunks do not cover its whole shape, so a tensor
cannot be shaped as the capacity and hold only the entries. A *byte item* has no size: DCP
saves it with ``torch.save`` and its default planner loads it by putting what
``torch.load`` gives back in the state dict, in place of the module's entry. So these
tensors are saved as byte items, holding the entries alone, and load in place with DCP's
default planner whatever the module holds.

Everything else sees a plain tensor: operations on it give plain tensors (but its copies,
see :class:`SavedAsBytes`), ``torch.save`` pickles it as one (``torch.load`` with
``weights_only=True`` needs nothing of dynemb), and so does DCP inside its byte item.

Example::

    >>> t = SavedAsBytes.of(torch.tensor([7, 3]))
    >>> t.shape, (t + 1).tolist(), type(t + 1).__name__, type(t.clone()).__name__
    (torch.Size([2]), [8, 4], 'Tensor', 'SavedAsBytes')
    >>> [item.type.name for item in t.__create_write_items__("k", t)]
    ['BYTE_IO']
"""
from __future__ import annotations

import copy
from typing import Any, List

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType


class SavedAsBytes(torch.Tensor):
    """A plain tensor but for how DCP saves it (see the module docstring). A copy of it
    (``clone``, ``detach``, ``to``, ``cpu``, ``contiguous``, as a user copying a state dict
    makes, and ``new_empty``, the tensor torch's default ``async_save`` stager fills with
    its copy) is one too; anything else computed from it is a plain tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs)
        return out if func in _COPIES else _plain(out)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "SavedAsBytes":
        """``tensor`` (its storage, not a copy), saved by DCP as a byte item."""
        return tensor.as_subclass(cls)

    def plain(self) -> torch.Tensor:
        """The same tensor as a ``torch.Tensor``."""
        return self.as_subclass(torch.Tensor)

    def __reduce_ex__(self, protocol):
        return self.plain().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return SavedAsBytes.of(copy.deepcopy(self.plain(), memo))

    # -- torch.distributed.checkpoint ---------------------------------------------------------
    def __create_write_items__(self, fqn: str, obj: Any) -> List[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """What DCP saves (``torch.save``) for the byte item: the plain tensor."""
        return self.plain()


def _plain(value):
    """``value`` with every :class:`SavedAsBytes` in it (in tuples and lists) plain."""
    if isinstance(value, SavedAsBytes):
        return value.plain()
    if isinstance(value, (tuple, list)):
        return type(value)(_plain(v) for v in value)
    return value


#: What makes a copy of the same entries (which stays a :class:`SavedAsBytes`).
_COPIES = frozenset({torch.Tensor.clone, torch.clone, torch.Tensor.detach, torch.Tensor.to,
                     torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.contiguous,
                     torch.Tensor.pin_memory, torch.Tensor.new_empty})
