"""Bad input raises an error naming the argument, and leaves the table as it was."""
import pytest
import torch

from dynemb import ScorePolicy
from dynemb.rows.hash_table import ScoredHashTable
from dynemb.types import EMPTY_KEY, TOMBSTONE_KEY
from dynemb.foundations.validation import canonical_device, same_device
from test_hash_table import snapshot


@pytest.fixture
def filled(make_table, to_dev):
    table = make_table(64, bucket_size=8, policy=ScorePolicy.LRU)
    table.find_or_insert(to_dev([1, 2, 3]))
    return table


BAD_KEYS = [
    (lambda d: torch.tensor([1.0, 2.0], device=d), TypeError, "keys must have dtype torch.int64"),
    (lambda d: torch.tensor([1, 2], dtype=torch.int32, device=d), TypeError, "keys must have dtype"),
    (lambda d: torch.tensor([[1, 2]], device=d), ValueError, "keys must be 1-D"),
    (lambda d: [1, 2], TypeError, "keys must be a torch.Tensor"),
    (lambda d: torch.tensor([4, EMPTY_KEY], device=d), ValueError, "reserved key"),
    (lambda d: torch.tensor([TOMBSTONE_KEY], device=d), ValueError, "reserved key"),
]


@pytest.mark.parametrize("make_keys,error,message", BAD_KEYS,
                         ids=["float", "int32", "2d", "list", "empty_key", "tombstone_key"])
@pytest.mark.parametrize("op", ["find", "find_or_insert", "erase"])
def test_bad_keys(filled, backend, make_keys, error, message, op):
    before = snapshot(filled)
    with pytest.raises(error, match=message):
        getattr(filled, op)(make_keys(backend[1]))
    assert snapshot(filled) == before


def test_bad_scores_and_options(filled, to_dev, make_table):
    before = snapshot(filled)
    with pytest.raises(ValueError, match="scores are only used by the CUSTOMIZED"):
        filled.find_or_insert(to_dev([5]), to_dev([1]))
    with pytest.raises(ValueError, match="on_failure"):
        filled.find_or_insert(to_dev([5]), on_failure="ignore")
    assert snapshot(filled) == before
    custom = make_table(16, policy=ScorePolicy.CUSTOMIZED)
    with pytest.raises(ValueError, match="scores are required"):
        custom.find_or_insert(to_dev([5]))
    with pytest.raises(ValueError, match="scores has shape"):
        custom.find_or_insert(to_dev([5, 6]), to_dev([1]))
    with pytest.raises(TypeError, match="scores must have dtype"):
        custom.find_or_insert(to_dev([5]), to_dev([1]).float())
    assert custom.size() == 0 and custom.clock == 0


def test_bad_slots(filled, to_dev):
    before = snapshot(filled)
    with pytest.raises(ValueError, match=r"slots must lie in \[0, 64\)"):
        filled.pin(to_dev([64]))
    with pytest.raises(ValueError, match=r"slots must lie in"):
        filled.unpin(to_dev([-1]))
    empty_slot = next(s for s in range(64) if s not in filled.export().slots.tolist())
    with pytest.raises(ValueError, match="holds no key"):
        filled.pin(to_dev([empty_slot]))
    live = filled.find(to_dev([1]))
    with pytest.raises(ValueError, match="holds 0 pins"):
        filled.unpin(live)
    filled.pin(live)
    with pytest.raises(ValueError, match="2 times but it holds 1 pins"):
        filled.unpin(torch.cat([live, live]))
    filled.unpin(live)
    assert snapshot(filled) == before


def test_bad_export_and_grow(filled):
    before = snapshot(filled)
    for start in (-1, 65, 1.5):
        with pytest.raises(ValueError, match="start must be"):
            filled.export(start)
    with pytest.raises(ValueError, match="batch must be positive"):
        filled.export(0, 0)
    for cap in (64, 32, 100):
        with pytest.raises(ValueError, match="new_capacity must be a multiple"):
            filled.grow(cap)
    with pytest.raises(TypeError, match="new_capacity must be an int"):
        filled.grow(128.0)
    assert snapshot(filled) == before


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(capacity=0), ValueError, "capacity must be positive"),
    (dict(capacity=-8), ValueError, "capacity must be positive"),
    (dict(capacity=2.5), TypeError, "capacity must be an int"),
    (dict(capacity=1000), ValueError, r"capacity must be a multiple of bucket_size \(128\)"),
    (dict(capacity=1000), ValueError, r"got 1000, nearest valid: 1024"),
    (dict(capacity=3), ValueError, r"capacity below 128 must be a power of two \(one bucket "
                                   r"then holds the whole table\), or else a multiple of 128; "
                                   r"got 3, nearest valid: 4"),
    (dict(capacity=100), ValueError, r"got 100, nearest valid: 128"),
    (dict(capacity=2**40), ValueError, r"capacity 1099511627776 is beyond the 274877906816 "
                                       r"slots one table can have with bucket_size 128"),
    (dict(capacity=2**37, bucket_size=32), ValueError, r"use larger buckets"),
    (dict(capacity=128, max_capacity=2**40), ValueError, r"max_capacity 1099511627776 is beyond"),
    (dict(capacity=96, bucket_size=12), ValueError, "bucket_size must be a power of two"),
    (dict(capacity=512, bucket_size=256), ValueError, "bucket_size must be a power of two <= 128"),
    (dict(capacity=64, policy="lru"), TypeError, "policy must be a ScorePolicy"),
    (dict(capacity=64, grow_at_load_factor=1.5), ValueError, "grow_at_load_factor"),
    (dict(capacity=64, max_capacity=32), ValueError, "max_capacity"),
    (dict(capacity=64, backend="tpu"), ValueError, "backend must be"),
])
def test_bad_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        ScoredHashTable(**kwargs)


def test_keys_on_the_wrong_device_are_rejected():
    table = ScoredHashTable(64)
    with pytest.raises(ValueError, match="keys is on meta but the table is on cpu"):
        table.find(torch.empty(3, dtype=torch.int64, device="meta"))


def test_kjt_ids_on_another_device_than_the_tables_name_both_devices():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    from dynemb.foundations.validation import check_kjt
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([1, 2]), torch.tensor([2]))
    check_kjt(kjt, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"the KJT's ids are on cpu but the tables are on "
                                         r"cuda:0; pass the KJT on cuda:0"):
        check_kjt(kjt, torch.device("cuda", 0))


def test_a_cuda_device_without_index_is_the_current_one(monkeypatch):
    # torch makes a tensor for device "cuda" on the current device and names it cuda:<i>;
    # a table built on "cuda" must accept it (checked without a GPU by faking the current one)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert canonical_device("cuda") == torch.device("cuda", 1)
    assert canonical_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert canonical_device("cpu") == torch.device("cpu")
    assert same_device(torch.device("cuda", 1), torch.device("cuda"))
    assert not same_device(torch.device("cuda", 0), torch.device("cuda"))
    assert not same_device(torch.device("cpu"), torch.device("cuda"))
