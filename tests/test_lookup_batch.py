"""The interfaces the layers above the tables see: a group's batch and a DEFAULT group's both
implement every operation of ``LookupBatch`` with its parameters, and both kinds of group
(``TableGroup``, the DEFAULT ``TieredGroup``) offer a prefetch every operation, with the same
parameters."""
from __future__ import annotations

import inspect

import pytest

from dynemb.tables.group_batch import GroupBatch
from dynemb.tables.groups import TableGroup
from dynemb.tables.lookup_batch import LookupBatch
from dynemb.tables.group_tiers import TieredBatch, TieredGroup


def _abstract(cls):
    """The methods and properties of ``cls`` whose body only raises NotImplementedError."""
    names = []
    for name, member in vars(cls).items():
        func = member.fget if isinstance(member, property) else member
        if callable(func) and "raise NotImplementedError" in inspect.getsource(func):
            names.append(name)
    return names


@pytest.mark.parametrize("kind", [GroupBatch, TieredBatch])
def test_both_batch_kinds_implement_every_operation_of_the_batch_interface(kind):
    abstract = _abstract(LookupBatch)
    assert {"lookup_occurrences", "pooling_rows", "apply_gradients", "release",
            "names", "member", "rehome", "end_pins_alone"} <= set(abstract)
    for name in abstract:
        ours = getattr(kind, name)
        assert ours is not getattr(LookupBatch, name), f"{kind.__name__} lacks {name}"
        if callable(ours) and not isinstance(ours, property):
            assert (list(inspect.signature(ours).parameters)
                    == list(inspect.signature(getattr(LookupBatch, name)).parameters)), name


UNIT_OPERATIONS = ("claims_apart", "claim_batch", "finish_batch", "undo_batch", "prefetch",
                   "lookup_batch", "check_failures")


@pytest.mark.parametrize("operation", UNIT_OPERATIONS)
def test_a_default_group_offers_what_a_group_offers(operation):
    group, tiered = getattr(TableGroup, operation), getattr(TieredGroup, operation)
    assert (list(inspect.signature(group).parameters)
            == list(inspect.signature(tiered).parameters))
