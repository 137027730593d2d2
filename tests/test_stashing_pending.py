"""Memory stashing without anything standing in for the rows, on the CPU and the CUDA kernels
(numba's simulator where there is no GPU), checked against hand-computed rows: every row starts at 1.0 (a constant initializer) and the loss is the sum of
the looked-up values, so SGD moves a key's row by ``-lr * (its occurrences in the batch)``,
exactly (float32 and float16).

- while the rows are away, each table's flat table is its own, its tensor the same object,
  empty; the counters and sizes answer as before;
- a batch prefetched while the rows are away (the prefetch pipeline) claims its slots then;
  its new rows are written when the rows come back: right after the restore they hold the
  initializer's values, and the batch trains from them;
- right after a restore the rows of the batch awaiting its backward are the rows its forward
  read, and its backward updates them;
- the services that read a module's tables (here the serving export) bring the rows back.
"""
import pytest
import torch
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, Initializer, InitializerKind,
                    OptimizerConfig, OptimizerType)
from dynemb.options import StashMode
from dynemb.rows.flat_table import FlatTable
from dynemb.serving import iter_rows
from dynemb.stashing import restore

LR = 0.25
DIM = 4
NAMES = ("t0", "t1")


def _collection(group_tables=True, dtype=None, backend=("cpu", "cpu")):
    configs = [EmbeddingConfig(name=name, embedding_dim=DIM, num_embeddings=64,
                               feature_names=[f"f{i}"]) for i, name in enumerate(NAMES)]
    options = {name: DynamicEmbTableOptions(
        max_capacity=64, bucket_size=16, stash=StashMode.ALL, embedding_dtype=dtype,
        initializer=Initializer(InitializerKind.CONSTANT, value=1.0)) for name in NAMES}
    return DynamicEmbCollection(configs, table_options=options,
                                optimizer=OptimizerConfig(OptimizerType.SGD, learning_rate=LR),
                                group_tables=group_tables, backend=backend[0],
                                device=torch.device(backend[1]))


def _batch(f0, f1, device="cpu"):
    return KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.tensor(f0 + f1),
                                               torch.tensor([len(f0), len(f1)])).to(device)


def _loss(out):
    return sum(jt.values().float().sum() for jt in out.values())


def _rows(ec, name, keys):
    rows, found = ec.read_rows(name, torch.tensor(keys, device=ec.device))
    assert bool(found.all()), (name, keys)
    return rows.float().cpu()


def _full(value, n=1):
    return torch.full((n, DIM), float(value))


# batch one: t0 reads 3 twice and 7, t1 reads 5 three times; batch two (new keys but 3)
ONE = ([3, 7, 3], [5, 5, 5])
TWO = ([11, 3], [20, 21, 20])


@pytest.mark.parametrize("group_tables", [True, False], ids=["grouped", "alone"])
def test_nothing_stands_in_for_the_rows_while_they_are_away(group_tables, backend):
    ec = _collection(group_tables, backend=backend)
    _loss(ec(_batch(*ONE, device=backend[1]))).backward()
    flats = {n: ec.tables[n].tier.flat for n in NAMES}
    tensors = {n: flat.weights for n, flat in flats.items()}
    out = ec(_batch(*ONE, device=backend[1]))
    assert ec.memory_stash.stashed == list(NAMES)
    for name in NAMES:
        flat = ec.tables[name].tier.flat
        assert type(flat) is FlatTable and flat is flats[name]
        assert flat.weights is tensors[name] and flat.weights.shape == (0, DIM)
        assert flat.weights.untyped_storage().nbytes() == 0
    stats = ec.stats()  # counters and sizes: the rows stay away
    assert [(stats[n]["rows_device"], stats[n]["device_capacity"]) for n in NAMES] == [
        (2, 64), (1, 64)]
    assert ec.memory_stash.stashed == list(NAMES)
    _loss(out).backward()
    for name in NAMES:
        assert ec.tables[name].tier.flat.weights is tensors[name]
    assert torch.equal(_rows(ec, "t0", [3, 7]), torch.cat([_full(1 - 4 * LR), _full(1 - 2 * LR)]))
    assert torch.equal(_rows(ec, "t1", [5]), _full(1 - 6 * LR))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("group_tables", [True, False], ids=["grouped", "alone"])
