"""``write_rows``: rows written by key are what ``read_rows`` and the next forward read, bit for
bit, in every storage mode; counters, scores, optimizer state, batches in flight, refusals
that change nothing, incremental dumps, and the CUDA kernels (under numba's simulator without
a GPU). The expected rows are the ones written, or the rows read before the write."""
from __future__ import annotations

import tempfile

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from conftest import BACKENDS
from dynemb import (DynamicEmbBagCollection, DynamicEmbCollection, DynamicEmbTableOptions,
                    FrequencyAdmission, OptimizerConfig, OptimizerType, ScorePolicy, StashMode,
                    StorageMode, TableFullError)
from dynemb.checkpoint import dump, load
from dynemb.stores.backing_store import HostBackingStore

DIM = 4
ROW_BYTES = (DIM + 1) * 4  # row-wise AdaGrad: one state column
MODES = {
    StorageMode.HBM_DIRECT: dict(max_capacity=256, bucket_size=16),
    StorageMode.CACHE: dict(caching=True, global_hbm_for_values=32 * ROW_BYTES, bucket_size=16),
    StorageMode.DEFAULT: dict(global_hbm_for_values=64 * ROW_BYTES, bucket_size=16),
    StorageMode.HOST_ONLY: dict(local_hbm_for_values=0, max_capacity=256, bucket_size=16),
}
ADAGRAD = OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD, learning_rate=0.1)


def module(mode, *, backend=None, device=torch.device("cpu"), optimizer=ADAGRAD,
           dtype=torch.float32, **extra):
    config = EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=200,
                             feature_names=["f"], data_type=_data_type(dtype))
    options = DynamicEmbTableOptions(**{**MODES[mode], **extra})
    ec = DynamicEmbCollection([config], table_options=options, optimizer=optimizer,
                              backend=backend, device=device)
    assert ec.storage_modes() == {"t": mode}
    return ec


def _data_type(dtype):
    from torchrec.modules.embedding_configs import DataType
    return {torch.float32: DataType.FP32, torch.float16: DataType.FP16}[dtype]


def kjt(ids):
    ids = torch.as_tensor(ids, dtype=torch.int64)
    return KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.ones(ids.numel(),
                                                                       dtype=torch.int64))


def train(ec, ids):
    out = ec(kjt(ids))["f"].values()
    (out ** 2).sum().backward()


def snapshot(ec):
    return {k: v.clone() for k, v in ec.state_dict().items()}


def assert_same_state(before, after):
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k


@pytest.mark.parametrize("mode", list(MODES), ids=lambda m: m.name)
@pytest.mark.parametrize("with_state", [False, True], ids=["rows", "rows+state"])
def test_written_rows_read_back_and_forward_bit_for_bit(mode, with_state):
    ec = module(mode)
    trained = torch.arange(60)
    for start in range(0, 60, 12):  # a CACHE table evicts most of them to its store
        train(ec, trained[start:start + 12])
    held = torch.tensor([3, 17, 41, 59])  # CACHE: some cached, some in the store only
    new = torch.tensor([1 << 40, -7, 123, 77])
    keys = torch.cat([held, new])
    before, found = ec.read_rows("t", keys, with_state=True)
    assert found.tolist() == [True] * 4 + [False] * 4
    others = torch.arange(20, 40)
    others = others[~torch.isin(others, keys)]
    untouched = ec.read_rows("t", others, with_state=True)[0]
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(8, DIM, generator=gen)
    state = torch.rand(8, 1, generator=gen) if with_state else None
    ec.write_rows("t", keys, rows, optimizer_state=state)

    got, found = ec.read_rows("t", keys, with_state=True)
    assert bool(found.all())
    assert torch.equal(got[:, :DIM], rows)
    expected_state = state if with_state else torch.cat([before[:4, DIM:], torch.zeros(4, 1)])
    assert torch.equal(got[:, DIM:], expected_state)
    assert torch.equal(ec.read_rows("t", others, with_state=True)[0], untouched)
    stats = ec.stats()["t"]
    assert (stats["write_inserts"], stats["write_overwrites"]) == (4, 4)
    if mode is StorageMode.DEFAULT:  # both tiers took keys
        assert stats["rows_device"] and stats["rows_backing"]
    # the next forward, eval and training, reads them
    order = torch.tensor([5, 0, 7, 2, 5])
    assert torch.equal(ec.eval()(kjt(keys[order]))["f"].values(), rows[order])
    ec.train()
    out = ec(kjt(keys[order]))["f"].values()
    assert torch.equal(out.detach(), rows[order])


