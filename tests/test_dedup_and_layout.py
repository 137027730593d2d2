"""Padded dedup against torch.unique, and how options resolve to a storage mode."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynemb import DynamicEmbTableOptions, StorageMode
from dynemb.dedup import padded_unique, unique_keys
from dynemb.types import EMPTY_KEY


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-2**62, 2**62), max_size=60), st.booleans())
def test_padded_unique_matches_torch_unique(values, few_distinct):
    keys = torch.tensor([v % 7 if few_distinct else v for v in values], dtype=torch.int64)
    u = padded_unique(keys)
    want, counts = torch.unique(keys, return_counts=True)
    n = int(u.num_unique)
    assert u.keys.numel() == keys.numel() and n == want.numel()
    assert torch.equal(u.keys[:n], want) and torch.equal(u.counts[:n], counts)
    assert bool((u.keys[n:] == EMPTY_KEY).all()) and bool((u.counts[n:] == 0).all())
    assert torch.equal(u.keys[u.inverse], keys)


def test_cpu_unique_is_exact_and_first_occurrence_ordered():
    u = unique_keys(torch.tensor([9, 4, 9, 1]))
    assert u.keys.tolist() == [9, 4, 1] and u.counts.tolist() == [2, 1, 1]
    assert u.inverse.tolist() == [0, 1, 0, 2] and int(u.num_unique) == 3


@pytest.mark.parametrize("budget_rows, caching, mode, device_rows", [
    (None, False, StorageMode.HBM_DIRECT, 1024),
    (1024, False, StorageMode.HBM_DIRECT, 1024),
    (1000, True, StorageMode.CACHE, 896),      # rounded down to whole buckets of 128
    (300, False, StorageMode.DEFAULT, 256),
])
def test_storage_mode_choice(budget_rows, caching, mode, device_rows):
    from dynemb.options import choose_storage_mode
    width = 8 + 1  # dim + row-wise AdaGrad state
    budget = None if budget_rows is None else budget_rows * width * 4
    layout = choose_storage_mode(
        DynamicEmbTableOptions(caching=caching, local_hbm_for_values=budget), name="t",
        num_embeddings=1000, width=width, config_dtype=torch.float32)
    assert layout.mode is mode and layout.device_capacity == device_rows
    assert layout.max_capacity == 1024


def test_global_budget_is_split_over_ranks():
    from dynemb.options import choose_storage_mode
    opts = DynamicEmbTableOptions(caching=True, global_hbm_for_values=4 * 1024 * 8 * 4)
    kw = dict(name="t", num_embeddings=4096, width=8, config_dtype=torch.float32)
    assert choose_storage_mode(opts, **kw).mode is StorageMode.HBM_DIRECT  # 4096 rows fit
    split = choose_storage_mode(opts, world_size=4, **kw)
    assert split.mode is StorageMode.CACHE and split.device_capacity == 1024
    opts = DynamicEmbTableOptions(global_hbm_for_values=4096 * 8 * 2)
    layout = choose_storage_mode(opts, **kw, world_size=1)
    assert layout.mode is StorageMode.DEFAULT
    with pytest.raises(ValueError, match="data_type"):
        choose_storage_mode(DynamicEmbTableOptions(), name="t", num_embeddings=8, width=8,
                            config_dtype=torch.int8)
