"""Owner ranks and tier placement are part of the data layout: pin them to values computed
with Python ints (explicit 64-bit wraparound, tests/key_reference.py), independently of
torch and numba."""
import numpy as np
import pytest
import torch

from dynemb.kernels.hashing import mix64
from dynemb.foundations.key_mixing import (OWNER_RANK_SALT, mix_keys, owner_rank_hash,
                                           reduce_to_range, routes_to_first)
from dynemb.options import ShardingScheme
from dynemb.sharding.routing import owner_ranks
from key_reference import GOLDEN, fmix64, owner_hash, signed
from key_reference import routes_to_first as py_first

KEYS = [0, 1, 2, 3, 7, 42, -1, -3, 2**62 + 3, -(2**63) + 2, 2**63 - 1, 123456789]
MIX = [0, -5451962507482445012, 4233148493373801447, 815575690806614222, 8360697188923789789,
       -9148929187392628276, 7256831767414464289, -6180069328792701246, 4315187775034091040,
       -6089375900743974847, -6072754518692401686, -8107560010088384378]
MIX_OWNER_SALT = [
    -7160610219483255062, -1874130600990937387, -506827221854816315, 6907659034911495900,
    1348100354356037461, 3250621881602310087, 2717770620714153248, 3266248721692056879,
    5668529144597093094, -5711266098689259698, -4572323259846170332, 8655499277808602980]
OWNER_OF_4 = [2, 3, 3, 1, 0, 0, 0, 0, 1, 2, 3, 1]
OWNER_OF_7 = [4, 6, 6, 2, 0, 1, 1, 1, 2, 4, 5, 3]
FIRST_OF_1024_2048 = [True, False, False, False, False, True] + [False] * 6
FIRST_OF_384_1408 = [True] + [False] * 11


def _py_mix(key: int) -> int:
    return signed(fmix64(key))


def test_mix_keys_pinned():
    keys = torch.tensor(KEYS)
    assert mix_keys(keys).tolist() == MIX
    assert mix_keys(keys, OWNER_RANK_SALT).tolist() == MIX_OWNER_SALT


def test_owner_ranks_pinned():
    keys = torch.tensor(KEYS)
    assert owner_ranks(keys, 4, ShardingScheme.HASH).tolist() == OWNER_OF_4
    assert owner_ranks(keys, 7, ShardingScheme.HASH).tolist() == OWNER_OF_7


def test_tier_placement_pinned():
    keys = torch.tensor(KEYS)
    assert routes_to_first(keys, 1024, 2048).tolist() == FIRST_OF_1024_2048
    assert routes_to_first(keys, 384, 1408).tolist() == FIRST_OF_384_1408


def test_pinned_values_are_the_python_int_reference():
    assert [_py_mix(k) for k in KEYS] == MIX
    assert [_py_mix(k + GOLDEN) for k in KEYS] == MIX_OWNER_SALT
    assert [owner_hash(k, 4) for k in KEYS] == OWNER_OF_4
    assert [owner_hash(k, 7) for k in KEYS] == OWNER_OF_7
    assert [py_first(k, 1024, 2048) for k in KEYS] == FIRST_OF_1024_2048
    assert [py_first(k, 384, 1408) for k in KEYS] == FIRST_OF_384_1408


@pytest.mark.parametrize("world", [1, 3, 8])
def test_random_keys_match_the_python_int_reference(world):
    keys = torch.randint(-(2**63), 2**63 - 1, (500,), generator=torch.Generator().manual_seed(5))
    assert owner_rank_hash(keys, world).tolist() == [owner_hash(k, world) for k in keys.tolist()]
    assert routes_to_first(keys, 640, 2176).tolist() == [
        py_first(k, 640, 2176) for k in keys.tolist()]


def test_unsalted_mix_is_the_bucket_hash():
    keys = torch.tensor(KEYS)
    assert mix_keys(keys).tolist() == [int(mix64(np.int64(k))) for k in KEYS]
    assert reduce_to_range(torch.tensor([-1, 0, 1 << 62]), 4).tolist() == [3, 0, 1]