@pytest.mark.parametrize("mode", list(MODES), ids=lambda m: m.name)
def test_bad_input_raises_naming_it_and_changes_nothing(mode):
    ec = module(mode)
    for start in range(0, 40, 10):
        train(ec, torch.arange(start, start + 10))
    before = snapshot(ec)
    keys, rows = torch.tensor([1, 2, 300]), torch.ones(3, DIM)
    bad = [
        (dict(table="nope"), KeyError, "no table 'nope'"),
        (dict(rows=torch.ones(3, DIM + 1)), ValueError, r"shape \[3, 4\]"),
        (dict(rows=torch.ones(3, DIM, dtype=torch.float64)), ValueError, "float64"),
        (dict(keys=torch.tensor([1, 2, 1])), ValueError, "distinct, key 1"),
        (dict(keys=torch.tensor([1., 2., 3.])), ValueError, "1-D int64"),
        (dict(keys=torch.tensor([1, 2, torch.iinfo(torch.int64).min])), ValueError,
         "reserved key"),
        (dict(optimizer_state=torch.ones(3, 2)), ValueError, r"optimizer_state .*\[3, 1\]"),
        (dict(optimizer_state=torch.ones(3, 1, dtype=torch.float64)), ValueError, "float32"),
        (dict(scores=torch.ones(2, dtype=torch.int64)), ValueError, "scores"),
    ]
    for change, error, match in bad:
        args = dict(table="t", keys=keys, rows=rows, optimizer_state=None, scores=None)
        args.update(change)
        with pytest.raises(error, match=match):
            ec.write_rows(args.pop("table"), args.pop("keys"), args.pop("rows"), **args)
    assert_same_state(before, snapshot(ec))


def test_a_batch_that_does_not_fit_raises_and_changes_nothing():
    # NO_EVICTION, one bucket of 16 slots: 10 held, 8 new do not fit
    ec = module(StorageMode.HBM_DIRECT, score_strategy=ScorePolicy.NO_EVICTION,
                max_capacity=16, bucket_size=16)
    train(ec, torch.arange(10))
    before = snapshot(ec)
    with pytest.raises(TableFullError, match="2 of 8 keys found no slot"):
        ec.write_rows("t", torch.arange(100, 108), torch.ones(8, DIM))
    assert_same_state(before, snapshot(ec))
    ec.write_rows("t", torch.arange(100, 106), torch.ones(6, DIM))  # 6 fit
    assert ec.stats()["t"]["rows_device"] == 16


def test_pinned_rows_are_never_evicted_and_a_prefetched_batch_reads_the_written_row():
    sgd = OptimizerConfig(OptimizerType.SGD, learning_rate=0.5)
    ec = module(StorageMode.HBM_DIRECT, optimizer=sgd, max_capacity=16, bucket_size=16)
    ids = torch.arange(16)
    ec.prefetch(kjt(ids))  # pins all 16 slots of the one bucket
    before = snapshot(ec)
    with pytest.raises(TableFullError, match="16 pinned"):
        ec.write_rows("t", torch.tensor([99]), torch.ones(1, DIM))
    assert_same_state(before, snapshot(ec))
    written = torch.full((1, DIM), 3.0)
    ec.write_rows("t", torch.tensor([5]), written)  # held by the batch: replaced in place
    out = ec(kjt(ids))["f"].values()
    assert torch.equal(out[5], written[0])
    out.sum().backward()  # d(sum)/d(row) = 1 for each id: SGD subtracts lr * 1
    assert torch.equal(ec.read_rows("t", torch.tensor([5]))[0], written - 0.5)
    ec.write_rows("t", torch.tensor([99]), torch.ones(1, DIM))  # pins ended: it evicts
    assert ec.stats()["t"]["evictions"] == 1


def test_a_write_between_a_stashed_forward_and_its_backward_lands_in_the_rows():
    sgd = OptimizerConfig(OptimizerType.SGD, learning_rate=0.5)
    ec = module(StorageMode.HBM_DIRECT, optimizer=sgd, stash=StashMode.ALL)
    ids = torch.tensor([1, 2, 3])
    out = ec(kjt(ids))["f"].values()  # the rows go to host memory until the backward
    assert ec.memory_stash is not None
    written = torch.full((2, DIM), 4.0)
    ec.write_rows("t", torch.tensor([2, 9]), written)  # brings them back first
    out.sum().backward()
    rows, found = ec.read_rows("t", torch.tensor([2, 9]))
    assert bool(found.all())
    assert torch.equal(rows, torch.stack([written[0] - 0.5, written[1]]))


