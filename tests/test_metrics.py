"""Metrics over time (dynemb.metrics): each interval's counters equal the difference of the
``stats()`` totals at its ends (read independently, per table), the hit rate and load factor
are computed from them by hand, intervals neither overlap nor lose counts, a load starts a
table over, a sharded model's metric is the sum over its ranks; the TensorBoard writer
writes what it is given (a fake writer: the suite needs no TensorBoard) and names the extra
to install when TensorBoard is missing."""
import math
import sys

import pytest
import torch

from checkpoint_files_models import make
from checkpoint_models import batches, train
from conftest import BACKENDS
from dynemb.metrics import DynamicTableMetrics, TensorBoardWriter
from dynemb.metrics import tensorboard as tensorboard_module
from dynemb.metrics.table_metrics import COUNTED

KJTS = batches(24, seed=3, batch=12)


def expected(before, after):
    """The interval's values from two ``stats()`` readings, computed here."""
    out = {}
    for table in after:
        b, a = before[table], after[table]
        diff = {name: a[name] - b[name] for name in COUNTED}
        for name, value in diff.items():
            out[f"{table}/{name}"] = value
        looked_up = diff["hits"] + diff["misses"]
        out[f"{table}/hit_rate"] = diff["hits"] / looked_up if looked_up else math.nan
        out[f"{table}/load_factor"] = a["rows_device"] / a["device_capacity"]
        out[f"{table}/rows_device"] = a["rows_device"]
        out[f"{table}/rows_backing"] = a["rows_backing"]
    return out


def assert_matches(computed, reference):
    assert set(computed) == set(reference)
    for key, value in reference.items():
        got = float(computed[key])
        if isinstance(value, float) and math.isnan(value):
            assert math.isnan(got), key
        else:
            assert got == pytest.approx(value, rel=1e-12), key


@pytest.mark.parametrize("mode,backend,admission", [
    ("cache", "cpu", True), ("default", "cpu", False), ("hbm_direct", "cpu", False),
    ("cache", "cuda", False)])
def test_each_interval_is_the_difference_of_the_stats_totals(mode, backend, admission):
    ec = make(mode, "adagrad", evicting=True, admission=admission, backend=backend,
              device=torch.device(dict(BACKENDS)[backend]))
    train(ec, [k.to(ec.device) for k in KJTS[:2]])  # totals before the metric exists
    metric = DynamicTableMetrics(ec)
    before = ec.stats()
    seen = {name: 0 for name in COUNTED}
    for lo, hi in ((2, 9), (9, 10), (10, 18)):
        train(ec, [k.to(ec.device) for k in KJTS[lo:hi]])
        if hi == 9:  # rows expired count in their interval
            assert sum(ec.expire(where=lambda keys, scores: keys % 3 == 0).values()) > 0
        metric.update(ec)
        after = ec.stats()
        computed = metric.compute()
        assert_matches(computed, expected(before, after))
        metric.reset()
        before = after
        for name in COUNTED:
            seen[name] += int(computed[f"t0/{name}"])
    totals = ec.stats()["t0"]
    start = make(mode, "adagrad", evicting=True, admission=admission, backend=backend,
                 device=torch.device(dict(BACKENDS)[backend]))
    train(start, [k.to(start.device) for k in KJTS[:2]])
    assert seen == {n: totals[n] - start.stats()["t0"][n] for n in COUNTED}
    assert seen["expired"] > 0
    moved = "admission_rejects" if admission else "evictions" if mode != "cache" else \
        "write_backs"
    assert seen[moved] > 0 and seen["hits"] > 0 and seen["misses"] > 0


def test_updates_within_an_interval_add_up_and_sizes_are_the_last_ones():
    ec = make("hbm_direct", evicting=True)
    metric = DynamicTableMetrics(ec)
    before = ec.stats()
    for lo in range(0, 6, 2):
        train(ec, KJTS[lo:lo + 2])
        metric.update(ec)
    assert_matches(metric.compute(), expected(before, ec.stats()))
    metric.reset()
    with pytest.warns(UserWarning, match="called before the ``update`` method"):
        empty = metric.compute()  # torchmetrics says so; zero counts, NaN hit rate
    assert int(empty["t0/lookups"]) == 0 and math.isnan(float(empty["t0/hit_rate"]))


def test_a_load_starts_the_table_over():
    ec = make("hbm_direct")
    train(ec, KJTS[:6])
    saved = ec.state_dict()
    metric = DynamicTableMetrics(ec)
    train(ec, KJTS[6:10])
    ec.load_state_dict(saved)  # its counters go back to those saved
    metric.update(ec)
    computed = metric.compute()
    assert all(int(computed[f"{t}/{n}"]) == 0 for t in ("t0", "t1") for n in COUNTED)
    metric.reset()
    before = ec.stats()
    train(ec, KJTS[10:12])
    metric.update(ec)
    assert_matches(metric.compute(), expected(before, ec.stats()))


