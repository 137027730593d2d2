"""The tables' optimizer chosen the TorchRec way, ``apply_optimizer_in_backward(cls,
module.parameters(), kwargs)``: a dynamic module trains as TorchRec's EmbeddingCollection
marked alike (unsharded, and sharded against TorchRec's fbgemm twin); what the fused optimizer
cannot follow is refused, with every table unchanged; a mark is adopted when it is made, and
a scheduler on the marks' optimizers or on fused_optimizer drives the tables' rate."""
import copy
import io
import pickle
import warnings

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch.distributed.optim import _apply_optimizer_in_backward
from torchrec import (EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection,
                      EmbeddingConfig)
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import torchrec.optim as torchrec_optim
from dynemb import (DynamicEmbBagCollection, DynamicEmbCollection, DynamicEmbTableOptions,
                    Initializer, InitializerKind, OptimizerConfig, OptimizerType)
from dynemb.foundations.marked_optimizer import fused_params_of_mark
from dynemb.sharding import DynamicEmbCollectionSharder
from dynemb.modules.table_weights import TableWeight
from tests.torchrec_twin import TorchRecTwin, ensure_single_process_group

NUM_IDS = 40
OPTIONS = DynamicEmbTableOptions(
    initializer=Initializer(InitializerKind.UNIFORM, low=-0.1, high=0.1), seed=11)

#: (class, kwargs, whether dense TorchRec touches rows outside the batch): Adam's moments
#: and weight decay move every row of a dense weight, so those cases train on one id set
MARKS = {
    "rowwise_adagrad": (RowWiseAdagrad, {"lr": 0.1}, False),
    "rowwise_adagrad_l2": (RowWiseAdagrad, {"lr": 0.1, "eps": 1e-6, "weight_decay": 0.05},
                           True),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.2, "initial_accumulator_value": 0.1}, False),
    "sgd": (torch.optim.SGD, {"lr": 0.5}, False),
    "adam": (torch.optim.Adam, {"lr": 0.05, "betas": (0.8, 0.99), "eps": 1e-6}, True),
    "adamw": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}, True),
}


def seq_tables():
    """f2 is read by both tables."""
    return [EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=NUM_IDS,
                            feature_names=["f1", "f2"]),
            EmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=NUM_IDS,
                            feature_names=["f2"])]


def bag_tables():
    return [EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=NUM_IDS,
                               feature_names=["f1", "f2"], pooling=PoolingType.SUM),
            EmbeddingBagConfig(name="t2", embedding_dim=3, num_embeddings=NUM_IDS,
                               feature_names=["f2"], pooling=PoolingType.MEAN)]


def initial_rows(dyn):
    ids = torch.arange(NUM_IDS)
    return {name: table.options.initializer.rows(ids, table.dim, seed=table.options.seed,
                                                 table_id=table.table_id)
            for name, table in dyn.tables.items()}


def twin_of(dyn, reference):
    weights = (reference.embeddings if isinstance(reference, EmbeddingCollection)
               else reference.embedding_bags)
    with torch.no_grad():
        for name, rows in initial_rows(dyn).items():
            weights[name].weight.copy_(rows)
    return reference


def batches(same_ids: bool):
    """Three steps; with ``same_ids`` every step reads each id of one set (in another order
    and number), so a dense optimizer moves no other row."""
    if same_ids:
        steps = [([3, 1, 7, 7], [5, 3, 1], [2, 2, 1, 2]),
                 ([7, 1, 3], [1, 5, 3, 3], [1, 2, 2, 2]),
                 ([1, 3, 7], [3, 1, 5], [2, 1, 1, 2])]
    else:
        steps = [([3, 1, 7, 7], [5, 3, 1], [2, 2, 1, 2]),
                 ([9, 1], [1, 12, 3, 3], [1, 1, 2, 2]),
                 ([7, 20, 3], [30, 1, 5], [2, 1, 1, 2])]
    return [KeyedJaggedTensor.from_lengths_sync(["f1", "f2"], torch.tensor(f1 + f2),
                                                torch.tensor(lengths))
            for f1, f2, lengths in steps]


def seq_loss(out):
    return sum(((jt.values() - 0.05 * (i + 1)) ** 2).sum() for i, jt in enumerate(out.values()))


def bag_loss(out):
    return ((out.values() - 0.1) ** 2).sum()