def test_a_cache_store_that_would_forget_rows_refuses_the_write():
    def small_store(width, dtype, device):
        return HostBackingStore(width, dtype, device, initial_capacity=128, max_capacity=128)
    ec = module(StorageMode.CACHE, backing_store=small_store)
    train(ec, torch.arange(8))
    before = snapshot(ec)
    with pytest.raises(TableFullError, match="takes 96 more rows"):
        ec.write_rows("t", torch.arange(1000, 1100), torch.ones(100, DIM))
    assert_same_state(before, snapshot(ec))
    ec.write_rows("t", torch.arange(1000, 1090), torch.ones(90, DIM))
    assert ec.stats()["t"]["rows_backing"] == 90


def test_scores_kept_for_held_keys_one_use_for_new_ones_or_given_exactly():
    ec = module(StorageMode.HBM_DIRECT, score_strategy=ScorePolicy.LFU)
    train(ec, torch.tensor([1, 1, 1, 2]))  # counts 3 and 1
    hash_table = ec.tables["t"].tier.hash

    def scores(keys):
        return hash_table.scores_at(hash_table.find(torch.tensor(keys))).tolist()
    ec.write_rows("t", torch.tensor([1, 2, 9]), torch.zeros(3, DIM))
    assert scores([1, 2, 9]) == [3, 1, 1]
    ec.write_rows("t", torch.tensor([2, 10]), torch.zeros(2, DIM),
                  scores=torch.tensor([40, 7]))
    assert scores([1, 2, 9, 10]) == [3, 40, 1, 7]


def test_a_customized_table_takes_given_scores_or_the_module_score():
    ec = module(StorageMode.HBM_DIRECT, score_strategy=ScorePolicy.CUSTOMIZED)
    with pytest.raises(ValueError, match="CUSTOMIZED: pass scores"):
        ec.write_rows("t", torch.tensor([1]), torch.zeros(1, DIM))
    ec.set_scores({"t": 55})
    ec.write_rows("t", torch.tensor([1]), torch.zeros(1, DIM))
    ec.write_rows("t", torch.tensor([2]), torch.zeros(1, DIM), scores=torch.tensor([9]))
    hash_table = ec.tables["t"].tier.hash
    assert hash_table.scores_at(hash_table.find(torch.tensor([1, 2]))).tolist() == [55, 9]


def test_written_ids_bypass_admission_and_train_at_once():
    sgd = OptimizerConfig(OptimizerType.SGD, learning_rate=0.5)
    ec = module(StorageMode.HBM_DIRECT, optimizer=sgd,
                admission=FrequencyAdmission(threshold=3))
    written = torch.full((1, DIM), 2.0)
    ec.write_rows("t", torch.tensor([11]), written)
    assert ec.stats()["t"]["admission_pending"] == 0
    out = ec(kjt([11, 12]))["f"].values()  # 11 is stored: trained; 12 waits for admission
    assert torch.equal(out[0], written[0])
    out.sum().backward()
    rows, found = ec.read_rows("t", torch.tensor([11, 12]))
    assert found.tolist() == [True, False] and torch.equal(rows[0], written[0] - 0.5)


def test_a_growing_table_grows_to_take_the_rows():
    ec = module(StorageMode.HBM_DIRECT, init_capacity=32, max_capacity=1024)
    keys = torch.arange(0, 3000, 10)
    rows = torch.randn(keys.numel(), DIM)
    ec.write_rows("t", keys, rows)
    assert ec.stats()["t"]["device_capacity"] > 32
    got, found = ec.read_rows("t", keys)
    assert bool(found.all()) and torch.equal(got, rows)


def test_half_rows_and_adam_state_bit_for_bit():
    adam = OptimizerConfig(OptimizerType.ADAM, learning_rate=0.01)
    ec = module(StorageMode.HBM_DIRECT, optimizer=adam, dtype=torch.float16)
    keys = torch.tensor([4, 8, 15])
    rows = torch.randn(3, DIM).half()
    state = torch.randn(3, 2 * DIM)
    ec.write_rows("t", keys, rows, optimizer_state=state)
    assert torch.equal(ec.read_rows("t", keys)[0], rows)
    assert torch.equal(ec.read_rows("t", keys, with_state=True)[0][:, DIM:], state)
    with pytest.raises(ValueError, match="rows are torch.float32, the table holds"):
        ec.write_rows("t", keys, rows.float())


def test_a_parameter_writes_its_values():
    ec = module(StorageMode.HBM_DIRECT)
    weight = torch.nn.Parameter(torch.randn(3, DIM))
    ec.write_rows("t", torch.tensor([1, 2, 3]), weight)
    assert torch.equal(ec.read_rows("t", torch.tensor([1, 2, 3]))[0], weight.detach())


