"""A training step that one table refuses (its buckets cannot hold the batch's keys) raises
``TableFullError`` and changes no table: every other table's claim is taken back before any
row is filled. Reference: a twin module that never saw the refused batch; both then train
on, and must stay equal bit for bit (rows, optimizer state, scores, clocks, counters)."""
from typing import Optional

import pytest
import torch
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig,
                    OptimizerType, ScorePolicy, TableFullError)

DIM = 4
ADAM = OptimizerConfig(OptimizerType.ADAM, learning_rate=0.05)
#: the table that refuses: 32 rows, fed 40 distinct ids in the refused batch
SMALL = 32
BUCKET = 32  # one bucket size: tables of one dim group


def build(tables, *, dims, caching, grouped):
    """Tables of ``tables`` ({name: rows}), one feature ``f_<name>`` each; ``dims`` per
    table. The CACHE variant keeps that many device rows over a host store: claims
    evict."""
    configs = [EmbeddingConfig(name=n, embedding_dim=dims[n], num_embeddings=4096,
                               feature_names=[f"f_{n}"]) for n in tables]
    options = {}
    for name, rows in tables.items():
        if caching:
            width = dims[name] * 3  # Adam: the row and two moments
            options[name] = DynamicEmbTableOptions(
                max_capacity=4096, caching=True, local_hbm_for_values=rows * width * 4,
                bucket_size=BUCKET, score_strategy=ScorePolicy.LFU)
        else:
            options[name] = DynamicEmbTableOptions(
                max_capacity=rows, bucket_size=BUCKET, score_strategy=ScorePolicy.LRU)
    return DynamicEmbCollection(configs, table_options=options, optimizer=ADAM,
                                group_tables=grouped)


def kjt(ids_by_feature):
    features = list(ids_by_feature)
    values = torch.tensor([i for f in features for i in ids_by_feature[f]], dtype=torch.int64)
    lengths = torch.tensor([len(ids_by_feature[f]) for f in features])
    return KeyedJaggedTensor.from_lengths_sync(features, values, lengths)


def good_batch(gen, tables, n=24):
    """``n`` ids per table out of 0..199: fits every table, evicts in the small ones."""
    return kjt({f"f_{t}": torch.randint(0, 200, (n,), generator=gen).tolist() for t in tables})


def train(ec, batch):
    out = ec(batch)
    sum((jt.values() * (1 + torch.arange(jt.values().numel(), device=jt.values().device)
                        .reshape(jt.values().shape) % 3)).sum() for jt in out.values()).backward()
    return out


def without_refused(stats):
    return {name: {k: v for k, v in s.items() if k != "refused"} for name, s in stats.items()}


def assert_same(a, b, raced: Optional[str] = None, keys: Optional[torch.Tensor] = None):
    """The twins' state bit for bit, their stats equal (but for ``refused``, the keys whose
    refusal each saw), no pin or batch left. Table
    ``raced`` is compared key by key over ``keys`` instead: in numba's simulator the threads
    of one bucket race for its last slots (Python threads, scheduled by the machine's load),
    so which keys found no slot may differ between twins; how many did, and the rows of the
    keys both hold, may not."""
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        if raced is None or f".{raced}." not in key:
            assert torch.equal(state_a[key], state_b[key]), key
    assert without_refused(a.stats()) == without_refused(b.stats())
    if raced is not None:
        rows_a, found_a = a.read_rows(raced, keys, with_state=True)
        rows_b, found_b = b.read_rows(raced, keys, with_state=True)
        assert int(found_a.sum()) == int(found_b.sum()) > 0
        both = found_a & found_b
        assert both.any()
        assert torch.equal(rows_a[both], rows_b[both])
    for module in (a, b):
        for name, table in module.tables.items():
            assert table.tier.hash.pinned_count() == 0, name
            assert not table.has_batches_in_flight(), name