def assert_rows_match(dyn, reference):
    weights = (reference.embeddings if isinstance(reference, EmbeddingCollection)
               else reference.embedding_bags)
    ids = torch.arange(NUM_IDS)
    for name in dyn.tables:
        rows, found = dyn.read_rows(name, ids)
        expected = weights[name].weight.detach()
        assert found.any()
        torch.testing.assert_close(rows[found], expected[found], rtol=1e-5, atol=1e-6)
        assert not torch.equal(rows[found], initial_rows(dyn)[name][found])  # they trained


@pytest.mark.parametrize("case", sorted(MARKS))
def test_a_marked_collection_trains_as_torchrecs_marked_alike(case):
    optimizer_class, kwargs, same_ids = MARKS[case]
    dyn = DynamicEmbCollection(seq_tables(), table_options=OPTIONS)
    reference = twin_of(dyn, EmbeddingCollection(seq_tables()))
    for module in (dyn, reference):
        _apply_optimizer_in_backward(optimizer_class, module.parameters(), dict(kwargs))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # configured: no default-optimizer notice
        for kjt in batches(same_ids):
            loss, ref_loss = seq_loss(dyn(kjt)), seq_loss(reference(kjt))
            torch.testing.assert_close(loss, ref_loss)
            loss.backward()
            ref_loss.backward()
    assert_rows_match(dyn, reference)


def test_a_marked_bag_collection_trains_as_torchrecs_marked_alike():
    dyn = DynamicEmbBagCollection(bag_tables(), table_options=OPTIONS)
    reference = twin_of(dyn, EmbeddingBagCollection(bag_tables()))
    for module in (dyn, reference):
        apply_optimizer_in_backward(RowWiseAdagrad, module.parameters(), {"lr": 0.1})
    for kjt in batches(same_ids=False):
        loss, ref_loss = bag_loss(dyn(kjt)), bag_loss(reference(kjt))
        torch.testing.assert_close(loss, ref_loss)
        loss.backward()
        ref_loss.backward()
    assert_rows_match(dyn, reference)


def test_the_mark_replaces_the_default_sgd_and_its_warning():
    ec = DynamicEmbCollection(seq_tables(), table_options=OPTIONS)
    apply_optimizer_in_backward(RowWiseAdagrad, ec.parameters(), {"lr": 0.02, "eps": 1e-3})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        seq_loss(ec(batches(False)[0])).backward()
    assert [w for w in seen if "default optimizer" in str(w.message)] == []
    assert ec.optimizer_config == OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD,
                                                  learning_rate=0.02, eps=1e-3)
    assert ec.fused_optimizer.lr == 0.02
    assert ec.optimizer_given


def test_the_tables_parameters_are_torchrec_shaped_handles_and_no_state():
    ec = DynamicEmbCollection(seq_tables(), table_options=OPTIONS)
    named = dict(ec.named_parameters())
    assert list(named) == ["table_weights.t1", "table_weights.t2"]
    assert all(isinstance(p, TableWeight) and p.shape == (NUM_IDS, 4) and p.is_meta
               for p in named.values())
    keys = list(ec.state_dict())
    assert keys and all(k.startswith("dynamic_tables.") for k in keys)
    seq_loss(ec(batches(False)[0])).backward()  # unconfigured: trains with the default
    saved = ec.state_dict()
    again = DynamicEmbCollection(seq_tables(), table_options=OPTIONS)
    result = again.load_state_dict(saved, strict=True)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    ids = torch.arange(NUM_IDS)
    assert torch.equal(again.read_rows("t1", ids)[0], ec.read_rows("t1", ids)[0])
    assert ec.to("cpu") is ec and ec.table_weights.t1.is_meta  # .to() leaves them alone


def test_the_handles_survive_pickling_and_deepcopy():
    ec = DynamicEmbCollection(seq_tables(), table_options=OPTIONS)
    apply_optimizer_in_backward(RowWiseAdagrad, ec.parameters(), {"lr": 0.1})
    seq_loss(ec(batches(False)[0])).backward()
    buffer = io.BytesIO()
    torch.save(ec, buffer)
    buffer.seek(0)
    for copied in (torch.load(buffer, weights_only=False), copy.deepcopy(ec),
                   pickle.loads(pickle.dumps(ec))):
        assert copied.optimizer_config == ec.optimizer_config
        handles = [p for _, p in copied.named_parameters()]
        assert all(isinstance(p, TableWeight) for p in handles)
        assert list(in_backward_optimizer_filter(copied.named_parameters())) == []


