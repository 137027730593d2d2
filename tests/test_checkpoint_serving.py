"""Export for serving (dynemb/serving/export.py): the static EmbeddingCollection and its
id remaps answer exactly as the dynamic module's eval forward (live ids, unknown ids, every
storage mode, optimizers, float16 / bfloat16 rows); iter_rows yields each live key once in
bounded chunks with the rows read_rows gives; ranks' exports merge; bad input is refused."""
import dataclasses

import pytest
import torch
from torchrec import EmbeddingConfig
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from checkpoint_models import MODES, OPTIMIZERS, batches, eval_output, model, options, train
from dynemb import DynamicEmbCollection, Initializer, InitializerKind
from dynemb.serving import (IdRemap, StaticExport, StaticServingCollection, iter_rows,
                            merge_exports, to_static)
from tests.torchrec_twin import ensure_single_process_group

STEPS = 12
ALL_IDS = torch.arange(600) * 7919 - 1000  # every id the workload draws from
UNKNOWN = torch.tensor([123456789, -5, 2**63 - 1, -(2**63) + 2])  # never trained


def trained(mode, optimizer="sgd", dtype=None, **kwargs):
    ec = model(mode, optimizer, dtype=dtype, **kwargs)
    train(ec, batches(STEPS))
    return ec


def probe(f0_ids=None, f1_ids=None):
    """A KJT of one id per sample: ``f0_ids`` through f0 and ``f1_ids`` through f1 (default:
    every workload id and the unknown ones, in two orders)."""
    f0_ids = torch.cat([ALL_IDS, UNKNOWN]) if f0_ids is None else f0_ids
    f1_ids = f0_ids.flip(0) if f1_ids is None else f1_ids
    samples = max(f0_ids.numel(), f1_ids.numel())  # the shorter feature gets empty bags
    lengths = [torch.cat([torch.ones(ids.numel(), dtype=torch.long),
                          torch.zeros(samples - ids.numel(), dtype=torch.long)])
               for ids in (f0_ids, f1_ids)]
    return KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.cat([f0_ids, f1_ids]),
                                               torch.cat(lengths))


def live_keys(ec, table):
    _, found = ec.read_rows(table, ALL_IDS)
    return ALL_IDS[found]


def assert_same_outputs(got, expected):
    assert list(got) == list(expected)
    for f in expected:
        assert got[f].values().dtype == torch.float32
        assert torch.equal(got[f].values(), expected[f].values()), f
        assert torch.equal(got[f].lengths(), expected[f].lengths()), f


def assert_rows_stored_off_device(ec, mode):
    """The workload leaves rows where the mode under test keeps them besides the device."""
    stats = ec.stats()["t0"]
    if mode == "cache":
        assert stats["rows_backing"] > 0 and stats["write_backs"] > 0
    elif mode in ("default", "host_only"):  # the host tier; HOST_ONLY: every row
        assert stats["rows_backing"] > 0
    else:
        assert stats["rows_backing"] == 0


# -- the static module answers as the dynamic one -------------------------------------------
@pytest.mark.parametrize("optimizer,dtype", [("sgd", None), ("adam", None),
                                             ("rowwise_adagrad", torch.float16),
                                             ("adagrad", torch.bfloat16)],
                         ids=["sgd", "adam", "rowwise_adagrad-fp16", "adagrad-bf16"])
@pytest.mark.parametrize("mode", MODES)
def test_static_export_answers_like_the_dynamic_eval(mode, optimizer, dtype):
    ec = trained(mode, optimizer, dtype)
    assert_rows_stored_off_device(ec, mode)
    static, remaps = to_static(ec)
    kjt = probe()
    assert_same_outputs(StaticServingCollection(static, remaps)(kjt), eval_output(ec, kjt))
    for config in static.embedding_configs():
        live = live_keys(ec, config.name)
        assert torch.equal(remaps[config.name].keys, live.sort().values)
        assert config.num_embeddings == live.numel() + 1
        assert config.feature_names == [f"f{config.name[1]}"]
        weight = static.embeddings[config.name].weight
        # float16 stays float16; bfloat16 is held as float32 (exact), not rounded to float16
        assert weight.dtype == (torch.float16 if dtype is torch.float16 else torch.float32)
        assert torch.equal(weight[-1], torch.zeros_like(weight[-1]))  # the default row
        rows, _ = ec.read_rows(config.name, remaps[config.name].keys)
        assert torch.equal(weight[:-1], rows.to(weight.dtype))
    # unknown ids read the default row
    assert torch.equal(remaps["t0"](UNKNOWN), torch.full((4,), remaps["t0"].num_keys))


