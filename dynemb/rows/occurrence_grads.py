"""``OccurrenceGrads``: the gradients of a lookup's occurrences, handed to the fused optimizer
kernels with a CSR of the occurrences of each row (the kernels sum them per row)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dynemb.backends.numba_backends import resolve_kernels
from dynemb.backends.protocol import KernelBackend


@dataclass(frozen=True)
class OccurrenceGrads:
    """The gradients of a lookup's occurrences, summed per row inside the optimizer kernel.

    Row ``i``'s gradient is the sum over ``k`` in ``offsets[i]:offsets[i + 1]`` of
    ``src[order[k]]``, each clamped to ``[-clip, clip]`` (when ``clip`` is set) and times
    ``scale[k]`` (when ``scale`` is set). So backward hands the kernel the output gradients
    [N, dim] and a CSR of the occurrences of each row, never a summed ``[rows, dim]`` tensor.

    Example::

        >>> g = OccurrenceGrads.from_inverse(torch.tensor([[1.0], [2.0], [4.0]]),
        ...                                  torch.tensor([1, 0, 1]), 2)
        >>> g.offsets.tolist(), g.order.tolist()
        ([0, 1, 3], [1, 0, 2])
        >>> g.dense().flatten().tolist()  # row 0: 2.0; row 1: 1.0 + 4.0
        [2.0, 5.0]
    """

    src: torch.Tensor
    offsets: torch.Tensor
    order: torch.Tensor
    scale: Optional[torch.Tensor] = None
    clip: Optional[float] = None

    @classmethod
    def from_inverse(cls, src: torch.Tensor, inverse: torch.Tensor, num_rows: int, *,
                     scale: Optional[torch.Tensor] = None, clip: Optional[float] = None,
                     kernels: Optional[KernelBackend] = None) -> "OccurrenceGrads":
        """Occurrence ``i`` (``src[i]``, ``scale[i]``) belongs to row ``inverse[i]`` of
        ``num_rows`` (``kernels``: those of the owning table, see :func:`occurrence_csr`).
        No host sync on CUDA."""
        offsets, order = occurrence_csr(inverse, num_rows, kernels=kernels)
        return cls(src.to(torch.float32).contiguous(), offsets, order,
                   None if scale is None else scale.to(torch.float32)[order].contiguous(), clip)

    @classmethod
    def of_rows(cls, grads: torch.Tensor) -> "OccurrenceGrads":
        """One occurrence per row: ``grads`` [U, dim] is each row's gradient."""
        rows = torch.arange(grads.shape[0] + 1, dtype=torch.int64, device=grads.device)
        return cls(grads.to(torch.float32).contiguous(), rows, rows[:-1])

    @property
    def num_rows(self) -> int:
        return self.offsets.numel() - 1

    def dense(self) -> torch.Tensor:
        """The summed gradient of every row, [rows, dim] (for tests and reference paths)."""
        g = self.src.index_select(0, self.order)
        if self.clip is not None:
            g = g.clamp(-self.clip, self.clip)
        if self.scale is not None:
            g = g * self.scale.unsqueeze(1)
        rows = torch.repeat_interleave(torch.arange(self.num_rows, device=g.device),
                                       self.offsets.diff())
        return torch.zeros(self.num_rows, g.shape[1], device=g.device).index_add_(0, rows, g)

    def kernel_args(self):
        """(src, offsets, order, scale, clip) as the backends' ``fused_update`` takes them."""
        scale = (self.scale if self.scale is not None else
                 torch.empty(0, dtype=torch.float32, device=self.src.device))
        return (self.src, self.offsets, self.order, scale,
                -1.0 if self.clip is None else float(self.clip))


def occurrence_csr(inverse: torch.Tensor, num_rows: int, *,
                   kernels: Optional[KernelBackend] = None):
    """(offsets [num_rows + 1], order [N]) int64: ``order[offsets[u]:offsets[u + 1]]`` are the
    positions ``i`` with ``inverse[i] == u``, in input order, by ``kernels`` (those of the
    tensor's device when None: a numba counting sort on CPU; a stable sort and a cumulative
    sum on CUDA, no host sync)."""
    return resolve_kernels(inverse.device, kernels=kernels).occurrence_csr(inverse, num_rows)
