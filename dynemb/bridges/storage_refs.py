"""How many tensors share a tensor's storage, from torch's use count of the storage, and
whether a view keeps the tensor it was sliced from alive.

Relies on ``torch._C._storage_Use_Count(storage._cdata)`` (the reference count of the C++
storage): a stashed table frees its rows' storage only when nothing else holds it, and a view
of the rows (``weights[:10]``) is a second tensor on that storage which Python's reference
counts do not see. Where torch has no such count, views are not counted (0). And on a view's
``_base``: a view sliced from a tensor holds a reference to it (one Python reference more),
a view that only shares its storage (as ``torch.load`` rebuilds views) does not.
"""
from __future__ import annotations

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def can_count_views() -> bool:
    """True when this torch tells how many tensors use a storage."""
    return _use_count is not None


def other_views(tensor: torch.Tensor) -> int:
    """Tensors besides ``tensor`` on its storage (views of it, or it of them); 0 when torch
    cannot tell (:func:`can_count_views`).

    Example::

        >>> rows = torch.zeros(4, 2)
        >>> other_views(rows)
        0
        >>> first = rows[:1]
        >>> other_views(rows)
        1
    """
    if _use_count is None:
        return 0
    storage = tensor.untyped_storage()
    # the tensor and the storage object made here hold two references to the storage
    return max(0, _use_count(storage._cdata) - 2)


def sliced_from(view: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether ``view`` was sliced from ``tensor`` (its ``_base``), so that torch keeps
    ``tensor`` alive from it.

    Example::

        >>> rows = torch.zeros(4, 2)
        >>> sliced_from(rows[:1], rows), sliced_from(torch.zeros(1, 2), rows)
        (True, False)
    """
    return view._base is tensor
