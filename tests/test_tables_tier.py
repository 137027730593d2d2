"""A tier's check that a slot still holds a key."""
import torch

from dynemb import DynamicEmbTableOptions
from dynemb.options import choose_storage_mode
from dynemb.tables.tier import Tier


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

