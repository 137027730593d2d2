"""Serving export of pooled modules (dynemb/serving/pooled.py): to_static of a
DynamicEmbBagCollection (or its sharded form) is a TorchRec EmbeddingBagCollection with the
module's pooling and is_weighted, whose StaticServingBagCollection answers the dynamic
module's eval forward bit for bit, for seen and unseen ids, in every storage mode and dtype;
pooled exports merge like sequence ones; bad input is refused clearly.

Table t0 (dim 8) is shared by features f0 and f1, t1 (dim 4) reads f2. Bags hold 0 to 4 ids."""
import dataclasses

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingConfig
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from checkpoint_models import MODES, OPTIMIZERS, eval_output, options
from dynemb import DynamicEmbBagCollection, Initializer, InitializerKind
from dynemb.serving import (IdRemap, StaticBagExport, StaticServingBagCollection,
                            StaticServingCollection, iter_rows, merge_exports, to_static)
from tests.torchrec_twin import ensure_single_process_group

FEATURES = ["f0", "f1", "f2"]
TABLE_OF = {"f0": "t0", "f1": "t0", "f2": "t1"}
DIMS = {"t0": 8, "t1": 4}
STEPS = 12
ALL_IDS = torch.arange(600) * 7919 - 1000  # every id the workload draws from
UNKNOWN = torch.tensor([123456789, -5, 2**63 - 1, -(2**63) + 2])  # never trained
#: pooling of (t0, t1) and whether the KJT carries per-id weights
POOLINGS = {"sum": (PoolingType.SUM, PoolingType.SUM, False),
            "mean": (PoolingType.MEAN, PoolingType.MEAN, False),
            "mixed": (PoolingType.MEAN, PoolingType.SUM, False),
            "weighted": (PoolingType.SUM, PoolingType.SUM, True)}


def bag_configs(pooling, dims=DIMS):
    p0, p1, _ = POOLINGS[pooling]
    return [EmbeddingBagConfig(name="t0", embedding_dim=dims["t0"], num_embeddings=1024,
                               feature_names=["f0", "f1"], pooling=p0),
            EmbeddingBagConfig(name="t1", embedding_dim=dims["t1"], num_embeddings=1024,
                               feature_names=["f2"], pooling=p1)]


def bag_model(mode="hbm_direct", pooling="mixed", optimizer="sgd", dtype=None, device=None,
              dims=DIMS, **option_changes):
    opts = dataclasses.replace(options(mode, OPTIMIZERS[optimizer], dtype=dtype),
                               **option_changes)
    return DynamicEmbBagCollection(bag_configs(pooling, dims), is_weighted=POOLINGS[pooling][2],
                                   device=device, table_options=opts,
                                   optimizer=OPTIMIZERS[optimizer])


def bag_kjt(ids_per_feature, lengths_per_feature, weighted, seed=0):
    """A KJT of the three features (ids and bag lengths given per feature); weights in
    [0.5, 1.5) when ``weighted``."""
    ids = torch.cat(ids_per_feature)
    weights = None
    if weighted:
        weights = torch.rand(ids.numel(), generator=torch.Generator().manual_seed(seed)) + 0.5
    return KeyedJaggedTensor.from_lengths_sync(FEATURES, ids, torch.cat(lengths_per_feature),
                                               weights=weights)


def batches(steps, weighted, seed=0, batch=24):
    """KJTs of Zipf-like ids from ALL_IDS, 0 to 3 ids per bag."""
    gen = torch.Generator().manual_seed(seed)
    probs = 1.0 / torch.arange(1, ALL_IDS.numel() + 1, dtype=torch.float64)
    out = []
    for step in range(steps):
        lengths = [torch.randint(0, 4, (batch,), generator=gen) for _ in FEATURES]
        ids = [ALL_IDS[torch.multinomial(probs, max(int(n.sum()), 1), replacement=True,
                                         generator=gen)[:int(n.sum())]] for n in lengths]
        out.append(bag_kjt(ids, lengths, weighted, seed=step))
    return out


