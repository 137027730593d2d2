"""Frequency admission: a key gets a row only after it was seen ``threshold`` times."""
from __future__ import annotations

from typing import Optional

import torch

from dynemb.rows.hash_table import ScoredHashTable
from dynemb.backends.protocol import KernelBackend
from dynemb.types import EMPTY_KEY, MAX_BUCKET_SIZE, ScorePolicy


class AdmissionCounter:
    """Counts occurrences of keys that are not admitted yet, in an LFU-scored hash table of
    about ``counter_capacity`` slots (:func:`counter_slots`); a key is admitted at its
    ``threshold``-th occurrence (the :class:`~dynemb.options.FrequencyAdmission` of a table).

    Keys come padded (``EMPTY_KEY`` entries are ignored) so shapes never depend on data.
    ``kernels``: those of the owning table (None: the kernels of ``device``).

    Example::

        >>> counter = AdmissionCounter(2, 65536, torch.device("cpu"))
        >>> keys, counts = torch.tensor([4, 5]), torch.tensor([2, 1])
        >>> counter.admit(keys, counts, torch.tensor([True, True])).tolist()
        [True, False]
    """

    def __init__(self, threshold: int, counter_capacity: int, device: torch.device,
                 kernels: Optional[KernelBackend] = None):
        self.threshold = threshold
        self.table = ScoredHashTable(counter_slots(counter_capacity), policy=ScorePolicy.LFU,
                                     device=device, kernels=kernels)

    def admit(self, keys: torch.Tensor, counts: torch.Tensor,
              candidates: torch.Tensor) -> torch.Tensor:
        """Add ``counts`` to the candidates' tallies; returns which candidates reach the
        threshold (they leave the counter: from now on the table holds them)."""
        masked = torch.where(candidates, keys, EMPTY_KEY)
        result = self.table.find_or_insert(masked, assume_unique=True, counts=counts,
                                           on_failure="defer")
        admitted = candidates & (self.table.scores_at(result.slots) >= self.threshold)
        self.table.erase(torch.where(admitted, keys, EMPTY_KEY), allow_padding=True)
        return admitted

    def size(self) -> int:
        return self.table.size()


def counter_slots(counter_capacity: int) -> int:
    """Slots of the counter table: ``counter_capacity`` rounded up to whole buckets of
    ``MAX_BUCKET_SIZE`` (the table's default bucket size).

    Example::

        >>> counter_slots(200)
        256
    """
    buckets = max(1, -(-counter_capacity // MAX_BUCKET_SIZE))
    return buckets * MAX_BUCKET_SIZE