# -- refused -----------------------------------------------------------------------------------
REFUSED = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, "momentum=0.9 cannot train"),
    (torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.01}, "weight_decay=0.01 cannot train"),
    (torch.optim.Adam, {"lr": 0.1, "weight_decay": 0.01}, "use torch.optim.AdamW"),
    (torch.optim.Adam, {"lr": 0.1, "amsgrad": True}, "no AMSGrad"),
    (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.1}, "no learning rate decay"),
    (RowWiseAdagrad, {"lr": 0.1, "maximize": True}, "minimize"),
    (torch.optim.RMSprop, {"lr": 0.1}, "RMSprop cannot train dynamic tables"),
    (torchrec_optim.LAMB, {"lr": 0.1}, "LAMB cannot train dynamic tables"),
]


@pytest.mark.parametrize("optimizer_class, kwargs, message", REFUSED,
                         ids=[f"{c.__name__}-{sorted(k)[-1]}" for c, k, _ in REFUSED])
def test_what_the_fused_optimizer_cannot_follow_is_refused_with_the_tables_unchanged(
        optimizer_class, kwargs, message):
    ec = DynamicEmbCollection(seq_tables(), table_options=OPTIONS)
    _apply_optimizer_in_backward(optimizer_class, ec.parameters(), kwargs)
    before = ec.optimizer_config
    with pytest.raises(ValueError, match=message):
        ec(batches(False)[0])
    assert ec.optimizer_config == before
    assert all(t.stats()["rows_device"] == 0 for t in ec.tables.values())


def test_the_mapping_of_each_class():
    assert fused_params_of_mark(torch.optim.Adam, {"betas": (0.5, 0.6)})["beta1"] == 0.5
    adamw = fused_params_of_mark(torch.optim.Adam, {"weight_decay": 0.1,
                                                    "decoupled_weight_decay": True})
    assert adamw["weight_decay"] == 0.1 and adamw["optimizer"].name == "ADAM"
    assert fused_params_of_mark(torch.optim.SGD, {"lr": 0.3, "foreach": True}) == {
        "optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.3}
    clipped = fused_params_of_mark(RowWiseAdagrad, {"gradient_clipping": True,
                                                    "max_gradient": 2.0})
    assert clipped["max_gradient"] == 2.0 and clipped["eps"] == 1e-10
    placeholder = fused_params_of_mark(torchrec_optim.Adam, {"lr": 0.1, "beta1": 0.7})
    assert placeholder == {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.1, "beta1": 0.7}
    with pytest.raises(ValueError, match="nesterovv=True is not an option"):
        fused_params_of_mark(torchrec_optim.RowWiseAdagrad, {"nesterovv": True})


def test_tables_marked_apart_or_with_two_optimizers_are_refused():
    ec = DynamicEmbCollection(seq_tables(), table_options=OPTIONS)
    t1, t2 = ec.table_weights.t1, ec.table_weights.t2
    apply_optimizer_in_backward(RowWiseAdagrad, [t1], {"lr": 0.1})
    with pytest.raises(ValueError, match=r"tables \['t2'\] were not"):
        ec(batches(False)[0])
    apply_optimizer_in_backward(RowWiseAdagrad, [t2], {"lr": 0.2})
    with pytest.raises(ValueError, match="different optimizers"):
        ec(batches(False)[0])
    apply_optimizer_in_backward(RowWiseAdagrad, [t2], {"lr": 0.1})
    with pytest.raises(ValueError, match="2 optimizers"):
        ec(batches(False)[0])
    assert ec.optimizer_config == OptimizerConfig()
    assert all(t.stats()["rows_device"] == 0 for t in ec.tables.values())


def test_a_mark_that_differs_from_the_modules_optimizer_is_refused_an_equal_one_accepted():
    config = OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD, learning_rate=0.1, eps=1e-10)
    ec = DynamicEmbCollection(seq_tables(), table_options=OPTIONS, optimizer=config)
    apply_optimizer_in_backward(RowWiseAdagrad, ec.parameters(), {"lr": 0.1})
    seq_loss(ec(batches(False)[0])).backward()
    assert ec.optimizer_config == config
    other = DynamicEmbCollection(seq_tables(), table_options=OPTIONS, optimizer=config)
    apply_optimizer_in_backward(RowWiseAdagrad, other.parameters(), {"lr": 0.3})
    with pytest.raises(ValueError, match=r"marks .*learning_rate=0.3.* but the module trains "
                                         r"with optimizer=.*learning_rate=0.1"):
        other(batches(False)[0])


