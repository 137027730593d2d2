"""Pieces of the row-wise sharding, checked by hand and against a pure-Python model; and the
sharded module on a one-rank gloo world in this process (bad plans, need_indices)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrec import EmbeddingConfig
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingPlan
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, FrequencyAdmission,
                    OptimizerConfig, OptimizerType)
from dynemb.options import ShardingScheme
from dynemb.sharding import DynamicEmbCollectionSharder, owner_ranks
from dynemb.sharding.plan_rows import local_table_options, rows_per_rank
from dynemb.sharding.routing import route_unique
from dynemb.sharding.sharded_collection import check_plan
from tests.torchrec_twin import ensure_single_process_group


def test_owner_ranks_mod_by_hand():
    keys = torch.tensor([0, 1, 2, 5, -1, -6, 2**62 + 3])
    assert owner_ranks(keys, 3, ShardingScheme.MOD).tolist() == [0, 1, 2, 2, 2, 0, (2**62 + 3) % 3]


def test_owner_ranks_hash_is_balanced_where_mod_is_not():
    even = torch.arange(0, 200_000, 2)  # ids sharing a stride with the world size
    assert torch.bincount(owner_ranks(even, 2, ShardingScheme.MOD), minlength=2).tolist() == [
        100_000, 0]
    counts = torch.bincount(owner_ranks(even, 2, ShardingScheme.HASH), minlength=2)
    assert abs(int(counts[0]) - 50_000) < 1_000
    for world in (3, 8):
        counts = torch.bincount(owner_ranks(even, world, ShardingScheme.HASH), minlength=world)
        assert counts.min() > 0.95 * even.numel() / world


def test_owner_ranks_hash_independent_of_the_bucket_hash():
    # keys of one rank still spread over every bucket of its hash table
    from dynemb.kernels.hashing import mix64
    import numpy as np
    keys = torch.arange(100_000)
    mine = keys[owner_ranks(keys, 2, ShardingScheme.HASH) == 0]
    buckets = [((int(mix64(np.int64(k))) >> 32) & 0xFFFFFFFF) * 64 >> 32 for k in mine.tolist()]
    counts = torch.bincount(torch.tensor(buckets), minlength=64)
    assert counts.min() > 0.8 * mine.numel() / 64


def _route_model(ids_per_table, schemes, world):
    """Pure-Python model: per (rank, table) the distinct ids in first-seen order."""
    sent = [[[] for _ in ids_per_table] for _ in range(world)]
    counts = [[[] for _ in ids_per_table] for _ in range(world)]
    for t, (ids, scheme) in enumerate(zip(ids_per_table, schemes)):
        for k in ids:
            r = int(owner_ranks(torch.tensor([k]), world, scheme))
            if k in sent[r][t]:
                counts[r][t][sent[r][t].index(k)] += 1
            else:
                sent[r][t].append(k)
                counts[r][t].append(1)
    return sent, counts


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(-50, 50), max_size=30), min_size=1, max_size=3),
       st.integers(1, 4), st.sampled_from(list(ShardingScheme)))
def test_route_unique_matches_model(ids_per_table, world, scheme):
    tensors = [torch.tensor(ids, dtype=torch.int64) for ids in ids_per_table]
    segments = [(f"f{t}", len(ids)) for t, ids in enumerate(ids_per_table)]
    routed = route_unique(tensors, [scheme] * len(tensors), world, segments)
    sent, counts = _route_model(ids_per_table, [scheme] * len(tensors), world)
    expected_values = [k for r in range(world) for t in range(len(tensors)) for k in sent[r][t]]
    expected_counts = [c for r in range(world) for t in range(len(tensors)) for c in counts[r][t]]
    assert routed.values.tolist() == expected_values
    assert routed.counts.tolist() == expected_counts
    assert routed.lengths.tolist() == [len(sent[r][t]) for r in range(world)
                                       for t in range(len(tensors))]
    # every occurrence gathers its own id back
    assert routed.values[routed.gather].tolist() == [k for ids in ids_per_table for k in ids]


def test_local_table_options_split_global_rows():
    opts = DynamicEmbTableOptions(init_capacity=1000, max_capacity=4001,
                                  admission=FrequencyAdmission(threshold=2, counter_capacity=300))
    local = local_table_options(opts, 4)
    assert (local.init_capacity, local.max_capacity) == (250, 1001)
    assert local.admission.counter_capacity == 75 and local.admission.threshold == 2
    assert local_table_options(DynamicEmbTableOptions(), 4).max_capacity is None
    assert rows_per_rank(1, 8) == 1


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


def _dmp(model, plan):
    from torchrec.distributed import DistributedModelParallel
    return DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(ensure_single_process_group()),
        device=torch.device("cpu"), plan=ShardingPlan({"dyn": plan}),
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
    from dynemb import EMPTY_KEY
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
    """The shard's tables on the CUDA backend (a GPU, or numba's simulator in CI)."""
    from tests.conftest import BACKENDS
    name, device = BACKENDS[1]
    model = _Wrap(backend=name)
    plan = construct_module_sharding_plan(
        model.dyn, {t.name: row_wise(compute_kernel="customized_kernel") for t in _tables()},
        sharder=DynamicEmbCollectionSharder(), local_size=1, world_size=1, device_type="cpu")
    dmp = _dmp(model, plan)
    ref = DynamicEmbCollection(_tables(), optimizer=OptimizerConfig(OptimizerType.SGD))
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        lengths = torch.randint(0, 4, (4,), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            ["a", "b"], torch.randint(0, 30, (int(lengths.sum()),), generator=g), lengths)
        out, expected = dmp(kjt), ref(kjt)
        loss = sum(out[f].values().pow(2).sum() for f in ("a", "b"))
        ref_loss = sum(expected[f].values().pow(2).sum() for f in ("a", "b"))
        torch.testing.assert_close(loss, ref_loss)
        loss.backward()
        ref_loss.backward()
    ids = torch.arange(30)
    for t in ("t0", "t1"):
        rows, found = dmp.module.dyn.read_rows(t, ids)
        ref_rows, ref_found = ref.read_rows(t, ids)
        assert torch.equal(found, ref_found)
        torch.testing.assert_close(rows[found], ref_rows[ref_found])


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
    _in_a_fresh_interpreter("test_sharding_units", "compiled_then_eager_sharded")


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