def train(module, kjts):
    for kjt in kjts:
        out = module(kjt)
        values = out.values()
        gen = torch.Generator().manual_seed(values.numel())
        ((values * torch.randn(values.shape, generator=gen)).sum()
         + (values ** 2).sum() * 0.1).backward()


def trained(mode="hbm_direct", pooling="mixed", optimizer="sgd", dtype=None, **changes):
    module = bag_model(mode, pooling, optimizer, dtype=dtype, **changes)
    train(module, batches(STEPS, POOLINGS[pooling][2]))
    return module


def probe(weighted, seed=1):
    """Every workload id and the unknown ones, through every feature: single-id bags, then
    bags of 3 mixing seen and unseen ids, then an empty bag."""
    gen = torch.Generator().manual_seed(seed)
    ids, lengths = [], []
    for i, _ in enumerate(FEATURES):
        everything = torch.cat([ALL_IDS, UNKNOWN])
        mixed = everything[torch.randperm(everything.numel(), generator=gen)][:3 * 60]
        ids.append(torch.cat([everything.roll(i * 7), mixed]))
        lengths.append(torch.cat([torch.ones(everything.numel(), dtype=torch.long),
                                  torch.full((60,), 3), torch.zeros(1, dtype=torch.long)]))
    return bag_kjt(ids, lengths, weighted, seed=seed)


def assert_same_keyed(got, expected):
    assert isinstance(got, KeyedTensor)
    assert got.keys() == expected.keys() == FEATURES
    assert got.length_per_key() == expected.length_per_key()
    assert got.values().dtype == torch.float32
    assert torch.equal(got.values(), expected.values())


def live_keys(module, table):
    _, found = module.read_rows(table, ALL_IDS)
    return ALL_IDS[found]


# -- the static module answers as the dynamic one -------------------------------------------
@pytest.mark.parametrize("pooling,optimizer,dtype", [
    ("sum", "sgd", None), ("mean", "adam", None), ("mixed", "rowwise_adagrad", torch.float16),
    ("weighted", "adagrad", torch.bfloat16)],
    ids=["sum", "mean-adam", "mixed-fp16", "weighted-bf16"])
@pytest.mark.parametrize("mode", MODES)
def test_pooled_export_answers_like_the_dynamic_eval(mode, pooling, optimizer, dtype):
    dyn = trained(mode, pooling, optimizer, dtype)
    export = to_static(dyn)
    assert isinstance(export, StaticBagExport)
    ebc, remaps = export
    assert type(ebc) is EmbeddingBagCollection and ebc.is_weighted() == POOLINGS[pooling][2]
    for config, expected in zip(ebc.embedding_bag_configs(), bag_configs(pooling)):
        assert (config.name, config.embedding_dim, config.feature_names, config.pooling) == (
            expected.name, expected.embedding_dim, expected.feature_names, expected.pooling)
        live = live_keys(dyn, config.name)
        assert torch.equal(remaps[config.name].keys, live.sort().values)
        assert config.num_embeddings == live.numel() + 1
        # float16 / bfloat16 rows are held as float32 (exact): EmbeddingBag would pool
        # float16 rows in float16, the dynamic module pools in float32
        assert config.data_type == DataType.FP32
        weight = ebc.embedding_bags[config.name].weight
        assert torch.equal(weight[-1], torch.zeros_like(weight[-1]))  # the default row
        rows, _ = dyn.read_rows(config.name, remaps[config.name].keys)
        assert torch.equal(weight[:-1], rows.to(torch.float32))
    kjt = probe(POOLINGS[pooling][2])
    assert_same_keyed(StaticServingBagCollection(ebc, remaps)(kjt), eval_output(dyn, kjt))