def test_a_model_of_other_tables_is_refused():
    ec = make("hbm_direct")
    metric = DynamicTableMetrics(torch.nn.ModuleDict({"sparse": ec}))
    assert metric.table_keys == ["sparse/t0", "sparse/t1"]
    with pytest.raises(ValueError, match=r"tables \['t0', 't1'\] are not the tables this "
                                         r"metric was built for"):
        metric.update(ec)
    with pytest.raises(TypeError, match="Linear holds no dynamic embedding module"):
        DynamicTableMetrics(torch.nn.Linear(2, 2))


def test_a_sharded_model_is_summed_over_its_ranks():
    from examples.spawn import run_on_ranks
    from tests.metrics_worker import run
    ranks = run_on_ranks(2, run, timeout=600)
    per_rank = [r["totals"] for r in ranks]
    for interval in range(2):
        before = {t: {n: sum(r[interval][t][n] for r in per_rank)
                      for n in COUNTED + ("rows_device", "device_capacity",
                                                "rows_backing")}
                  for t in per_rank[0][0]}
        after = {t: {n: sum(r[interval + 1][t][n] for r in per_rank) for n in before[t]}
                 for t in before}
        reference = {f"dyn/{k}": v for k, v in expected(before, after).items()}
        for rank in ranks:  # every rank computes the reduced values
            assert_matches(rank["computed"][interval], reference)
    # the load factor is the summed rows over the summed capacities, not a mean of ratios
    last = {t: {n: sum(r[-1][t][n] for r in per_rank) for n in ("rows_device",
                                                               "device_capacity")}
            for t in per_rank[0][-1]}
    for t, sums in last.items():
        assert ranks[0]["computed"][-1][f"dyn/{t}/load_factor"] == pytest.approx(
            sums["rows_device"] / sums["device_capacity"])
        assert ranks[0]["local"][f"dyn/{t}/rows_device"] == per_rank[0][-1][t]["rows_device"]
    assert sum(ranks[0]["computed"][i]["dyn/t1/write_backs"] for i in range(2)) > 0


class FakeWriter:
    def __init__(self):
        self.points, self.flushes, self.closed = [], 0, False

    def add_scalar(self, tag, value, global_step):
        self.points.append((tag, value, global_step))

    def flush(self):
        self.flushes += 1

    def close(self):
        self.closed = True


def test_the_tensorboard_writer_writes_each_value_at_its_step():
    ec = make("cache", evicting=True)
    metric = DynamicTableMetrics(ec)
    fake = FakeWriter()
    board = TensorBoardWriter(writer=fake, prefix="emb")
    for step in (5, 10):
        train(ec, KJTS[step - 5:step])
        metric.update(ec)
        values = metric.compute()
        board.write(values, step)
        metric.reset()
        written = {tag: v for tag, v, s in fake.points if s == step}
        assert written == {f"emb/{k}": float(v) for k, v in values.items()}
    assert fake.flushes == 2
    board.write({"t0/hit_rate": torch.tensor(float("nan")), "t0/hits": 0}, step=11)
    assert fake.points[-1] == ("emb/t0/hits", 0.0, 11)  # the NaN is left out
    board.close()
    assert fake.closed


def test_the_tensorboard_writer_names_the_extra_when_tensorboard_is_missing(monkeypatch,
                                                                            tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(ImportError, match=r"pip install 'dynemb\[metrics\]'"):
        TensorBoardWriter(tmp_path)
    with pytest.raises(ValueError, match="either log_dir or writer"):
        TensorBoardWriter()
    with pytest.raises(ValueError, match="either log_dir or writer"):
        TensorBoardWriter(tmp_path, writer=FakeWriter())
    with pytest.raises(TypeError, match="add_scalar"):
        TensorBoardWriter(writer=object())
    assert tensorboard_module.EXTRA in str(
        pytest.raises(ImportError, tensorboard_module.summary_writer, tmp_path).value)


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_keys_refused_a_slot_count_in_their_interval(backend):
    # 40 distinct keys in one batch of a table of 32 rows: 8 find no slot (the batch pins
    # the others). The host kernels raise at once; the CUDA kernels at the next prefetch.
    from torchrec import EmbeddingConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig,
                        TableFullError)
    device = torch.device(dict(BACKENDS)[backend])
    ec = DynamicEmbCollection(
        [EmbeddingConfig(name="z", embedding_dim=4, num_embeddings=4096, feature_names=["f"])],
        table_options=DynamicEmbTableOptions(max_capacity=32, bucket_size=32),
        optimizer=OptimizerConfig(), backend=backend, device=device)
    metric = DynamicTableMetrics(ec)

    def step(ids):
        kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor(ids),
                                                  torch.tensor([len(ids)])).to(device)
        ec(kjt)["f"].values().sum().backward()

    with pytest.raises(TableFullError):
        step(list(range(100, 140)))
        step([1])  # CUDA: reported here
    metric.update(ec)
    assert int(metric.compute()["z/refused"]) == 8 == ec.stats()["z"]["refused"]
    metric.reset()
    step([100])
    metric.update(ec)
    assert int(metric.compute()["z/refused"]) == 0