def test_a_bag_collection_pools_the_written_rows():
    config = EmbeddingBagConfig(name="t", embedding_dim=DIM, num_embeddings=64,
                                feature_names=["f"])
    ebc = DynamicEmbBagCollection([config], optimizer=ADAGRAD)
    rows = torch.arange(12, dtype=torch.float32).reshape(3, DIM)
    ebc.write_rows("t", torch.tensor([10, 20, 30]), rows)
    features = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([10, 30, 20]),
                                                   torch.tensor([2, 1]))
    pooled = ebc.eval()(features)["f"]
    assert torch.equal(pooled, torch.stack([rows[0] + rows[2], rows[1]]))


@pytest.mark.parametrize("mode", [StorageMode.HBM_DIRECT, StorageMode.CACHE,
                                  StorageMode.DEFAULT], ids=lambda m: m.name)
def test_an_incremental_dump_after_a_write_holds_the_written_rows(mode):
    ec = module(mode)
    for start in range(0, 48, 12):
        train(ec, torch.arange(start, start + 12))
    root = tempfile.mkdtemp()
    full = dump(ec, f"{root}/full")
    keys = torch.tensor([2, 30, 47, 500, 501])
    rows = torch.randn(5, DIM)
    ec.write_rows("t", keys, rows)
    delta = dump(ec, f"{root}/delta", since=full)
    assert delta.kind == "delta" and delta.rows >= 5
    fresh = module(mode)
    load(fresh, [f"{root}/full", f"{root}/delta"])
    got, found = fresh.read_rows("t", keys)
    assert bool(found.all()) and torch.equal(got, rows)
    every = torch.arange(48)
    assert torch.equal(fresh.read_rows("t", every, with_state=True)[0],
                       ec.read_rows("t", every, with_state=True)[0])


CUDA_DEVICE = torch.device(BACKENDS[1][1])  # a GPU, or the simulator on the CPU


@pytest.mark.parametrize("mode", list(MODES), ids=lambda m: m.name)
def test_the_cuda_kernels_write_the_same_rows(mode):
    ec = module(mode, backend="cuda", device=CUDA_DEVICE, score_strategy=ScorePolicy.LRU)
    assert ec.tables["t"].kernels.name == "cuda"
    keys = torch.tensor([3, 9, 1 << 33, 70])
    rows = torch.randn(4, DIM)
    ec.write_rows("t", keys, rows, optimizer_state=torch.ones(4, 1))
    got, found = ec.read_rows("t", keys.to(CUDA_DEVICE), with_state=True)
    assert bool(found.all())
    assert torch.equal(got.cpu(), torch.cat([rows, torch.ones(4, 1)], 1))
    out = ec.eval()(kjt(keys).to(CUDA_DEVICE))["f"].values()
    assert torch.equal(out.cpu(), rows)
    assert ec.stats()["t"]["write_inserts"] == 4


def test_the_cuda_kernels_refuse_a_batch_that_does_not_fit():
    ec = module(StorageMode.HBM_DIRECT, backend="cuda", device=CUDA_DEVICE,
                score_strategy=ScorePolicy.NO_EVICTION, max_capacity=16, bucket_size=16)
    ec.write_rows("t", torch.arange(12), torch.ones(12, DIM))
    before = snapshot(ec)
    with pytest.raises(TableFullError, match="found no slot"):
        ec.write_rows("t", torch.arange(50, 56), torch.ones(6, DIM))
    assert_same_state(before, snapshot(ec))


@pytest.mark.parametrize("host_cache_bytes", [0, 64 * 1024], ids=["disk", "host+disk"])
def test_a_cache_table_on_disk_takes_the_rows_in_its_store(tmp_path, host_cache_bytes):
    pytest.importorskip("rocksdict")
    from dynemb.stores.disk_levels import disk_store
    ec = module(StorageMode.CACHE,
                backing_store=disk_store(tmp_path, host_cache_bytes=host_cache_bytes))
    for start in range(0, 60, 12):  # most rows go down to the disk store
        train(ec, torch.arange(start, start + 12))
    keys = torch.cat([torch.arange(0, 60, 5), torch.arange(5000, 5300)])
    before = ec.read_rows("t", keys, with_state=True)[0]
    rows = torch.randn(keys.numel(), DIM)
    ec.write_rows("t", keys, rows)
    got, found = ec.read_rows("t", keys, with_state=True)
    assert bool(found.all()) and torch.equal(got[:, :DIM], rows)
    held = keys < 60
    assert torch.equal(got[held, DIM:], before[held, DIM:])  # their state kept
    assert torch.equal(got[~held, DIM:], torch.zeros(int((~held).sum()), 1))
    assert ec.stats()["t"]["rows_backing"] >= 300
    order = torch.tensor([3, 200, 0, 311])
    assert torch.equal(ec.eval()(kjt(keys[order]))["f"].values(), rows[order])
