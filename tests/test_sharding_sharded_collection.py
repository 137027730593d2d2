"""ShardedDynamicEmbCollection on a one-rank gloo world in this process: plan checks, bad
input rejected on the sending rank, indices and foreign features, the CUDA kernels, and
torch.compile. Multi-rank training against TorchRec is in tests/test_sharded.py."""
import pytest
import torch
from torchrec import EmbeddingConfig
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingPlan
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import DynamicEmbCollection, OptimizerConfig, OptimizerType
from dynemb.sharding import DynamicEmbCollectionSharder
from dynemb.sharding.sharded_collection import check_plan
from tests.torchrec_twin import ensure_single_process_group


def _tables():
    return [EmbeddingConfig(name="t0", embedding_dim=4, num_embeddings=64, feature_names=["a"]),
            EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=64, feature_names=["b"])]


@pytest.mark.parametrize("field,value,message", [
    ("sharding_type", "column_wise", "sharding type 'column_wise' is not supported"),
    ("sharding_type", "table_wise", "sharding type 'table_wise' is not supported"),
    ("compute_kernel", "fused", "compute kernel 'fused' is not supported"),
    ("ranks", [0], "must be on every rank"),
])
def test_bad_plans_name_the_table_and_the_problem(field, value, message):
    good = dict(sharding_type="row_wise", compute_kernel="customized_kernel", ranks=[0, 1])
    plan = {"t0": ParameterSharding(**good), "t1": ParameterSharding(**{**good, field: value})}
    with pytest.raises(ValueError, match=message) as err:
        check_plan(_tables(), plan, 2, "model.dyn")
    assert "'t1'" in str(err.value) and "model.dyn" in str(err.value)
    with pytest.raises(ValueError, match=r"no entry for dynamic tables \['t1'\]"):
        check_plan(_tables(), {"t0": ParameterSharding(**good)}, 2, "")


class _Wrap(torch.nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.dyn = DynamicEmbCollection(_tables(), device="meta",
                                        optimizer=OptimizerConfig(OptimizerType.SGD), **kwargs)

    def forward(self, kjt):
        return self.dyn(kjt)


def _dmp(model, plan, device=torch.device("cpu")):
    from torchrec.distributed import DistributedModelParallel
    return DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(ensure_single_process_group()),
        device=device, plan=ShardingPlan({"dyn": plan}),
        sharders=[DynamicEmbCollectionSharder()])


def test_dmp_rejects_an_unsupported_sharding_type():
    model = _Wrap()
    plan = {t.name: ParameterSharding(sharding_type="table_wise",
                                      compute_kernel="customized_kernel", ranks=[0])
            for t in _tables()}
    with pytest.raises(ValueError, match="sharding type 'table_wise' is not supported"):
        _dmp(model, plan)


def test_one_rank_module_with_indices_and_foreign_features():
    model = _Wrap(need_indices=True)
    sharder = DynamicEmbCollectionSharder()
    plan = construct_module_sharding_plan(
        model.dyn, {t.name: row_wise(compute_kernel="customized_kernel") for t in _tables()},
        sharder=sharder, local_size=1, world_size=1, device_type="cpu")
    dmp = _dmp(model, plan)
    ref = DynamicEmbCollection(_tables(), optimizer=OptimizerConfig(OptimizerType.SGD),
                               need_indices=True)
    # "other" belongs to another module sharing the KJT: ignored, as TorchRec modules do
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["a", "other", "b"], torch.tensor([7, 7, 9, 123, 10**15]), torch.tensor([2, 1, 1, 0, 1, 0]))
    out = dmp(kjt)
    expected = ref(KeyedJaggedTensor.from_lengths_sync(
        ["a", "b"], torch.tensor([7, 7, 9, 10**15]), torch.tensor([2, 1, 1, 0])))
    assert list(out.keys()) == ["a", "b"]
    for f in ("a", "b"):
        torch.testing.assert_close(out[f].values(), expected[f].values())
        assert torch.equal(out[f].lengths(), expected[f].lengths())
        assert torch.equal(out[f].weights(), expected[f].weights())
    assert dmp.module.dyn.stats()["t0"]["lookups"] == 3  # occurrences, not distinct ids


def test_bad_input_is_rejected_on_the_sending_rank():
    from dynemb.types import EMPTY_KEY
    model = _Wrap()
    plan = construct_module_sharding_plan(
        model.dyn, {t.name: row_wise(compute_kernel="customized_kernel") for t in _tables()},
        sharder=DynamicEmbCollectionSharder(), local_size=1, world_size=1, device_type="cpu")
    dmp = _dmp(model, plan)
    bad = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.tensor([1, EMPTY_KEY]),
                                              torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="ids of feature 'b'"):
        dmp(bad)
    floats = KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([1.0]), torch.tensor([1]))
    with pytest.raises(TypeError, match="ids must be int64 or int32"):
        dmp(floats)
    meta = KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([1]), torch.tensor([1]))
    with pytest.raises(ValueError, match="ids are on meta but the tables are on cpu"):
        dmp(meta.to(torch.device("meta")))
    twice = KeyedJaggedTensor.from_lengths_sync(["a", "a"], torch.tensor([1, 2]),
                                                torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="feature 'a' appears 2 times"):
        dmp(twice)
    variable = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3]),
                                 lengths=torch.tensor([1, 1, 1]),
                                 stride_per_key_per_rank=[[2], [1]])
    with pytest.raises(ValueError, match="different batch size per feature"):
        dmp(variable)
    assert dmp.module.dyn.stats()["t0"]["lookups"] == 0  # nothing reached the tables