def test_a_mark_after_the_tables_hold_rows_is_refused_with_the_rows_unchanged():
    ec = DynamicEmbCollection(seq_tables(), table_options=OPTIONS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        seq_loss(ec(batches(False)[0])).backward()  # the default SGD
    ids = torch.arange(NUM_IDS)
    rows = ec.read_rows("t1", ids)[0]
    apply_optimizer_in_backward(RowWiseAdagrad, ec.parameters(), {"lr": 0.1})
    with pytest.raises(ValueError, match=r"already hold rows .* before the first training"):
        ec(batches(False)[1])
    assert torch.equal(ec.read_rows("t1", ids)[0], rows)
    assert ec.optimizer_config == OptimizerConfig()


def test_a_mark_before_a_checkpoint_load_lets_that_checkpoint_load():
    trained = DynamicEmbCollection(seq_tables(), table_options=OPTIONS)
    apply_optimizer_in_backward(RowWiseAdagrad, trained.parameters(), {"lr": 0.1})
    seq_loss(trained(batches(False)[0])).backward()
    fresh = DynamicEmbCollection(seq_tables(), table_options=OPTIONS)
    apply_optimizer_in_backward(RowWiseAdagrad, fresh.parameters(), {"lr": 0.1})
    fresh.load_state_dict(trained.state_dict())
    ids = torch.arange(NUM_IDS)
    assert torch.equal(fresh.read_rows("t1", ids, with_state=True)[0],
                       trained.read_rows("t1", ids, with_state=True)[0])


# -- marks adopted when made -------------------------------------------------------------------
def _train_twins(dyn, reference, schedulers=()):
    device = dyn.device
    for kjt in batches(False):
        loss, ref_loss = seq_loss(dyn(kjt.to(device))), seq_loss(reference(kjt))
        torch.testing.assert_close(loss.cpu(), ref_loss)
        loss.backward()
        ref_loss.backward()
        for scheduler in schedulers:
            scheduler.step()
    assert_rows_match(dyn, reference)


def _marked_twins(backend, kwargs, ref_kwargs=None):
    name, device = backend
    dyn = DynamicEmbCollection(seq_tables(), table_options=OPTIONS, device=device,
                               backend=name)
    reference = twin_of(dyn, EmbeddingCollection(seq_tables()))
    apply_optimizer_in_backward(torch.optim.Adagrad, dyn.parameters(), dict(kwargs))
    apply_optimizer_in_backward(torch.optim.Adagrad, reference.parameters(),
                                dict(ref_kwargs or kwargs))
    return dyn, reference


def test_a_mark_is_adopted_when_made():
    ec = DynamicEmbCollection(seq_tables(), table_options=OPTIONS)
    apply_optimizer_in_backward(torch.optim.Adagrad, ec.parameters(), {"lr": 0.4})
    # nothing read or trained yet (optimizer_config reads no mark)
    assert ec.optimizer_config == OptimizerConfig(OptimizerType.ADAGRAD, learning_rate=0.4,
                                                  eps=1e-10)
    assert ec.optimizer_source == "marks"


@pytest.mark.parametrize("where", ["fused_optimizer", "the marks' optimizers"])
def test_an_lr_scheduler_built_after_the_marks_drives_the_marked_rate(backend, where):
    """TorchRec's tables follow a scheduler on their marks' own optimizers; the dynamic
    tables follow one on those or on fused_optimizer, from the marked rate."""
    dyn, reference = _marked_twins(backend, {"lr": 0.4})
    schedulers = [torch.optim.lr_scheduler.StepLR(p._in_backward_optimizers[0], 1, 0.5)
                  for p in reference.parameters()]
    if where == "fused_optimizer":
        schedulers.append(torch.optim.lr_scheduler.StepLR(dyn.fused_optimizer, 1, 0.5))
        assert dyn.fused_optimizer.param_groups[0]["initial_lr"] == 0.4
    else:
        schedulers += [torch.optim.lr_scheduler.StepLR(p._in_backward_optimizers[0], 1, 0.5)
                       for p in dyn.parameters()]
    _train_twins(dyn, reference, schedulers)
    assert dyn.fused_optimizer.lr == pytest.approx(0.4 / 8)


def test_a_learning_rate_set_by_hand_after_the_mark_is_kept(backend):
    dyn, reference = _marked_twins(backend, {"lr": 0.4}, {"lr": 0.1})
    dyn.fused_optimizer.param_groups[0]["lr"] = 0.1
    _train_twins(dyn, reference)
    assert dyn.fused_optimizer.lr == 0.1


def test_two_marks_optimizers_driven_apart_are_refused_with_the_tables_unchanged():
    ec = DynamicEmbCollection(seq_tables(), table_options=OPTIONS)
    apply_optimizer_in_backward(torch.optim.Adagrad, ec.parameters(), {"lr": 0.4})
    ec.table_weights.t1._in_backward_optimizers[0].param_groups[0]["lr"] = 0.2
    ec.table_weights.t2._in_backward_optimizers[0].param_groups[0]["lr"] = 0.3
    with pytest.raises(ValueError, match=r"one learning rate.*changed it to 0.2 and .*"
                                         r"changed it to 0.3.*nothing was updated"):
        ec(batches(False)[0])
    assert all(t.stats()["rows_device"] == 0 for t in ec.tables.values())


@pytest.mark.parametrize("fresh_on", ["device", "meta, then to_empty"])
def test_a_dump_loads_into_a_fresh_module_marked_with_its_optimizer(backend, fresh_on,
                                                                    tmp_path):
    from dynemb.checkpoint import dump, load
    name, device = backend
    mark = (torch.optim.Adam, {"lr": 0.05})
    trained = DynamicEmbCollection(seq_tables(), table_options=OPTIONS, device=device,
                                   backend=name)
    apply_optimizer_in_backward(mark[0], trained.parameters(), dict(mark[1]))
    seq_loss(trained(batches(False)[0].to(device))).backward()
    dump(trained, str(tmp_path))
    fresh = DynamicEmbCollection(seq_tables(), table_options=OPTIONS, backend=name,
                                 device="meta" if fresh_on != "device" else device)
    apply_optimizer_in_backward(mark[0], fresh.parameters(), dict(mark[1]))
    if fresh_on != "device":
        fresh.to_empty(device=device)
    assert load(fresh, str(tmp_path)).rows > 0
    for module in (trained, fresh):  # and they train on alike
        seq_loss(module(batches(False)[1].to(device))).backward()
    ids = torch.arange(NUM_IDS, device=device)
    for table in ("t1", "t2"):
        assert torch.equal(fresh.read_rows(table, ids, with_state=True)[0],
                           trained.read_rows(table, ids, with_state=True)[0])


# -- dense optimizers ---------------------------------------------------------------------------
class _Model(torch.nn.Module):
    def __init__(self, optimizer=None, device=None):
        super().__init__()
        self.ec = DynamicEmbCollection(seq_tables(), device=device, table_options=OPTIONS,
                                       optimizer=optimizer)
        self.dense = torch.nn.Linear(4, 1)

    def forward(self, kjt):
        return sum(self.dense(jt.values()).sum() for jt in self.ec(kjt).values())


def test_one_dense_adam_over_every_parameter_gives_the_tables_adam():
    """(tests/test_dense_optimizer_tables.py trains such models against TorchRec's.)"""
    model = _Model()
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    model(batches(False)[0]).backward()
    adam.step()
    assert model.ec.optimizer_config == OptimizerConfig(OptimizerType.ADAM, learning_rate=0.01)


@pytest.mark.parametrize("configured", ["marked", "optimizer="])
def test_a_dense_optimizer_leaves_configured_tables_alone(configured):
    optimizer = OptimizerConfig(OptimizerType.ADAM, learning_rate=0.05) \
        if configured == "optimizer=" else None
    model = _Model(optimizer)
    if configured == "marked":
        apply_optimizer_in_backward(torch.optim.Adam, model.ec.parameters(), {"lr": 0.05})
    dense = dict(in_backward_optimizer_filter(model.named_parameters()))
    assert sorted(dense) == ["dense.bias", "dense.weight"]
    adam = torch.optim.Adam(model.parameters(), lr=0.01)  # holding the handles too
    for kjt in batches(False):
        adam.zero_grad()
        model(kjt).backward()
        adam.step()
    assert model.ec.optimizer_config == OptimizerConfig(OptimizerType.ADAM, learning_rate=0.05)


# -- sharded -----------------------------------------------------------------------------------
def _shard(model, fused_params=None):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    pg = ensure_single_process_group()
    return DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"),
        sharders=[DynamicEmbCollectionSharder(fused_params=fused_params)])