def test_tables_of_one_dim_export_as_bags_not_as_a_sequence_collection():
    """Tables of one dim fit an EmbeddingCollection too: a pooled module still exports to an
    EmbeddingBagCollection, whose serving answers KeyedTensors of the pooled bags."""
    same_dims = {"t0": 8, "t1": 8}
    dyn = bag_model("hbm_direct", "mixed", dims=same_dims)
    train(dyn, batches(STEPS, weighted=False))
    ebc, remaps = to_static(dyn)
    assert type(ebc) is EmbeddingBagCollection
    assert [c.pooling for c in ebc.embedding_bag_configs()] == [
        c.pooling for c in bag_configs("mixed", same_dims)]
    kjt = probe(weighted=False)
    got = StaticServingBagCollection(ebc, remaps)(kjt)
    assert got.values().shape == (kjt.stride(), 24)
    assert_same_keyed(got, eval_output(dyn, kjt))


def test_pooled_bags_by_hand_and_a_constant_default_row():
    """MEAN of a seen and an unseen id: (row + eval constant) / 2; weighted SUM by hand."""
    value = 0.25
    dyn = trained("default", "mixed", "adam", torch.float16,
                  eval_initializer=Initializer(InitializerKind.CONSTANT, value=value))
    serving = StaticServingBagCollection(*to_static(dyn))
    seen = live_keys(dyn, "t0")[:2]
    t1_seen = live_keys(dyn, "t1")[:1]
    kjt = bag_kjt([torch.stack([seen[0], UNKNOWN[0]]), torch.cat([UNKNOWN[1:3], seen]),
                   torch.cat([t1_seen, UNKNOWN[:1]])],
                  [torch.tensor([2]), torch.tensor([4]), torch.tensor([2])], weighted=False)
    out = serving(kjt)
    rows, _ = dyn.read_rows("t0", seen)
    t1_row, _ = dyn.read_rows("t1", t1_seen)
    rows, t1_row = rows.float(), t1_row.float()
    torch.testing.assert_close(out["f0"][0], (rows[0] + value) / 2, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out["f1"][0], (2 * value + rows[0] + rows[1]) / 4,
                               rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out["f2"][0], t1_row[0] + value, rtol=1e-6, atol=1e-7)
    assert_same_keyed(out, eval_output(dyn, kjt))
    unseen_only = bag_kjt([UNKNOWN[:2], UNKNOWN[2:3], UNKNOWN[:1]],
                          [torch.tensor([2]), torch.tensor([1]), torch.tensor([1])], False)
    assert bool((serving(unseen_only).values() == value).all())
    assert_same_keyed(serving(unseen_only), eval_output(dyn, unseen_only))

    weighted = trained("hbm_direct", "weighted")
    serving = StaticServingBagCollection(*to_static(weighted))
    keys = live_keys(weighted, "t0")[:3]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        FEATURES, torch.cat([keys, UNKNOWN[:1], keys[:1]]), torch.tensor([3, 1, 1]),
        weights=torch.tensor([0.5, 2.0, -1.0, 3.0, 4.0]))
    rows, _ = weighted.read_rows("t0", keys)
    t1_rows, t1_found = weighted.read_rows("t1", keys[:1])
    out = serving(kjt)
    torch.testing.assert_close(out["f0"][0], 0.5 * rows[0] + 2.0 * rows[1] - rows[2],
                               rtol=1e-6, atol=1e-6)
    assert bool((out["f1"][0] == 0).all())  # an unseen id: the default row, zeros
    expected_f2 = 4.0 * t1_rows[0] if bool(t1_found[0]) else torch.zeros(DIMS["t1"])
    torch.testing.assert_close(out["f2"][0], expected_f2, rtol=1e-6, atol=1e-6)
    assert_same_keyed(out, eval_output(weighted, kjt))