CASES = {
    # the refusing table "z" is alone, after or before the others (module order)
    "alone-last": (dict(a=256, b=64, z=SMALL), dict(a=4, b=8, z=16), "z"),
    "alone-first": (dict(z=SMALL, a=256, b=64), dict(z=16, a=4, b=8), "z"),
    # "z" belongs to the group: the group's claim fails, its tables go alone, "z" refuses
    "in-group": (dict(a=256, z=SMALL, b=64), dict(a=4, z=4, b=4), "z"),
    # a group (a, b) claims first, then "z" (another dim) refuses
    "after-group": (dict(a=256, b=64, z=SMALL), dict(a=4, b=4, z=8), "z"),
}


@pytest.mark.parametrize("caching", [False, True], ids=["hbm_direct", "cache"])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "alone"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_batch_changes_no_table(case, grouped, caching):
    tables, dims, refusing = CASES[case]
    twins = [build(tables, dims=dims, caching=caching, grouped=grouped) for _ in range(2)]
    if grouped and case != "alone-first" and case != "alone-last":
        assert twins[0].table_groups(), "the case needs a group"
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        batch = good_batch(gen, tables)
        for ec in twins:
            train(ec, batch)
    # every table gets new ids (claims that insert and evict); "z" gets more than it holds
    refused = {f"f_{t}": list(range(1000, 1040 if t == refusing else 1012)) for t in tables}
    with pytest.raises(TableFullError, match=repr(refusing)) as err:
        twins[0](kjt(refused))
    assert {n: s["refused"] for n, s in twins[0].stats().items()} == {
        t: err.value.failed_keys.numel() if t == refusing else 0 for t in tables}
    if caching:
        assert sum(s["evictions"] for s in twins[0].stats().values()) > 0
    assert_same(*twins)
    for _ in range(4):  # and both train on alike
        batch = good_batch(gen, tables)
        outs = [train(ec, batch) for ec in twins]
        for name in outs[0]:
            assert torch.equal(outs[0][name].values(), outs[1][name].values())
    assert_same(*twins)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "alone"])
def test_keys_refused_on_the_cuda_kernels_raise_before_any_table_changes(grouped):
    """The CUDA kernels serve a refused key zeros and report it at a later prefetch; that
    report comes before any table of the module claims the new batch (in numba's simulator
    without a GPU)."""
    from conftest import BACKENDS
    name, device = BACKENDS[1]
    assert name == "cuda"
    configs = [EmbeddingConfig(name=n, embedding_dim=DIM, num_embeddings=4096,
                               feature_names=[f"f_{n}"]) for n in ("a", "z")]
    options = {"a": DynamicEmbTableOptions(max_capacity=256, bucket_size=BUCKET),
               "z": DynamicEmbTableOptions(max_capacity=SMALL, bucket_size=BUCKET)}
    twins = [DynamicEmbCollection(configs, table_options=options, optimizer=ADAM,
                                  backend=name, device=torch.device(device),
                                  group_tables=grouped) for _ in range(2)]
    assert twins[0].table_groups() == ([("a", "z")] if grouped else [("a",), ("z",)])
    overfull = kjt({"f_a": [1, 2, 3], "f_z": list(range(100, 100 + SMALL + 8))}).to(device)
    for ec in twins:
        train(ec, overfull)  # z: 8 keys find no slot, reported at a later prefetch
    nxt = kjt({"f_a": [4, 5, 6, 7], "f_z": [1]}).to(device)
    with pytest.raises(TableFullError, match="'z'"):
        twins[0](nxt)
    # the twin saw the same report at the same point; both go on alike
    with pytest.raises(TableFullError, match="'z'"):
        twins[1](nxt)
    z_keys = torch.arange(100, 100 + SMALL + 8, device=device)
    assert_same(*twins, raced="z", keys=z_keys)
    outs = [train(ec, nxt) for ec in twins]
    assert torch.equal(outs[0]["f_a"].values(), outs[1]["f_a"].values())
    assert_same(*twins, raced="z", keys=z_keys)
    assert twins[0].stats()["a"]["lookups"] == 3 + 4
