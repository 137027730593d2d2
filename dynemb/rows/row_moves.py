"""Moving whole rows between flat tables: CPU tables through numba kernels that copy each row
once (``kernels/rows_cpu.py``), other devices through torch indexing.

Example::

    >>> src, dst = torch.arange(12.0).view(4, 3), torch.zeros(2, 3)
    >>> copy_rows(src, torch.tensor([3, -1]), dst, torch.tensor([0, 1]))
    >>> dst.tolist()
    [[9.0, 10.0, 11.0], [0.0, 0.0, 0.0]]
    >>> remap_rows(src, torch.tensor([1, -1, 0, -1]), 3).tolist()
    [[6.0, 7.0, 8.0], [0.0, 1.0, 2.0], [0.0, 0.0, 0.0]]
"""
from __future__ import annotations

import torch

from dynemb.kernels import rows_cpu

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(rows: torch.Tensor):
    """The rows' bytes as a numpy array of same-size integers (no copy; bfloat16 included)."""
    return rows.view(_BITS[rows.element_size()]).numpy()


def copy_rows(src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor,
              dst_slots: torch.Tensor) -> None:
    """``dst[dst_slots[i]] = src[src_slots[i]]`` wherever both slots are >= 0; ``src`` and
    ``dst`` are [rows, width] tables of one dtype and width, ``dst_slots`` distinct. Slots
    come from the tables' own hash tables and are not range-checked (hot path)."""
    if src.dtype != dst.dtype or src.shape[1] != dst.shape[1]:
        raise ValueError(f"copy_rows needs tables of one dtype and width, got {src.dtype} "
                         f"[*, {src.shape[1]}] and {dst.dtype} [*, {dst.shape[1]}]")
    if src_slots.shape != dst_slots.shape:
        raise ValueError(f"src_slots {tuple(src_slots.shape)} and dst_slots "
                         f"{tuple(dst_slots.shape)} differ in shape")
    if src.device.type == "cpu" and dst.device.type == "cpu" and src.is_contiguous() and (
            dst.is_contiguous()):
        rows_cpu.copy_rows_cpu(_bits(src), src_slots.contiguous().numpy(), _bits(dst),
                               dst_slots.contiguous().numpy())
        return
    both = (src_slots >= 0) & (dst_slots >= 0)
    dst.index_copy_(0, dst_slots[both], src.index_select(0, src_slots[both]).to(dst.device))


def remap_rows(old: torch.Tensor, remap: torch.Tensor, new_capacity: int) -> torch.Tensor:
    """A new [new_capacity, width] table: row ``s`` of ``old`` at ``remap[s]`` (when >= 0,
    targets distinct), zeros elsewhere."""
    if old.device.type == "cpu" and old.is_contiguous():
        new = torch.empty(new_capacity, old.shape[1], dtype=old.dtype)
        rows_cpu.remap_rows_cpu(_bits(old), remap.contiguous().numpy(), _bits(new))
        return new
    new = torch.zeros(new_capacity, old.shape[1], dtype=old.dtype, device=old.device)
    live = remap >= 0
    new[remap[live]] = old[live]
    return new
