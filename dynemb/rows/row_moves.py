"""Moving whole rows between flat tables: tables on one device by that device's backend
(on CPU, numba kernels that copy each row once), tables on two devices through torch indexing.

Example::

    >>> src, dst = torch.arange(12.0).view(4, 3), torch.zeros(2, 3)
    >>> copy_rows(src, torch.tensor([3, -1]), dst, torch.tensor([0, 1]))
    >>> dst.tolist()
    [[9.0, 10.0, 11.0], [0.0, 0.0, 0.0]]
    >>> remap_rows(src, torch.tensor([1, -1, 0, -1]), 3).tolist()
    [[6.0, 7.0, 8.0], [0.0, 1.0, 2.0], [0.0, 0.0, 0.0]]
"""
from __future__ import annotations

from typing import Optional

import torch

from dynemb.backends.numba_backends import resolve_kernels
from dynemb.backends.protocol import KernelBackend


def copy_rows(src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor,
              dst_slots: torch.Tensor, *, kernels: Optional[KernelBackend] = None) -> None:
    """``dst[dst_slots[i]] = src[src_slots[i]]`` wherever both slots are >= 0; ``src`` and
    ``dst`` are [rows, width] tables of one dtype and width, ``dst_slots`` distinct. Slots
    come from the tables' own hash tables and are not range-checked (hot path). ``kernels``
    (those of the tables' device when None) copy between tables of one device."""
    if src.dtype != dst.dtype or src.shape[1] != dst.shape[1]:
        raise ValueError(f"copy_rows needs tables of one dtype and width, got {src.dtype} "
                         f"[*, {src.shape[1]}] and {dst.dtype} [*, {dst.shape[1]}]")
    if src_slots.shape != dst_slots.shape:
        raise ValueError(f"src_slots {tuple(src_slots.shape)} and dst_slots "
                         f"{tuple(dst_slots.shape)} differ in shape")
    if src.device == dst.device and src.is_contiguous() and dst.is_contiguous():
        resolve_kernels(dst.device, kernels=kernels).copy_rows(src, src_slots, dst, dst_slots)
        return
    both = (src_slots >= 0) & (dst_slots >= 0)
    dst.index_copy_(0, dst_slots[both], src.index_select(0, src_slots[both]).to(dst.device))


def remap_rows(old: torch.Tensor, remap: torch.Tensor, new_capacity: int, *,
               kernels: Optional[KernelBackend] = None) -> torch.Tensor:
    """A new [new_capacity, width] table: row ``s`` of ``old`` at ``remap[s]`` (when >= 0,
    targets distinct), zeros elsewhere; by ``kernels`` (those of ``old``'s device when
    None)."""
    return resolve_kernels(old.device, kernels=kernels).remap_rows(old.contiguous(), remap,
                                                                   new_capacity)