def test_the_default_row_holds_a_constant_eval_initializer():
    opts = dataclasses.replace(
        options("default", OPTIMIZERS["adam"], dtype=torch.float16),
        eval_initializer=Initializer(InitializerKind.CONSTANT, value=0.25))
    ec = _collection(opts, OPTIMIZERS["adam"])
    train(ec, batches(STEPS))
    serving = StaticServingCollection(*to_static(ec))
    kjt = probe()
    out = serving(kjt)
    assert_same_outputs(out, eval_output(ec, kjt))
    assert bool((out["f0"].values()[-UNKNOWN.numel():] == 0.25).all())


def test_a_non_constant_eval_initializer_warns_and_gives_a_zero_default_row():
    opts = dataclasses.replace(options("hbm_direct", OPTIMIZERS["sgd"]),
                               eval_initializer=Initializer(InitializerKind.UNIFORM))
    ec = _collection(opts, OPTIMIZERS["sgd"])
    train(ec, batches(STEPS))
    live = probe(live_keys(ec, "t0"), live_keys(ec, "t1"))
    with pytest.warns(UserWarning, match=r"tables \['t0', 't1'\] have a non-constant "
                                         r"eval_initializer \(t0: UNIFORM, t1: UNIFORM\).*"
                                         r"unseen ids will differ from the dynamic module"):
        export = to_static(ec)
    serving = StaticServingCollection(*export)
    assert_same_outputs(serving(live), eval_output(ec, live))
    unknown = serving(probe(UNKNOWN))["f0"].values()
    assert torch.equal(unknown, torch.zeros_like(unknown))
    assert not torch.equal(eval_output(ec, probe(UNKNOWN))["f0"].values(), unknown)


def test_indices_subsets_of_features_and_an_empty_module():
    ec = _collection(options("hbm_direct", OPTIMIZERS["sgd"]), OPTIMIZERS["sgd"],
                     need_indices=True)
    static, remaps = to_static(ec)  # nothing trained yet: only the default rows
    assert [static.embeddings[t].weight.shape[0] for t in ("t0", "t1")] == [1, 1]
    assert remaps["t0"].num_keys == 0
    train(ec, batches(STEPS))
    serving = StaticServingCollection(*to_static(ec))
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["f1", "f0"], torch.tensor([ALL_IDS[0], 5, ALL_IDS[1]], dtype=torch.int32),
        torch.tensor([2, 0, 1, 0]))
    got, expected = serving(kjt), eval_output(ec, kjt)
    assert_same_outputs(got, expected)
    for f in ("f0", "f1"):
        assert torch.equal(got[f].weights(), expected[f].weights())  # the raw ids
    assert torch.equal(serving.remap(kjt).lengths(), kjt.lengths())


# -- iter_rows --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,dtype", [(m, None) for m in MODES] + [("cache", torch.float16)],
                         ids=list(MODES) + ["cache-fp16"])
def test_iter_rows_yields_each_live_key_once_in_bounded_chunks(mode, dtype):
    ec = trained(mode, "adam", dtype)
    for table in ("t0", "t1"):
        chunks = list(iter_rows(ec, table, chunk_rows=7))
        assert len(chunks) > 1 and all(0 < k.numel() <= 7 for k, _ in chunks)
        keys = torch.cat([k for k, _ in chunks])
        rows = torch.cat([r for _, r in chunks])
        assert keys.dtype == torch.int64 and keys.unique().numel() == keys.numel()
        assert torch.equal(keys.sort().values, live_keys(ec, table).sort().values)
        assert rows.dtype == ec.tables[table].layout.dtype and rows.shape[1] == ec.tables[table].dim
        expected, found = ec.read_rows(table, keys)
        assert bool(found.all()) and torch.equal(rows, expected)


