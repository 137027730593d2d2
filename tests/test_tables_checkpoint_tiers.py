"""What a checkpoint sees of each table class: its tiers and where they keep keys and rows,
where saved entries go back by key (HBM_DIRECT: the device tier; CACHE: the backing store;
DEFAULT: the tier each key routes to), which rows are current, and which tiers a change
tracker follows."""
import pytest
import torch

from dynemb import FrequencyAdmission, StorageMode, TableFullError
from dynemb.stores.backing_store import HostBackingStore
from key_reference import routes_to_first
from table_builder import DIM, build, prefetch

WIDTH = DIM  # SGD keeps no optimizer state


def hbm_direct(**options):
    return build(64, **options)


def cache(**options):
    return build(1024, caching=True, bucket_size=4, local_hbm_for_values=4 * DIM * 4, **options)


def tiered(**options):
    return build(1024, local_hbm_for_values=256 * DIM * 4, **options)


def saved(keys):
    keys = torch.tensor(keys, dtype=torch.int64)
    rows = keys[:, None].float().expand(-1, WIDTH).contiguous()
    return keys, keys + 100, rows


@pytest.mark.parametrize("make, mode, tiers, tracked", [
    (hbm_direct, StorageMode.HBM_DIRECT, ["device"], ["device"]),
    (cache, StorageMode.CACHE, ["device", "host"], ["device"]),
    (tiered, StorageMode.DEFAULT, ["device", "host"], ["device", "host"]),
])
def test_each_mode_names_its_tiers_and_where_they_are(make, mode, tiers, tracked):
    table = make()
    assert table.mode is mode
    parts = table.checkpoint_tiers()
    assert list(parts) == tiers
    assert parts["device"].hash is table.tier.hash
    assert parts["device"].rows is table.tier.flat.weights
    assert [name for name, _ in table.tracked_tiers()] == tracked
    if mode is StorageMode.CACHE:
        assert isinstance(table.store, HostBackingStore)
        assert parts["host"].store is table.store
        assert parts["host"].hash is table.store.hash_table
    if mode is StorageMode.DEFAULT:
        assert parts["host"].hash is table.host_tier.hash and parts["host"].store is None
    admitted = make(admission=FrequencyAdmission(threshold=2))
    assert list(admitted.checkpoint_tiers()) == tiers + ["admission"]
    assert admitted.checkpoint_tiers()["admission"].rows is None


class UserStore:
    """A store that is not the default one (which it wraps, out of sight)."""

    def __init__(self, width, dtype, device):
        self.width, self.inner = width, HostBackingStore(width, dtype, device)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_user_store_is_a_tier_without_slots_of_ours():
    table = cache(backing_store=UserStore)
    host = table.checkpoint_tiers()["host"]
    assert (host.hash, host.rows, host.store) == (None, None, table.store)
    keys, scores, rows = saved([5, 6, 7])
    table.insert_saved_entries("device", keys, scores, rows)
    assert host.size() == 3 and table.tier.hash.size() == 0


@pytest.mark.parametrize("make", [hbm_direct, cache, tiered])
def test_saved_entries_go_back_by_key_where_the_mode_keeps_rows(make):
    table = make()
    keys, scores, rows = saved(list(range(1, 40)))
    table.insert_saved_entries("device", keys, scores, rows)
    got, found = table.read_rows(keys)
    assert found.all() and torch.equal(got, rows[:, :DIM])
    if table.mode is StorageMode.CACHE:  # the store holds them, the cache refills from it
        assert table.tier.hash.size() == 0 and table.store.size() == keys.numel()
    elif table.mode is StorageMode.DEFAULT:
        dev_cap, host_cap = table.tier.hash.capacity, table.host_tier.hash.capacity
        on_device = torch.tensor([routes_to_first(k, dev_cap, dev_cap + host_cap)
                                  for k in keys.tolist()])
        assert 0 < on_device.sum() < keys.numel()
        assert (table.tier.hash.find(keys[on_device]) >= 0).all()
        assert (table.host_tier.hash.find(keys[~on_device]) >= 0).all()
    else:
        assert table.tier.hash.size() == keys.numel()


def test_saved_entries_that_find_no_slot_raise():
    table = build(8, bucket_size=4, max_capacity=8, init_capacity=8)
    keys, scores, rows = saved(list(range(1, 40)))
    with pytest.raises(TableFullError, match="found no free slot in its device tier"):
        table.insert_saved_entries("device", keys, scores, rows)


def test_admission_entries_go_to_the_admission_counter():
    table = hbm_direct(admission=FrequencyAdmission(threshold=5))
    keys, scores, _ = saved([3, 4])
    table.insert_saved_entries("admission", keys, scores, None)
    assert (table.admission.table.find(keys) >= 0).all() and table.tier.hash.size() == 0


def test_cache_store_rows_of_cached_keys_are_not_current():
    table = cache()
    keys, scores, rows = saved([1, 2, 3])
    table.insert_saved_entries("host", keys, scores, rows)
    batch = prefetch(table, torch.tensor([2]))  # 2 is cached now
    kept, kept_scores, kept_rows = table.current_entries("host", keys, scores, rows)
    assert kept.tolist() == [1, 3] and kept_scores.tolist() == [101, 103]
    assert torch.equal(kept_rows, rows[[0, 2]])
    assert table.current_entries("device", keys, scores, rows)[0] is keys
    assert table.has_batches_in_flight()
    batch.release()
    assert not table.has_batches_in_flight()


def test_default_checks_that_saved_keys_sit_in_their_tier():
    table = tiered()
    dev_cap, host_cap = table.tier.hash.capacity, table.host_tier.hash.capacity
    keys = torch.arange(1, 200)
    on_device = torch.tensor([routes_to_first(k, dev_cap, dev_cap + host_cap)
                              for k in keys.tolist()])
    table.check_routing("device", keys[on_device], "w")
    table.check_routing("host", keys[~on_device], "w")
    with pytest.raises(ValueError, match="w: .* keys belong to the host tier"):
        table.check_routing("device", keys, "w")
    # placed under a smaller device tier, most of them belong to the host tier
    with pytest.raises(ValueError, match="belong to the host tier"):
        table.check_routing("device", keys[on_device], "w",
                            dict(device=16, host=dev_cap + host_cap - 16))
    hbm_direct().check_routing("device", keys, "w")  # one tier: nothing to check


def test_a_tier_rows_follow_their_keys_when_its_hash_table_grows():
    table = build(64, init_capacity=16, bucket_size=4, max_load_factor=0.5)
    keys, scores, rows = saved(list(range(1, 8)))
    table.insert_saved_entries("device", keys, scores, rows)
    h = table.tier.hash
    table.remap_tier_rows("device", h.grow(64), 64)
    assert h.capacity == 64 and table.tier.flat.weights.shape[0] == 64
    got, found = table.read_rows(keys)
    assert found.all() and torch.equal(got, rows[:, :DIM])