def test_a_marked_module_sharded_trains_as_torchrecs_sharded_twin():
    model = _Model(device="meta")
    apply_optimizer_in_backward(RowWiseAdagrad, model.ec.parameters(), {"lr": 0.1, "eps": 1e-4})
    dmp = _shard(model)
    local = dmp.module.ec.local
    assert local.optimizer_config == OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD,
                                                     learning_rate=0.1, eps=1e-4)
    # TorchRec's sharder makes the same mark these fused params
    twin = TorchRecTwin(seq_tables(), initial_rows(local), {
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-4})
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for kjt in batches(False):
            out, ref = dmp.module.ec(kjt), twin(kjt)
            loss, ref_loss = seq_loss(out), seq_loss(ref)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
            loss.backward()
            ref_loss.backward()
    ids = torch.arange(NUM_IDS)
    for name, expected in twin.weights().items():
        rows, found = local.read_rows(name, ids)
        torch.testing.assert_close(rows[found], expected[found], rtol=1e-5, atol=1e-6)


def test_a_mark_wins_over_the_sharders_fused_params_key_by_key():
    model = _Model(device="meta")
    apply_optimizer_in_backward(RowWiseAdagrad, model.ec.parameters(), {"lr": 0.1})
    dmp = _shard(model, {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.5,
                         "gradient_clipping": True, "max_gradient": 2.0})
    assert dmp.module.ec.local.optimizer_config == OptimizerConfig(
        OptimizerType.ROWWISE_ADAGRAD, learning_rate=0.1, eps=1e-10, max_gradient=2.0)


