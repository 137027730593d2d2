"""A tier's check that a slot still holds a key; slot failures reported at a later call."""
import pytest
import torch

from dynemb import DynamicEmbTableOptions, TableFullError
from dynemb.options import choose_storage_mode
from dynemb.tables.tier import DeferredFailures, Tier


def test_still_stored_follows_the_key_not_the_slot():
    options = DynamicEmbTableOptions(bucket_size=4)
    layout = choose_storage_mode(options, name="t", num_embeddings=4, width=2,
                                 config_dtype=torch.float32)
    tier = Tier(layout, 4, 2, 0, options, torch.device("cpu"), None)
    slots = tier.hash.find_or_insert(torch.tensor([1, 2])).slots
    tier.hash.erase(torch.tensor([2]))
    again = tier.hash.find_or_insert(torch.tensor([9])).slots  # may reuse 2's slot
    keys = torch.tensor([1, 2, 9, 5])
    probe = torch.cat([slots, again, torch.tensor([-1])])
    assert tier.still_stored(probe, keys).tolist() == [True, False, True, False]
    assert tier.still_stored(probe[[2, 0]], torch.tensor([1, 9])).tolist() == [False, False]


def test_deferred_failures_raise_once_with_their_total():
    failures = DeferredFailures(torch.device("cpu"))
    failures.check("t")                                     # nothing recorded
    failures.record(torch.tensor([True, False, True]))
    failures.record(torch.tensor([False, True]))
    with pytest.raises(TableFullError, match="table 't': 3 keys of earlier batches found no "
                                             "slot"):
        failures.check("t")
    failures.check("t")                                     # reported once
    failures.record(torch.tensor([False]))
    failures.check("t")