def test_one_rank_sharded_module_exports_its_share():
    configs = [EmbeddingConfig(name=f"t{i}", embedding_dim=8, num_embeddings=1024,
                               feature_names=[f"f{i}"]) for i in range(2)]
    opts = options("cache", OPTIMIZERS["sgd"])

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dyn = DynamicEmbCollection(configs, device="meta", table_options=opts,
                                            optimizer=OPTIMIZERS["sgd"])

        def forward(self, kjt):
            out = self.dyn(kjt)  # sharded: a LazyAwaitable
            return {f: out[f] for f in kjt.keys()}

    from torchrec.distributed import DistributedModelParallel

    from dynemb.sharding import DynamicEmbCollectionSharder
    wrap = Wrap()
    sharder = DynamicEmbCollectionSharder()
    plan = construct_module_sharding_plan(
        wrap.dyn, {c.name: row_wise(compute_kernel="customized_kernel") for c in configs},
        sharder=sharder, local_size=1, world_size=1, device_type="cpu")
    dmp = DistributedModelParallel(
        wrap, env=ShardingEnv.from_process_group(ensure_single_process_group()),
        device=torch.device("cpu"), plan=ShardingPlan({"dyn": plan}), sharders=[sharder])
    train(dmp, batches(4))
    sharded = dmp.module.dyn
    keys = torch.cat([k for k, _ in iter_rows(sharded, "t0", chunk_rows=7)])
    assert torch.equal(keys.sort().values, live_keys(sharded, "t0").sort().values)
    assert [c.feature_names for c in sharded.embedding_configs()] == [
        c.feature_names for c in configs]
    serving = StaticServingCollection(*to_static(sharded))  # the sharded module's own configs
    kjt = probe()
    assert_same_outputs(serving(kjt), eval_output(dmp, kjt))


# -- merging ranks' exports -------------------------------------------------------------------
def split_by_parity(export):
    """Two exports holding the even and the odd keys of ``export``, as two ranks would."""
    parts = []
    for parity in (0, 1):
        configs, remaps = [], {}
        rows = {}
        for c in export.ec.embedding_configs():
            remap = export.remaps[c.name]
            mine = remap.keys % 2 == parity
            weight = export.ec.embeddings[c.name].weight
            rows[c.name] = torch.cat([weight[:-1][mine], weight[-1:]])
            remaps[c.name] = IdRemap(remap.keys[mine])
            configs.append(dataclasses.replace(c, num_embeddings=int(mine.sum()) + 1))
        ec = type(export.ec)(configs)
        with torch.no_grad():
            for name, r in rows.items():
                ec.embeddings[name].weight.copy_(r)
        parts.append(StaticExport(ec, remaps))
    return parts


def test_merged_exports_equal_the_whole_export():
    ec = trained("default", "rowwise_adagrad", torch.float16)
    whole = to_static(ec)
    merged = merge_exports(split_by_parity(whole)[::-1])
    for name, remap in whole.remaps.items():
        assert torch.equal(merged.remaps[name].keys, remap.keys)
        assert torch.equal(merged.ec.embeddings[name].weight, whole.ec.embeddings[name].weight)
    kjt = probe()
    assert_same_outputs(StaticServingCollection(*merged)(kjt), eval_output(ec, kjt))
    with pytest.raises(ValueError, match="the exports share keys"):
        merge_exports([whole, whole])
    other = to_static(trained("hbm_direct", "sgd"))
    with pytest.raises(ValueError, match="export 1 has tables"):
        merge_exports([whole, other])
    with pytest.raises(ValueError, match="no export"):
        merge_exports([])