def test_one_rank_module_on_the_cuda_kernels_matches_cpu():
    """The shard's tables on the CUDA backend (a GPU, or numba's simulator on CPU tensors
    without one)."""
    from tests.conftest import BACKENDS
    name, device = BACKENDS[1]
    device = torch.device(device)
    model = _Wrap(backend=name)
    plan = construct_module_sharding_plan(
        model.dyn, {t.name: row_wise(compute_kernel="customized_kernel") for t in _tables()},
        sharder=DynamicEmbCollectionSharder(), local_size=1, world_size=1,
        device_type=device.type)
    dmp = _dmp(model, plan, device)
    ref = DynamicEmbCollection(_tables(), optimizer=OptimizerConfig(OptimizerType.SGD))
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        lengths = torch.randint(0, 4, (4,), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            ["a", "b"], torch.randint(0, 30, (int(lengths.sum()),), generator=g), lengths)
        out, expected = dmp(kjt.to(device)), ref(kjt)
        loss = sum(out[f].values().pow(2).sum() for f in ("a", "b"))
        ref_loss = sum(expected[f].values().pow(2).sum() for f in ("a", "b"))
        torch.testing.assert_close(loss.cpu(), ref_loss)
        loss.backward()
        ref_loss.backward()
    ids = torch.arange(30)
    for t in ("t0", "t1"):
        assert dmp.module.dyn.local.tables[t].device == device
        rows, found = dmp.module.dyn.read_rows(t, ids.to(device))
        ref_rows, ref_found = ref.read_rows(t, ids)
        assert torch.equal(found.cpu(), ref_found)
        torch.testing.assert_close(rows[found].cpu(), ref_rows[ref_found])


class _WithDense(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Wrap()
        self.dense = torch.nn.Linear(4, 1)

    def forward(self, kjt):
        out = self.inner(kjt)
        return self.dense(out["a"].values()).sum() + out["b"].values().pow(2).sum()


def test_compiled_sharded_model_trains_like_the_eager_one():
    from test_module_habits import _in_a_fresh_interpreter
    _in_a_fresh_interpreter("test_sharding_sharded_collection",
                            "compiled_then_eager_sharded")


def compiled_then_eager_sharded():
    """torch.compile (backend aot_eager, to keep this cheap) of a DMP model: the sharded module
    runs eagerly between the compiled graphs."""
    from torchrec.distributed import DistributedModelParallel
    runs = []
    for compile_it in (True, False):
        torch.manual_seed(0)
        model = _WithDense()
        plan = construct_module_sharding_plan(
            model.inner.dyn, {t.name: row_wise(compute_kernel="customized_kernel")
                              for t in _tables()},
            sharder=DynamicEmbCollectionSharder(), local_size=1, world_size=1, device_type="cpu")
        dmp = DistributedModelParallel(
            model, env=ShardingEnv.from_process_group(ensure_single_process_group()),
            device=torch.device("cpu"), plan=ShardingPlan({"inner.dyn": plan}),
            sharders=[DynamicEmbCollectionSharder()])
        step = torch.compile(dmp, backend="aot_eager") if compile_it else dmp
        g = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(3):
            lengths = torch.randint(0, 4, (4,), generator=g)
            kjt = KeyedJaggedTensor.from_lengths_sync(
                ["a", "b"], torch.randint(0, 30, (int(lengths.sum()),), generator=g), lengths)
            loss = step(kjt)
            loss.backward()
            losses.append(loss.detach())
        runs.append((torch.stack(losses), dmp.module.inner.dyn.read_rows("t0", torch.arange(30))))
    (got, (rows, found)), (want, (want_rows, want_found)) = runs
    torch.testing.assert_close(got, want)
    assert torch.equal(found, want_found)
    torch.testing.assert_close(rows, want_rows)


def test_the_sharding_context_has_every_field_of_torchrecs_own():
    """TorchRec before 1.8 sets the EC context's fields in its own ``__init__``, which a
    dataclass subclass does not call: the context must carry them whatever the version."""
    from torchrec.distributed.embedding import EmbeddingCollectionContext
    from dynemb.sharding.sharded_collection import DynamicEmbShardingContext
    ours, theirs = DynamicEmbShardingContext(), EmbeddingCollectionContext()
    assert set(vars(theirs)) <= set(vars(ours))
    assert ours.sharding_contexts == [] and ours.routings == [] and ours.batch == 0