def test_a_non_constant_eval_initializer_warns_and_unseen_ids_read_zeros():
    dyn = trained("hbm_direct", "mean",
                  eval_initializer=Initializer(InitializerKind.UNIFORM, low=-1.0, high=1.0))
    with pytest.warns(UserWarning, match=r"tables \['t0', 't1'\] have a non-constant "
                                         r"eval_initializer .*unseen ids will differ"):
        export = to_static(dyn)
    serving = StaticServingBagCollection(*export)
    seen = [live_keys(dyn, TABLE_OF[f])[:40] for f in FEATURES]
    live = bag_kjt(seen, [torch.ones(40, dtype=torch.long)] * 3, weighted=False)
    assert_same_keyed(serving(live), eval_output(dyn, live))
    unseen = bag_kjt([UNKNOWN] * 3, [torch.ones(4, dtype=torch.long)] * 3, weighted=False)
    assert bool((serving(unseen).values() == 0).all())
    assert not torch.equal(eval_output(dyn, unseen).values(), serving(unseen).values())


def test_a_constant_eval_initializer_exports_without_warning(recwarn):
    to_static(trained("hbm_direct", "sum"))
    assert not [w for w in recwarn if "eval_initializer" in str(w.message)]


# -- sharded ----------------------------------------------------------------------------------
class _Wrap(torch.nn.Module):
    def __init__(self, bags):
        super().__init__()
        self.bags = bags

    def forward(self, kjt):
        out = self.bags(kjt)  # sharded: a LazyAwaitable
        return KeyedTensor(keys=out.keys(), length_per_key=out.length_per_key(),
                           values=out.values())


@pytest.mark.parametrize("pooling", ["mixed", "weighted"])
def test_one_rank_sharded_pooled_module_exports_its_share(pooling):
    from torchrec.distributed import DistributedModelParallel

    from dynemb.sharding import DynamicEmbBagCollectionSharder
    wrap = _Wrap(bag_model("cache", pooling, device=torch.device("meta")))
    sharder = DynamicEmbBagCollectionSharder()
    plan = construct_module_sharding_plan(
        wrap.bags, {c.name: row_wise(compute_kernel="customized_kernel")
                    for c in bag_configs(pooling)},
        sharder=sharder, local_size=1, world_size=1, device_type="cpu")
    dmp = DistributedModelParallel(
        wrap, env=ShardingEnv.from_process_group(ensure_single_process_group()),
        device=torch.device("cpu"), plan=ShardingPlan({"bags": plan}), sharders=[sharder])
    train(dmp, batches(4, POOLINGS[pooling][2]))
    sharded = dmp.module.bags
    assert type(sharded).__name__ == "ShardedDynamicEmbBagCollection"
    keys = torch.cat([k for k, _ in iter_rows(sharded, "t0", chunk_rows=7)])
    assert keys.numel() > 7
    assert torch.equal(keys.sort().values, live_keys(sharded, "t0").sort().values)
    ebc, remaps = to_static(sharded)  # the sharded module's own configs, MEAN kept
    assert [c.pooling for c in ebc.embedding_bag_configs()] == [
        c.pooling for c in bag_configs(pooling)]
    kjt = probe(POOLINGS[pooling][2])
    assert_same_keyed(StaticServingBagCollection(ebc, remaps)(kjt), eval_output(dmp, kjt))


# -- merging ranks' exports -------------------------------------------------------------------
def split_by_parity(export):
    """Two pooled exports holding the even and the odd keys of ``export``, as two ranks
    would."""
    parts = []
    for parity in (0, 1):
        configs, remaps, rows = [], {}, {}
        for c in export.ebc.embedding_bag_configs():
            remap = export.remaps[c.name]
            mine = remap.keys % 2 == parity
            weight = export.ebc.embedding_bags[c.name].weight
            rows[c.name] = torch.cat([weight[:-1][mine], weight[-1:]])
            remaps[c.name] = IdRemap(remap.keys[mine])
            configs.append(dataclasses.replace(c, num_embeddings=int(mine.sum()) + 1))
        ebc = EmbeddingBagCollection(configs, is_weighted=export.ebc.is_weighted())
        with torch.no_grad():
            for name, r in rows.items():
                ebc.embedding_bags[name].weight.copy_(r)
        parts.append(StaticBagExport(ebc, remaps))
    return parts


