"""How the CUDA fused update cuts a hot row (one of many occurrences) into pieces, each
summed by its own warp (``kernels/optim_cuda.py``): the layout, in torch ops."""
from __future__ import annotations

import torch


def hot_row_pieces(offsets: torch.Tensor, occurrences: int, piece: int):
    """How the CUDA update kernel cuts rows of more than ``piece`` occurrences (the CSR
    ``offsets`` [R + 1] of ``occurrences`` ids) into pieces of ``piece``, each summed by its
    own warp. Returns ``(piece_row [P], piece_end [R], piece_count [R])`` int64: per row, its
    number of pieces (0 for a row of at most ``piece``) and where they end in the pieces'
    buffer; per piece, its row (``>= R`` for the padding). ``P`` is the bound ``2 N / piece
    + 1`` (a row of ``c > piece`` occurrences has ``ceil(c / piece) < 2 c / piece`` pieces),
    so nothing is read back. Torch ops only; with no row able to pass ``piece``, no piece.

    >>> hot_row_pieces(torch.tensor([0, 3, 10, 11]), 11, 3)[1:]   # rows of 3, 7, 1 ids
    (tensor([0, 3, 3]), tensor([0, 3, 0]))
    """
    rows, device = offsets.numel() - 1, offsets.device
    if occurrences <= piece:
        none = torch.zeros(rows, dtype=torch.int64, device=device)
        return torch.empty(0, dtype=torch.int64, device=device), none, none
    counts = offsets[1:] - offsets[:-1]
    piece_count = torch.where(counts > piece, (counts + piece - 1) // piece, 0)
    piece_end = torch.cumsum(piece_count, 0)
    bound = 2 * occurrences // piece + 1
    piece_row = torch.searchsorted(piece_end, torch.arange(bound, device=device), right=True)
    return piece_row, piece_end, piece_count
