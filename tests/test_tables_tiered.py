"""DEFAULT (TieredTable): each key lives in the tier the placement hash gives it (checked
against the Python-int reference), and a claim that fails in either tier leaves both
unchanged."""
import pytest
import torch

from dynemb import Initializer, InitializerKind, ScorePolicy, StorageMode, TableFullError
from key_reference import routes_to_first
from table_builder import DIM, collection, train_step

INIT = Initializer(InitializerKind.CONSTANT, value=1.0)


def make(num_embeddings, **options):
    return collection(num_embeddings, initializer=INIT, **options)


def split_by_tier(table, keys):
    """(device keys, host keys) as the reference placement sends them."""
    first = table.tier.hash.capacity
    total = first + table.host_tier.hash.capacity
    on_device = [routes_to_first(k, first, total) for k in keys]
    return ([k for k, d in zip(keys, on_device) if d],
            [k for k, d in zip(keys, on_device) if not d])


def test_keys_live_in_the_tier_the_placement_hash_gives():
    ec = make(1024, local_hbm_for_values=256 * DIM * 4)
    table = ec.tables["t"]
    assert table.mode is StorageMode.DEFAULT
    # 1024 ids fit without evicting in 1664 slots: the host tier holds the other 1408
    assert (table.tier.hash.capacity, table.host_tier.hash.capacity) == (256, 1408)
    keys = list(range(-200, 200, 3)) + [2**62 + 1, -(2**63) + 5]
    train_step(ec, keys)
    dev, host = split_by_tier(table, keys)
    assert dev and host
    assert (table.tier.hash.find(torch.tensor(dev)) >= 0).all()
    assert (table.host_tier.hash.find(torch.tensor(host)) >= 0).all()
    assert (table.tier.hash.find(torch.tensor(host)) < 0).all()
    assert table.host_tier.device.type == "cpu"
    stats = ec.stats()["t"]
    assert (stats["rows_device"], stats["rows_backing"]) == (len(dev), len(host))
    # both tiers' rows trained once: 1.0 - lr
    rows, found = ec.read_rows("t", torch.tensor(keys))
    assert found.all() and (rows == 0.5).all()


# -- a claim that fails in either tier leaves both unchanged -------------------------------------
def _tier_state(hash_table):
    ex = hash_table.export()
    return (sorted(zip(ex.keys.tolist(), ex.slots.tolist(), ex.scores.tolist())),
            hash_table.size(), hash_table.clock, hash_table.pinned_count())


def _snapshot(ec, keys):
    table = ec.tables["t"]
    stats = {k: v for k, v in ec.stats()["t"].items()
             if k not in ("lookups", "unique_keys", "refused")}
    rows, found = ec.read_rows("t", torch.tensor(keys), with_state=True)
    return (stats, rows.tolist(), found.tolist(), _tier_state(table.tier.hash),
            _tier_state(table.host_tier.hash))


@pytest.mark.parametrize("full_tier", ["host", "device"])
def test_no_eviction_failure_leaves_both_tiers_unchanged(full_tier):
    # 4 device rows and 4 host rows, one bucket each: the fifth key of a tier finds no slot.
    ec = make(8, caching=False, local_hbm_for_values=4 * DIM * 4, bucket_size=4, max_capacity=8,
              score_strategy=ScorePolicy.NO_EVICTION)
    table = ec.tables["t"]
    assert table.mode is StorageMode.DEFAULT and table.host_tier.hash.capacity == 4
    dev, host = split_by_tier(table, list(range(1, 200)))
    train_step(ec, [dev[0], host[0]])
    if full_tier == "host":
        batch = dev[1:3] + host[1:5]     # the device takes 2, the host tier 3 of its 4
    else:
        batch = dev[1:5] + host[1:3]     # the host tier takes 2, the device 3 of its 4
    keys = dev[:5] + host[:5]
    before = _snapshot(ec, keys)
    with pytest.raises(TableFullError, match="Nothing was inserted"):
        train_step(ec, batch)
    assert _snapshot(ec, keys) == before
    assert ec.stats()["t"]["refused"] == 1   # the fifth key of the full tier
    train_step(ec, [dev[1], host[1]])   # the table keeps working
    assert ec.stats()["t"]["rows_device"] == 2 and ec.stats()["t"]["rows_backing"] == 2
