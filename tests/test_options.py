"""How options resolve to a storage mode and layout; options that cannot work are rejected
at construction, with the options that would."""
import pytest
import torch
from torchrec import EmbeddingConfig

from dynemb import DynamicEmbCollection, DynamicEmbTableOptions, ScorePolicy, StorageMode
from dynemb.rows.hash_table import max_table_capacity
from dynemb.options import choose_storage_mode
from test_collection import kjt, train_step

DIM = 4


def make(num_embeddings, device=None, **options):
    tables = [EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=num_embeddings,
                              feature_names=["f"])]
    return DynamicEmbCollection(tables, device, table_options=DynamicEmbTableOptions(**options))


# -- storage mode and layout ------------------------------------------------------------------
# 1000 ids need 1664 slots (13 buckets of 128) to fit without evicting: slots_for_keys
@pytest.mark.parametrize("budget_rows, caching, mode, device_rows", [
    (None, False, StorageMode.HBM_DIRECT, 1664),
    (1664, False, StorageMode.HBM_DIRECT, 1664),
    (1663, True, StorageMode.CACHE, 1536),     # rounded down to whole buckets of 128
    (1000, True, StorageMode.CACHE, 896),
    (300, False, StorageMode.DEFAULT, 256),
])
def test_storage_mode_choice(budget_rows, caching, mode, device_rows):
    width = 8 + 1  # dim + row-wise AdaGrad state
    budget = None if budget_rows is None else budget_rows * width * 4
    layout = choose_storage_mode(
        DynamicEmbTableOptions(caching=caching, local_hbm_for_values=budget), name="t",
        num_embeddings=1000, width=width, config_dtype=torch.float32)
    assert layout.mode is mode and layout.device_capacity == device_rows
    assert layout.max_capacity == 1664 and layout.row_bytes == 36
    assert layout.target_rows == 1000


def test_global_budget_is_split_over_ranks():
    opts = DynamicEmbTableOptions(caching=True, global_hbm_for_values=4 * 1024 * 8 * 4,
                                  max_capacity=4096)
    kw = dict(name="t", num_embeddings=4096, width=8, config_dtype=torch.float32)
    assert choose_storage_mode(opts, **kw).mode is StorageMode.HBM_DIRECT  # 4096 rows fit
    split = choose_storage_mode(opts, world_size=4, **kw)
    assert split.mode is StorageMode.CACHE and split.device_capacity == 1024
    opts = DynamicEmbTableOptions(global_hbm_for_values=4096 * 8 * 2, max_capacity=4096)
    layout = choose_storage_mode(opts, **kw, world_size=1)
    assert layout.mode is StorageMode.DEFAULT
    with pytest.raises(ValueError, match="data_type"):
        choose_storage_mode(DynamicEmbTableOptions(), name="t", num_embeddings=8, width=8,
                            config_dtype=torch.int8)


def test_half_rows_count_a_float32_optimizer_state():
    # Adam at dim 64 in float16: 64 half columns and 128 float32 values, 640 bytes a row
    options = DynamicEmbTableOptions(caching=True, local_hbm_for_values=128 * 640)
    layout = choose_storage_mode(options, name="t", num_embeddings=4096, width=64 + 128,
                                 state_dim=128, config_dtype=torch.float16)
    assert layout.row_bytes == 640 and layout.device_capacity == 128
    assert layout.dtype == torch.float16 and layout.mode is StorageMode.CACHE


# -- rejected at construction ------------------------------------------------------------------
def test_max_capacity_beyond_one_hash_table_names_the_capacity_options():
    assert max_table_capacity(128) < 2**40
    with pytest.raises(ValueError, match=(
            r"table 't': max_capacity 2515946192000 rows \(room for "
            r"num_embeddings=1099511627776 ids in buckets of 128, as max_capacity is not set\) "
            r"is beyond the 274877906816 rows one hash table can hold with "
            r"bucket_size 128\. .*not the id range.*Set a smaller max_capacity or "
            r"num_embeddings; .*set init_capacity .* or a memory budget")):
        make(2**40)
    with pytest.raises(ValueError, match=r"max_capacity 1099511627776 rows is beyond"):
        make(1024, max_capacity=2**40, init_capacity=1024)
    # room for 2**36 ids: 227,455,856,960 slots in buckets of 64 (beyond one table), but
    # 151,284,754,176 in buckets of 128, which fit
    with pytest.raises(ValueError, match=r"or a larger bucket_size \(up to 128\)"):
        make(2**36, bucket_size=64, init_capacity=1024)
    with pytest.raises(ValueError) as err:   # too large even with buckets of 128
        make(2**38, init_capacity=1024)
    assert "larger bucket_size" not in str(err.value)


