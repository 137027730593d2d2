"""reset_parameters(tables=[...]): the named tables go back to their initial rows (rows,
optimizer state, scores, store or host tier, admission counts, counters, step); the others
keep everything; prefetches and pins end and an older lookup cannot backward."""
import pytest
import torch
from torchrec import EmbeddingBagConfig, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbBagCollection, DynamicEmbCollection, DynamicEmbTableOptions,
                    FrequencyAdmission, StorageMode)
from table_builder import DIM, INIT, SGD

IDS = torch.arange(40, dtype=torch.int64)
OPTIONS = {
    "a": DynamicEmbTableOptions(initializer=INIT, admission=FrequencyAdmission(threshold=1)),
    "c": DynamicEmbTableOptions(initializer=INIT, caching=True, bucket_size=4,
                                local_hbm_for_values=16 * DIM * 4),
    "d": DynamicEmbTableOptions(initializer=INIT, bucket_size=4,
                                local_hbm_for_values=16 * DIM * 4),
}
FEATURES = {"a": "fa", "c": "fc", "d": "fd"}


def module(pooled, backend=("cpu", "cpu")):
    """``backend``: a (kernels, device) pair of conftest.BACKENDS."""
    kernels, device = backend[0], torch.device(backend[1])
    if pooled:
        configs = [EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=256,
                                      feature_names=[f]) for n, f in FEATURES.items()]
        return DynamicEmbBagCollection(configs, table_options=OPTIONS, optimizer=SGD,
                                       backend=kernels, device=device)
    configs = [EmbeddingConfig(name=n, embedding_dim=DIM, num_embeddings=256,
                               feature_names=[f]) for n, f in FEATURES.items()]
    return DynamicEmbCollection(configs, table_options=OPTIONS, optimizer=SGD, backend=kernels,
                                device=device)


def batch(step, device="cpu"):
    ids = [(step * 5 + i) % 40 for i in range(6)]
    return KeyedJaggedTensor.from_lengths_sync(
        list(FEATURES.values()), torch.tensor(ids * 3), torch.tensor([6, 6, 6])).to(device)


def train(ec, steps):
    for step in range(steps):
        out = ec(batch(step, ec.device))
        values = out.values() if hasattr(out, "length_per_key") else torch.cat(
            [jt.values() for jt in out.values()])
        values.sum().backward()


@pytest.mark.parametrize("pooled", [False, True], ids=["sequence", "pooled"])
def test_resetting_one_table_leaves_the_others_as_they_were(pooled, backend):
    ec = module(pooled, backend)
    ids = IDS.to(ec.device)
    assert ec.storage_modes() == {"a": StorageMode.HBM_DIRECT, "c": StorageMode.CACHE,
                                  "d": StorageMode.DEFAULT}
    fresh = module(pooled, backend)
    train(fresh, 1)
    train(ec, 12)
    assert ec.stats()["c"]["rows_backing"] > 0 and ec.stats()["d"]["rows_backing"] > 0
    kept = {n: ec.read_rows(n, ids, with_state=True) for n in ("a", "d")}
    kept_stats = {n: ec.stats()[n] for n in ("a", "d")}
    generation = ec.generation
    pending = ec(batch(12, ec.device))
    ec.prefetch(batch(13, ec.device))
    ec.reset_parameters(tables=["c"])
    assert ec.pending_prefetches == 0 and ec.generation == generation + 1
    assert ec.steps == {"a": 12, "c": 0, "d": 12}
    stats = ec.stats()["c"]
    assert (stats["rows_device"], stats["rows_backing"], stats["lookups"]) == (0, 0, 0)
    for name in ("a", "d"):
        rows, found = ec.read_rows(name, ids, with_state=True)
        assert torch.equal(found, kept[name][1]) and torch.equal(rows, kept[name][0])
        # the pending lookup and the prefetch counted, nothing else changed
        assert ec.stats()[name]["rows_device"] == kept_stats[name]["rows_device"]
    with pytest.raises(RuntimeError, match="Run a new forward"):
        (pending.values() if pooled else pending["fc"].values()).sum().backward()
    # table "c" starts over: one step gives what a fresh module's first step gives
    train(ec, 1)
    for name, table in ec.tables.items():
        assert table.tier.hash.size() > 0
    got, found = ec.read_rows("c", ids, with_state=True)
    want, want_found = fresh.read_rows("c", ids, with_state=True)
    assert torch.equal(found, want_found) and torch.equal(got[found], want[found])
    assert ec.steps["c"] == 1


def test_an_unknown_table_raises_and_nothing_changes():
    ec = module(False)
    train(ec, 2)
    ec.prefetch(batch(2))
    rows = ec.read_rows("a", IDS)[0]
    generation = ec.generation
    with pytest.raises(KeyError, match="no table 'x' to reset; tables: \\['a', 'c', 'd'\\]"):
        ec.reset_parameters(tables=["a", "x"])
    assert ec.generation == generation and ec.pending_prefetches == 1
    assert torch.equal(ec.read_rows("a", IDS)[0], rows) and ec.steps["a"] == 2


def test_a_name_alone_and_every_table():
    ec = module(False)
    train(ec, 2)
    ec.reset_parameters(tables="a")
    assert ec.steps == {"a": 0, "c": 2, "d": 2}
    ec.reset_parameters()
    assert ec.steps == {"a": 0, "c": 0, "d": 0}
    assert all(s["rows_device"] == 0 for s in ec.stats().values())