def test_a_batch_prefetched_while_the_rows_are_away(group_tables, dtype, backend):
    ec = _collection(group_tables, dtype, backend)
    device = backend[1]
    stash = ec.memory_stash.table_stashes()["t0"]
    out = ec(_batch(*ONE, device=device))
    assert ec.memory_stash.stashed == list(NAMES)
    ec.prefetch(_batch(*TWO, device=device))  # claims 11 (t0), 20 and 21 (t1) while away
    assert ec.memory_stash.stashed == list(NAMES)  # nothing brought them back
    assert stash.replayed_inits == 0 and stash.restores_on_access == 0
    assert ec.stats()["t1"]["rows_device"] == 3
    # right after the restore: the pending lookup's rows are what its forward read, the
    # prefetched batch's new rows the initializer's
    restore(ec)
    assert stash.replayed_inits > 0 and stash.restores_on_access == 0
    for f in ("f0", "f1"):
        assert torch.equal(out[f].values().float().cpu(), _full(1.0, len(ONE[int(f[1])])))
    assert torch.equal(_rows(ec, "t0", [3, 7, 11]), _full(1.0, 3))
    assert torch.equal(_rows(ec, "t1", [5, 20, 21]), _full(1.0, 3))
    _loss(out).backward()  # 3 twice, 7 once, 5 three times
    assert torch.equal(_rows(ec, "t0", [3, 7, 11]),
                       torch.cat([_full(1 - 2 * LR), _full(1 - LR), _full(1.0)]))
    assert torch.equal(_rows(ec, "t1", [5, 20, 21]),
                       torch.cat([_full(1 - 3 * LR), _full(1.0, 2)]))
    out = ec(_batch(*TWO, device=device))  # the prefetched batch: it reads the rows as now
    assert torch.equal(out["f0"].values().float().cpu(),
                       torch.cat([_full(1.0), _full(1 - 2 * LR)]))
    assert torch.equal(out["f1"].values().float().cpu(), _full(1.0, 3))
    _loss(out).backward()  # 11 once, 3 once more; 20 twice, 21 once
    assert torch.equal(_rows(ec, "t0", [3, 7, 11]),
                       torch.cat([_full(1 - 3 * LR), _full(1 - LR), _full(1 - LR)]))
    assert torch.equal(_rows(ec, "t1", [5, 20, 21]),
                       torch.cat([_full(1 - 3 * LR), _full(1 - 2 * LR), _full(1 - LR)]))
    assert (stash.stashes, stash.restores, stash.restores_on_access) == (2, 2, 0)


def test_the_serving_export_brings_the_rows_back():
    ec = _collection()
    out = ec(_batch(*ONE))
    assert ec.memory_stash.stashed == list(NAMES)
    chunks = list(iter_rows(ec, "t1"))
    assert ec.memory_stash.stashed == []
    assert [keys.tolist() for keys, _ in chunks] == [[5]]
    assert torch.equal(chunks[0][1], _full(1.0))
    _loss(out).backward()
    assert torch.equal(_rows(ec, "t1", [5]), _full(1 - 3 * LR))


def test_rows_in_place_before_reading_a_table_directly():
    """A table's own methods read its tensors as they are: while away, empty. The module's
    ``rows_in_place()`` brings them back first (its own methods call it)."""
    ec = _collection()
    out = ec(_batch(*ONE))
    assert ec.tables["t0"].tier.flat.weights.shape == (0, DIM)
    ec.rows_in_place()
    assert ec.memory_stash.stashed == []
    assert ec.memory_stash.table_stashes()["t0"].restores_on_access == 1
    rows, found = ec.tables["t0"].read_rows(torch.tensor([3, 7]))
    assert bool(found.all()) and torch.equal(rows, _full(1.0, 2))
    _loss(out).backward()
    assert torch.equal(_rows(ec, "t0", [3, 7]), torch.cat([_full(1 - 2 * LR), _full(1 - LR)]))