# -- the remap on its own ---------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_id_remap_is_scriptable_and_exportable():
    remap = IdRemap(torch.tensor([40, -3, 2**63 - 2, 7]))
    ids = torch.tensor([7, 8, -3, 2**63 - 1, 2**63 - 2, -(2**63), 40])
    expected = torch.tensor([1, 4, 0, 4, 3, 4, 2])
    assert torch.equal(remap(ids), expected)
    assert torch.equal(remap(ids.to(torch.int32).clamp(-100, 100)),
                       torch.tensor([1, 4, 0, 4, 4, 4, 2]))
    assert torch.equal(torch.jit.script(remap)(ids), expected)
    exported = torch.export.export(remap, (ids,))
    assert torch.equal(exported.module()(ids), expected)
    empty = IdRemap(torch.empty(0, dtype=torch.int64))
    assert torch.equal(empty(ids), torch.zeros_like(ids))


# -- bad input --------------------------------------------------------------------------------
def test_bad_input_is_refused_clearly():
    ec = model("hbm_direct", "sgd")
    with pytest.raises(KeyError, match=r"no table 'nope'; tables: \['t0', 't1'\]"):
        iter_rows(ec, "nope")
    with pytest.raises(ValueError, match="chunk_rows must be positive, got 0"):
        iter_rows(ec, "t0", chunk_rows=0)
    with pytest.raises(ValueError, match="chunk_rows must be positive, got -3"):
        to_static(ec, chunk_rows=-3)
    with pytest.raises(TypeError, match="chunk_rows must be an int"):
        iter_rows(ec, "t0", chunk_rows=2.5)
    with pytest.raises(TypeError, match="expected a DynamicEmbCollection"):
        iter_rows(torch.nn.Linear(2, 2), "t0")
    two_dims = model("hbm_direct", "sgd", dims=(8, 4))
    with pytest.raises(ValueError, match=r"different embedding dims \[4, 8\]"):
        to_static(two_dims)
    t1_only = to_static(two_dims, embedding_configs=two_dims.embedding_configs()[1:])
    assert list(t1_only.remaps) == ["t1"] and t1_only.ec.embedding_dim() == 4
    for configs in ([], ec.embedding_configs() * 2,
                    [dataclasses.replace(ec.embedding_configs()[0], name="t9")]):
        with pytest.raises(ValueError, match="each must be one of the module's tables"):
            to_static(ec, embedding_configs=configs)
    with pytest.raises(ValueError, match="'t1': embedding_dim 4 in the configs, 8 in the"):
        to_static(ec, embedding_configs=two_dims.embedding_configs()[1:])
    with pytest.raises(ValueError, match="keys must be distinct"):
        IdRemap(torch.tensor([3, 1, 3]))
    with pytest.raises(TypeError, match="1-d int64"):
        IdRemap(torch.tensor([1.0]))
    static, remaps = to_static(ec)
    with pytest.raises(ValueError, match=r"no IdRemap for tables \['t1'\]"):
        StaticServingCollection(static, {"t0": remaps["t0"]})
    with pytest.raises(ValueError, match="the remap has 1 keys, the table 1 rows"):
        StaticServingCollection(static, {**remaps, "t0": IdRemap(torch.tensor([5]))})
    serving = StaticServingCollection(static, remaps)
    with pytest.raises(ValueError, match=r"features \['f0', 'f1'\] of this collection are "
                                         r"not in the KJT"):
        serving(KeyedJaggedTensor.from_lengths_sync(["g"], torch.tensor([1]),
                                                    torch.tensor([1])))
    # a feature of no table is ignored, as by TorchRec's EmbeddingCollection and the module
    with_g = KeyedJaggedTensor.from_lengths_sync(["f0", "g", "f1"], torch.tensor([5, 1, 7]),
                                                 torch.tensor([1, 1, 1]))
    assert_same_outputs(serving(with_g), eval_output(ec, with_g))
    shared = DynamicEmbCollection([EmbeddingConfig(name=t, embedding_dim=4, num_embeddings=64,
                                                   feature_names=["f"]) for t in ("a", "b")])
    with pytest.raises(ValueError, match=r"read by several tables \{'f': \['a', 'b'\]\}"):
        StaticServingCollection(*to_static(shared))


def _collection(opts, optimizer, **kwargs):
    configs = [EmbeddingConfig(name=f"t{i}", embedding_dim=8, num_embeddings=1024,
                               feature_names=[f"f{i}"]) for i in range(2)]
    return DynamicEmbCollection(configs, table_options=opts, optimizer=optimizer, **kwargs)
