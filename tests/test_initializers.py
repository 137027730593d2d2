"""Initializers: rows equal the documented counter-based streams (recomputed with Python
ints in tests/key_reference.py), depend only on (seed, table, key), and follow their
distributions."""
import math

import pytest
import torch

from dynemb import Initializer, InitializerKind
from dynemb.rows.initializers import table_identity
from key_reference import initial_rows


def rows(init, keys, backend, dim=8, seed=7, table_id=3):
    name, device = backend
    return init.rows(torch.as_tensor(keys, dtype=torch.int64, device=device), dim, seed=seed,
                     table_id=table_id, backend=name).cpu()


ALL = [Initializer(InitializerKind.NORMAL, mean=0.5, std=2.0),
       Initializer.truncated_normal(0.0, 1.0),
       Initializer(InitializerKind.UNIFORM, low=-1.0, high=3.0),
       Initializer(InitializerKind.CONSTANT, value=0.25)]
#: keys with every kind of bit pattern: small, negative, near both ends of int64
KEYS = [0, 1, 2, 42, -1, -3, 2**62 + 3, -(2**63) + 2, 2**63 - 1]


@pytest.mark.parametrize("init", ALL, ids=lambda i: i.kind.value)
@pytest.mark.parametrize("seed, table_id", [(7, 3), (0, table_identity("t")), (-5, 2**63 - 1)])
def test_rows_equal_the_python_reference(init, seed, table_id, backend):
    got = rows(init, KEYS, backend, seed=seed, table_id=table_id)
    want = torch.tensor(initial_rows(init, KEYS, 8, seed=seed, table_id=table_id))
    # float64 log / cos of another math library may move a float32 result by one ulp
    torch.testing.assert_close(got, want, rtol=2e-7, atol=1e-7)


def test_truncated_normal_redraws_out_of_range_values():
    # bounds at -+ 0.5 std reject most draws: every column takes a redraw, none is clamped
    init = Initializer(InitializerKind.TRUNCATED_NORMAL, mean=1.0, std=2.0, low=0.0, high=2.0)
    got = rows(init, range(64), ("cpu", "cpu"), dim=16)
    torch.testing.assert_close(
        got, torch.tensor(initial_rows(init, range(64), 16, seed=7, table_id=3)))
    assert ((got > 0.0) & (got < 2.0)).all() and got.unique().numel() == got.numel()


@pytest.mark.parametrize("init", ALL, ids=lambda i: i.kind.value)
def test_same_key_same_row_whatever_the_batch(init, backend):
    a = rows(init, [11, 12, 13, -(2**62)], backend)
    b = rows(init, [13, -(2**62), 11, 12, 11], backend)
    assert torch.equal(a[[2, 3, 0, 1, 0]], b)


@pytest.mark.parametrize("init", ALL[:3], ids=lambda i: i.kind.value)
def test_seed_table_and_key_each_change_the_row(init):
    cpu = ("cpu", "cpu")
    first = rows(init, [1, 2, 3], cpu)
    assert not torch.equal(first, rows(init, [1, 2, 3], cpu, seed=8))
    assert not torch.equal(first, rows(init, [1, 2, 3], cpu, table_id=4))
    assert not torch.equal(first[0], first[1])


def test_distributions_match_their_parameters():
    cpu = ("cpu", "cpu")
    keys = list(range(20000))
    normal = rows(Initializer(InitializerKind.NORMAL, mean=0.5, std=2.0), keys, cpu, dim=16)
    assert abs(normal.mean().item() - 0.5) < 0.03 and abs(normal.std().item() - 2.0) < 0.03
    trunc = rows(Initializer.truncated_normal(0.0, 1.0), keys, cpu, dim=16)
    assert trunc.min() >= -2.0 and trunc.max() <= 2.0
    # Standard normal truncated to [-2, 2] has std 0.8796.
    assert abs(trunc.std().item() - 0.8796) < 0.01 and abs(trunc.mean().item()) < 0.01
    uni = rows(Initializer(InitializerKind.UNIFORM, low=-1.0, high=3.0), keys, cpu, dim=16)
    assert uni.min() >= -1.0 and uni.max() < 3.0
    assert abs(uni.mean().item() - 1.0) < 0.02 and abs(uni.var().item() - 16 / 12) < 0.03
    const = rows(Initializer(InitializerKind.CONSTANT, value=0.25), keys[:10], cpu)
    assert (const == 0.25).all()


def test_truncated_normal_default_bounds_are_two_std():
    init = Initializer.truncated_normal(mean=1.0, std=0.5)
    assert (init.kind, init.mean, init.std, init.low, init.high) == (
        InitializerKind.TRUNCATED_NORMAL, 1.0, 0.5, 0.0, 2.0)


def test_table_identity_is_pinned():
    # the 64-bit blake2b digest of the name, little-endian, top bit cleared: a table's
    # initial rows depend on it, so it never changes
    assert table_identity("t") == 6256752092847567818
    assert table_identity("users") == 4494661601655233416
    assert table_identity("items") == 783256193915330580
    for bad in ("", None, 3):
        with pytest.raises(ValueError, match="non-empty str"):
            table_identity(bad)


@pytest.mark.parametrize("kwargs,message", [
    (dict(kind="normal"), "kind must be an InitializerKind"),
    (dict(kind=InitializerKind.NORMAL, std=-1.0), "std must be >= 0"),
    (dict(kind=InitializerKind.UNIFORM, low=1.0, high=1.0), "low"),
    (dict(kind=InitializerKind.CONSTANT, value=math.nan), "value must be a finite number"),
])
def test_bad_initializer(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        Initializer(**kwargs)


@pytest.mark.parametrize("dim", [1, 7, 16])
def test_normal_rows_of_any_width_equal_the_reference(dim, backend):
    """The CPU kernels fill NORMAL rows two columns (one Box-Muller pair) at a time; an odd
    last column comes from the pair's first value, as element by element."""
    init = Initializer(InitializerKind.NORMAL, mean=-0.5, std=3.0)
    got = rows(init, KEYS, backend, dim=dim)
    want = torch.tensor(initial_rows(init, KEYS, dim, seed=7, table_id=3))
    torch.testing.assert_close(got, want, rtol=2e-7, atol=1e-7)


def test_the_two_values_of_a_normal_pair_are_uncorrelated():
    normal = rows(Initializer(InitializerKind.NORMAL), list(range(20000)), ("cpu", "cpu"),
                  dim=2)
    assert abs(torch.corrcoef(normal.T)[0, 1].item()) < 0.03