def test_a_sharded_mark_that_conflicts_with_the_modules_optimizer_is_refused():
    model = _Model(OptimizerConfig(OptimizerType.SGD, learning_rate=0.1), device="meta")
    apply_optimizer_in_backward(RowWiseAdagrad, model.ec.parameters(), {"lr": 0.1})
    with pytest.raises(ValueError, match=r"at 'ec': apply_optimizer_in_backward marks .*"
                                         r"ROWWISE_ADAGRAD.* but the module trains with "
                                         r"optimizer=.*SGD"):
        _shard(model)


def test_the_planner_sizes_optimizer_state_for_the_marked_optimizer():
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    from dynemb.planning import table_footprint
    from tests.torchrec_probes import SearchSpaceRecorder
    model = _Model(device="meta")
    apply_optimizer_in_backward(torch.optim.Adam, model.ec.parameters(), {"lr": 0.01})
    sharder = DynamicEmbCollectionSharder()  # (installs dynemb's planner estimators)
    recorder = SearchSpaceRecorder()
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cuda"),
                                       stats=recorder.planner_stats())
    planner.plan(model, [sharder])
    adam = OptimizerConfig(OptimizerType.ADAM, learning_rate=0.01)
    for option in recorder.search_space:
        config = {c.name: c for c in seq_tables()}[option.name]
        expected = table_footprint(config, OPTIONS, adam, batch_size=option.batch_size,
                                   input_lengths=option.input_lengths)
        assert expected.state_dim == 8
        assert option.shards[0].storage == expected.storage()


def test_a_mark_made_on_meta_survives_to_empty():
    """Built on meta, marked, materialized with ``to_empty``: the same handles (and their
    mark) on the module, which trains with the marked optimizer without the default's
    warning."""
    configs = [EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=64,
                               feature_names=["f"])]
    ec = DynamicEmbCollection(configs, device=torch.device("meta"))
    handle = ec.table_weights.t
    apply_optimizer_in_backward(RowWiseAdagrad, ec.parameters(), {"lr": 0.1})
    ec.to_empty(device=torch.device("cpu"))
    assert ec.device == torch.device("cpu") and ec.table_weights.t is handle
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([1, 2]), torch.tensor([1, 1]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ec(kjt)["f"].values().sum().backward()
    assert ec.optimizer_config == OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD,
                                                  learning_rate=0.1, eps=1e-10)
