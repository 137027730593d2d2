"""Initializers are deterministic per (seed, table, key) and follow their distributions."""
import math

import pytest
import torch

from dynemb import FlatTable, Initializer, InitializerKind, ScoredHashTable


def rows(init, keys, backend, dim=8, seed=7, table_id=3):
    name, device = backend
    return init.rows(torch.as_tensor(keys, dtype=torch.int64, device=device), dim, seed=seed,
                     table_id=table_id, backend=name).cpu()


ALL = [Initializer(InitializerKind.NORMAL, mean=0.5, std=2.0),
       Initializer.truncated_normal(0.0, 1.0),
       Initializer(InitializerKind.UNIFORM, low=-1.0, high=3.0),
       Initializer(InitializerKind.CONSTANT, value=0.25)]


@pytest.mark.parametrize("init", ALL, ids=lambda i: i.kind.value)
def test_same_key_same_row_whatever_the_batch(init, backend):
    a = rows(init, [11, 12, 13, -(2**62)], backend)
    b = rows(init, [13, -(2**62), 11, 12, 11], backend)
    assert torch.equal(a[[2, 3, 0, 1, 0]], b)


@pytest.mark.parametrize("init", ALL[:3], ids=lambda i: i.kind.value)
def test_backends_agree_and_seed_and_table_matter(init):
    from conftest import BACKENDS
    cpu, cuda = (rows(init, [1, 2, 3], b) for b in BACKENDS)
    torch.testing.assert_close(cpu, cuda, rtol=1e-6, atol=1e-6)
    assert not torch.equal(cpu, rows(init, [1, 2, 3], BACKENDS[0], seed=8))
    assert not torch.equal(cpu, rows(init, [1, 2, 3], BACKENDS[0], table_id=4))


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


@pytest.mark.parametrize("kwargs,message", [
    (dict(kind="normal"), "kind must be an InitializerKind"),
    (dict(kind=InitializerKind.NORMAL, std=-1.0), "std must be >= 0"),
    (dict(kind=InitializerKind.UNIFORM, low=1.0, high=1.0), "low"),
    (dict(kind=InitializerKind.CONSTANT, value=math.nan), "value must be a finite number"),
])
def test_bad_initializer(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        Initializer(**kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_flat_table_rows_follow_keys_through_growth(backend, dtype):
    name, device = backend
    table = ScoredHashTable(32, bucket_size=8, device=device, backend=name)
    flat = FlatTable(32, dim=4, optimizer_state_dim=2, dtype=dtype, device=device, backend=name)
    init = Initializer(InitializerKind.NORMAL, std=1.0)
    keys = torch.arange(100, 120, device=device)
    res = table.find_or_insert(keys)
    flat.initialize(res.slots, res.keys, init, seed=1, table_id=0)
    expected = init.rows(res.keys, 4, seed=1, table_id=0, backend=name).to(dtype)
    assert torch.equal(flat.gather(res.slots), expected)
    assert (flat.gather(res.slots, with_state=True)[:, 4:] == 0).all()
    flat.scatter(res.slots[:2], torch.ones(2, 6, device=device))
    remap = table.grow(64)
    flat.remap(remap, 64)
    moved = flat.gather(table.find(res.keys), with_state=True)
    assert (moved[:2] == 1).all() and torch.equal(moved[2:, :4], expected[2:])


def test_flat_table_bad_input():
    flat = FlatTable(8, dim=4)
    with pytest.raises(ValueError, match=r"slots must lie in \[0, 8\)"):
        flat.gather(torch.tensor([8]))
    with pytest.raises(ValueError, match="rows must have shape"):
        flat.scatter(torch.tensor([1]), torch.ones(1, 3))
    with pytest.raises(TypeError, match="dtype must be one of"):
        FlatTable(8, dim=4, dtype=torch.int32)
    with pytest.raises(ValueError, match="dim must be positive"):
        FlatTable(8, dim=0)
