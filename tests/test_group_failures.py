"""The one failure policy of a table group (dynemb.tables.group_failures): the backend says
whether a refused key raises in the claim that refused it or at a later prefetch; both count
on the device, and a group of either kind leaves nothing changed when it raises at once."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dynemb.backends.numba_backends import get_backend
from dynemb.tables.group_failures import GroupFailures
from dynemb.types import TableFullError


def test_at_once_names_the_first_refusing_table_and_keeps_nothing_pending():
    failures = GroupFailures(["a", "b", "c"], get_backend("cpu"), torch.device("cpu"))
    assert failures.at_once
    assert failures.first_refusing(torch.tensor([0, 0, 0])) is None
    assert failures.first_refusing(torch.tensor([0, 3, 1])) == 1
    failures.check()  # nothing is left for a later prefetch
    assert failures.total.tolist() == [0, 0, 0]


def test_later_counts_every_claim_and_raises_once_at_the_next_check():
    later = SimpleNamespace(defers_failures=True)
    failures = GroupFailures(["a", "b"], later, torch.device("cpu"))
    assert not failures.at_once
    assert failures.first_refusing(torch.tensor([2, 0])) is None  # served zeros, not raised
    assert failures.first_refusing(torch.tensor([1, 4])) is None
    with pytest.raises(TableFullError, match=r"'a': 3, 'b': 4"):
        failures.check()
    failures.check()  # reported once: the counts start again from zero
    assert failures.total.tolist() == [0, 0]


def test_the_backends_choose_the_policy():
    from dynemb.backends.cuda_backend import CudaBackend
    assert GroupFailures(["a"], CudaBackend, torch.device("cpu")).at_once is False
    assert GroupFailures(["a"], get_backend("cpu"), torch.device("cpu")).at_once is True