def test_merged_pooled_exports_equal_the_whole_export():
    dyn = trained("default", "weighted", "rowwise_adagrad", torch.float16)
    whole = to_static(dyn)
    merged = merge_exports(split_by_parity(whole)[::-1])
    assert isinstance(merged, StaticBagExport) and merged.ebc.is_weighted()
    for name, remap in whole.remaps.items():
        assert torch.equal(merged.remaps[name].keys, remap.keys)
        assert torch.equal(merged.ebc.embedding_bags[name].weight,
                           whole.ebc.embedding_bags[name].weight)
    kjt = probe(weighted=True)
    assert_same_keyed(StaticServingBagCollection(*merged)(kjt), eval_output(dyn, kjt))
    with pytest.raises(ValueError, match="the exports share keys"):
        merge_exports([whole, whole])
    with pytest.raises(ValueError, match="export 1 has tables"):
        merge_exports([whole, to_static(trained("hbm_direct", "sum"))])  # unweighted
    with pytest.raises(ValueError, match="export 1 has tables"):
        merge_exports([to_static(trained("hbm_direct", "mean")),
                       to_static(trained("hbm_direct", "mixed"))])  # t1 MEAN vs SUM
    from checkpoint_models import model
    sequence = to_static(model("hbm_direct", "sgd"))
    with pytest.raises(ValueError, match="cannot merge pooled and sequence exports"):
        merge_exports([whole, sequence])


# -- bad input --------------------------------------------------------------------------------
def test_pooled_export_refuses_bad_input_clearly():
    dyn = trained("hbm_direct", "mixed")
    configs = bag_configs("mixed")
    t1_only = to_static(dyn, embedding_configs=configs[1:])
    assert list(t1_only.remaps) == ["t1"] and len(t1_only.ebc.embedding_bags) == 1
    with pytest.raises(TypeError, match="a pooled module exports EmbeddingBagConfigs"):
        to_static(dyn, embedding_configs=[EmbeddingConfig(
            name="t0", embedding_dim=8, num_embeddings=4, feature_names=["f0"])])
    with pytest.raises(ValueError, match="'t1': pooling MEAN in the configs, SUM in the"):
        to_static(dyn, embedding_configs=[dataclasses.replace(configs[1],
                                                              pooling=PoolingType.MEAN)])
    with pytest.raises(ValueError, match="'t1': embedding_dim 8 in the configs, 4 in the"):
        to_static(dyn, embedding_configs=[dataclasses.replace(configs[1], embedding_dim=8)])
    with pytest.raises(ValueError, match="each must be one of the module's tables"):
        to_static(dyn, embedding_configs=[dataclasses.replace(configs[0], name="t9")])
    with pytest.raises(ValueError, match="chunk_rows must be positive, got 0"):
        to_static(dyn, chunk_rows=0)
    ebc, remaps = to_static(dyn)
    with pytest.raises(ValueError, match=r"no IdRemap for tables \['t1'\]"):
        StaticServingBagCollection(ebc, {"t0": remaps["t0"]})
    with pytest.raises(TypeError, match="pooled exports: StaticServingBagCollection"):
        StaticServingCollection(ebc, remaps)
    serving = StaticServingBagCollection(ebc, remaps)
    one = [torch.tensor([ALL_IDS[0]])] * 3
    with pytest.raises(ValueError, match=r"features \['f2'\] of this collection are not in"):
        serving(KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.cat(one[:2]),
                                                    torch.tensor([1, 1])))
    # as TorchRec's EBC and the dynamic module: weights on an unweighted collection and
    # features of no table are ignored
    plain = serving(bag_kjt(one, [torch.tensor([1])] * 3, weighted=False))
    assert_same_keyed(serving(bag_kjt(one, [torch.tensor([1])] * 3, weighted=True)), plain)
    assert_same_keyed(serving(KeyedJaggedTensor.from_lengths_sync(
        FEATURES + ["g"], torch.cat(one + one[:1]), torch.ones(4, dtype=torch.long))), plain)