def test_rows_allocated_up_front_beyond_memory_name_init_capacity_and_a_budget():
    # room for 2**36 ids: 151,284,754,176 rows of (4 floats + a hash slot), 5 TiB
    with pytest.raises(ValueError, match=(
            r"table 't': the 151284754176 rows allocated up front \(init_capacity, which "
            r"defaults to max_capacity, which defaults to room for num_embeddings ids\) need "
            r"4\.95 TiB on "
            r"cpu, which has .* GiB; set init_capacity to start smaller .*"
            r"local_hbm_for_values / global_hbm_for_values\) with caching=True")):
        make(2**36)
    with pytest.raises(ValueError, match=r"rows of the host tier, allocated up front, need .*"
                                         r"lower max_capacity, or set caching=True"):
        make(2**36, local_hbm_for_values=1 << 20)


def test_what_a_module_allocates_up_front_is_checked_together_before_any_table(monkeypatch):
    """Host memory faked to 64 MiB: one table of 200k rows is refused alone, and eight of 60k
    rows (each fits) are refused together, before any is built."""
    import dynemb.tables.allocation_checks as checks
    import dynemb.tables as tables_package
    monkeypatch.setattr(checks, "total_memory",
                        lambda device: 64 << 20 if device.type == "cpu" else None)
    built = []
    real_build = tables_package.build_table
    monkeypatch.setattr("dynemb.modules.collection_config.build_table",
                        lambda *a, **k: built.append(a[0]) or real_build(*a, **k))

    def module(rows, count):
        configs = [EmbeddingConfig(name=f"t{i}", embedding_dim=64, num_embeddings=rows,
                                   feature_names=[f"f{i}"]) for i in range(count)]
        return DynamicEmbCollection(configs, table_options=DynamicEmbTableOptions())

    # 361,600 and 106,240 rows of 64 floats + a 20-byte hash slot: 95.2 MiB and 28 MiB each
    with pytest.raises(ValueError, match=r"table 't0': .* need 95\.2 MiB on cpu, which has 64 MiB"):
        module(200_000, 1)
    with pytest.raises(ValueError, match=(
            r"the 8 tables of the module allocate 224 MiB up front on cpu together, which "
            r"has 64 MiB \(largest: 't0' 28 MiB, 't1' 28 MiB, .*, 't4' 28 MiB and 3 more\); "
            r"each fits alone, not all of them: set init_capacity to start smaller")):
        module(60_000, 8)
    assert built == []
    module(60_000, 2)  # 2 of them fit
    assert built == ["t0", "t1"]


def test_the_suggested_options_work():
    ec = make(2**36, init_capacity=1024)  # grows up to 2**36 rows as they arrive
    train_step(ec, list(range(2000)))
    assert ec.stats()["t"]["rows_device"] == 2000
    cached = make(2**36, local_hbm_for_values=1 << 20, caching=True)
    assert cached.storage_modes() == {"t": StorageMode.CACHE}
    train_step(cached, [1, 2, 3])


def test_meta_collection_allocates_nothing_so_is_not_checked_against_memory():
    make(2**36, device="meta")  # each rank checks its own share when sharded


def test_caching_with_no_eviction_is_rejected_when_the_table_resolves_to_cache():
    with pytest.raises(ValueError, match=(
            r"table 't': caching=True needs an evicting score_strategy, got "
            r"score_strategy=NO_EVICTION: the table \(6912 rows x 16 bytes\) does not fit "
            r"local_hbm_for_values \(8192 bytes per rank\), so the device caches 512 rows")):
        make(4096, caching=True, local_hbm_for_values=8192,
             score_strategy=ScorePolicy.NO_EVICTION)
    fits = make(4096, caching=True, score_strategy=ScorePolicy.NO_EVICTION)
    assert fits.storage_modes() == {"t": StorageMode.HBM_DIRECT}
    split = make(4096, local_hbm_for_values=8192, score_strategy=ScorePolicy.NO_EVICTION)
    assert split.storage_modes() == {"t": StorageMode.DEFAULT}
    out = split(kjt(list(range(100))))
    out["f"].values().sum().backward()
