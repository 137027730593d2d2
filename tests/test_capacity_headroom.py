"""A table sized by ``num_embeddings`` holds that many distinct ids without evicting: the
default capacity adds the headroom that bucketed hashing needs (slots_for_keys), checked
against an exact binomial reference, the real hash table and the planner's footprint."""
import math
from fractions import Fraction

import pytest
import torch
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig, OptimizerType,
                    ScorePolicy, StorageMode)
from dynemb.rows.hash_table import ScoredHashTable
from dynemb.rows.hash_table_checks import (OVERFLOW_PROBABILITY, bucket_overflow_probability,
                                      slots_for_keys)
from dynemb.options import choose_storage_mode
from dynemb.planning import measure_allocated, table_footprint
from dynemb.modules.rank_share import local_table_config, local_table_options

DIM = 4


def random_ids(n, seed):
    """``n`` distinct random int64 ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.unique(torch.randint(-2**62, 2**62, (2 * n,), generator=g))
    return ids[torch.randperm(ids.numel(), generator=g)[:n]]


def collection(num_embeddings, **options):
    tables = [EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=num_embeddings,
                              feature_names=["f"])]
    return DynamicEmbCollection(tables, table_options=DynamicEmbTableOptions(**options),
                                optimizer=OptimizerConfig(OptimizerType.SGD, learning_rate=0.1))


def train_step(ec, ids):
    out = ec(KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.tensor([ids.numel()])))
    out["f"].values().sum().backward()


# -- the rule against an exact reference -----------------------------------------------------------
def exact_overflow_bound(keys, buckets, bucket_size):
    """buckets * P(Binomial(keys, 1 / buckets) > bucket_size), in exact rationals."""
    p = Fraction(1, buckets)
    at_most = sum(math.comb(keys, k) * p**k * (1 - p)**(keys - k)
                  for k in range(bucket_size + 1))
    return min(1.0, float(buckets * (1 - at_most)))


@pytest.mark.parametrize("keys, buckets, bucket_size", [
    (300, 4, 128), (1000, 9, 128), (1000, 13, 128), (200, 20, 16), (50, 3, 16), (129, 2, 128)])
def test_overflow_bound_is_the_exact_binomial_tail(keys, buckets, bucket_size):
    got = bucket_overflow_probability(keys, buckets, bucket_size)
    want = exact_overflow_bound(keys, buckets, bucket_size)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("keys, bucket_size", [
    (1, 128), (128, 128), (129, 128), (1000, 128), (10_000, 128), (10**6, 128), (10**9, 128),
    (1000, 16), (5000, 64)])
def test_slots_for_keys_is_the_fewest_buckets_within_the_bound(keys, bucket_size):
    slots = slots_for_keys(keys, bucket_size)
    buckets = slots // bucket_size
    assert slots % bucket_size == 0 and slots >= keys
    assert bucket_overflow_probability(keys, buckets, bucket_size) <= OVERFLOW_PROBABILITY
    if buckets > 1:
        assert bucket_overflow_probability(keys, buckets - 1, bucket_size) > OVERFLOW_PROBABILITY


def test_the_bound_matches_the_real_tables_overflow_rate():
    # at a load where the bound allows overflow in ~29% of tables, the real hash table
    # overflows about that often (the union bound is a little above the true rate)
    keys, bucket_size, buckets = 10_000, 128, 100
    bound = bucket_overflow_probability(keys, buckets, bucket_size)
    assert 0.2 < bound < 0.4
    overflowed = 0
    for seed in range(300):
        table = ScoredHashTable(buckets * bucket_size, bucket_size=bucket_size)
        result = table.find_or_insert(random_ids(keys, seed), on_failure="report")
        overflowed += bool(result.failed.any())
    assert 0.5 * bound < overflowed / 300 <= bound + 0.05


# -- the table built from num_embeddings -----------------------------------------------------------
@pytest.mark.parametrize("n", [1000, 10_000])
@pytest.mark.parametrize("ids", ["random", "sequential"])
def test_num_embeddings_distinct_ids_in_one_batch_never_evict(n, ids):
    for seed in range(4):
        keys = random_ids(n, seed) if ids == "random" else torch.arange(n) + seed * n
        ec = collection(n)
        train_step(ec, keys)                      # would raise TableFullError on overflow
        stats = ec.stats()["t"]
        assert (stats["rows_device"], stats["inserts"], stats["evictions"]) == (n, n, 0)
        assert bool(ec.read_rows("t", keys)[1].all())
        train_step(ec, keys.flip(0))             # all found again: nothing left the table
        assert ec.stats()["t"]["hits"] == n


def test_num_embeddings_ids_over_many_batches_never_evict_and_growth_reaches_the_same_room():
    n = 5000
    keys = random_ids(n, 7)
    for options in ({}, {"init_capacity": 1024}):   # allocated up front, or grown to it
        ec = collection(n, **options)
        for chunk in keys.split(256):
            train_step(ec, chunk)
        stats = ec.stats()["t"]
        assert (stats["rows_device"], stats["evictions"]) == (n, 0), options
        assert ec.tables["t"].tier.hash.capacity <= slots_for_keys(n)


def test_a_table_that_outgrows_its_capacity_still_evicts():
    n = 1000
    ec = collection(n)
    capacity = ec.tables["t"].tier.hash.capacity
    keys = random_ids(3 * capacity, 1)
    for chunk in keys.split(500):
        train_step(ec, chunk)
    stats = ec.stats()["t"]
    assert stats["evictions"] > 0 and stats["rows_device"] <= capacity


def test_default_capacity_is_room_for_num_embeddings_and_an_explicit_one_is_kept():
    kw = dict(name="t", num_embeddings=1000, width=DIM, config_dtype=torch.float32)
    layout = choose_storage_mode(DynamicEmbTableOptions(), **kw)
    assert (layout.max_capacity, layout.init_capacity, layout.target_rows) == (1664, 1664, 1000)
    layout = choose_storage_mode(DynamicEmbTableOptions(bucket_size=16), **kw)
    assert layout.max_capacity == slots_for_keys(1000, 16) == 6144
    explicit = choose_storage_mode(DynamicEmbTableOptions(max_capacity=1000), **kw)
    assert (explicit.max_capacity, explicit.target_rows) == (1024, 1000)  # whole buckets


# -- the planner counts what is allocated ----------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("options", [
    DynamicEmbTableOptions(),
    DynamicEmbTableOptions(caching=False, global_hbm_for_values=300 * DIM * 4)],
    ids=["hbm_direct", "default"])
def test_footprint_counts_the_headroom_that_is_allocated(world, options):
    config = EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=1000,
                             feature_names=["f"])
    optimizer = OptimizerConfig(OptimizerType.SGD)
    rank = DynamicEmbCollection([local_table_config(config, world)], "cpu",
                                table_options={"t": local_table_options(options, world)},
                                optimizer=optimizer)
    fp = table_footprint(config, options, optimizer, world_size=world)
    allocated = measure_allocated(rank)["t"]
    table = rank.tables["t"]
    slots = slots_for_keys(math.ceil(1000 / world))
    assert fp.device_rows + fp.host_rows == slots
    host = table.host_tier.hash.capacity if table.mode is StorageMode.DEFAULT else 0
    assert table.tier.hash.capacity + host == slots
    assert (allocated.device_bytes, allocated.host_bytes) == (
        fp.device_static_bytes, fp.host_bytes)
