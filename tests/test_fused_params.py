"""The fused optimizer configured the TorchRec way: the sharder's ``fused_params`` train a
dynamic module as they train TorchRec's EmbeddingCollection; a conflicting ``optimizer=`` on
the module is refused; a module configured nowhere warns once, at its first training use."""
import warnings

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingConfig
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, Initializer, InitializerKind,
                    OptimizerConfig, OptimizerType)
from dynemb.optimizer_config import DefaultOptimizerNotice
from dynemb.planning import table_footprint
from dynemb.sharding import DynamicEmbCollectionSharder
from dynemb.modules.fused_params import fused_params_optimizer
from tests.torchrec_probes import SearchSpaceRecorder
from tests.torchrec_twin import TorchRecTwin, ensure_single_process_group, same_batches

NUM_IDS, BATCH, STEPS = 200, 6, 8
FEATURES = ["f0", "f1"]
OPTIONS = DynamicEmbTableOptions(initializer=Initializer(InitializerKind.UNIFORM, low=-0.1,
                                                         high=0.1), seed=3)


def _tables():
    return [EmbeddingConfig(name="t0", embedding_dim=8, num_embeddings=NUM_IDS,
                            feature_names=FEATURES)]


class _Model(torch.nn.Module):
    def __init__(self, optimizer=None):
        super().__init__()
        self.dyn = DynamicEmbCollection(_tables(), device="meta", table_options=OPTIONS,
                                        optimizer=optimizer)

    def forward(self, kjt):
        return self.dyn(kjt)


def _shard(model, fused_params=None):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    pg = ensure_single_process_group()
    return DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"),
        sharders=[DynamicEmbCollectionSharder(fused_params=fused_params)])


def _batches():
    return [KeyedJaggedTensor.from_lengths_sync(FEATURES, values, lengths)
            for lengths, values in same_batches(STEPS, FEATURES, NUM_IDS, BATCH, seed=5)]


def _loss(out):
    return sum(((out[f].values() - 0.3) ** 2).sum() for f in FEATURES)


FUSED = {
    "rowwise_adagrad": {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1,
                        "eps": 1e-4},
    "adagrad": {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.1, "eps": 1e-4},
    "no_optimizer_key": {"learning_rate": 0.2},  # fbgemm's default: EXACT_SGD
}


@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_params_train_like_torchrec(name):
    dmp = _shard(_Model(), FUSED[name])
    local = dmp.module.dyn.local
    ids = torch.arange(NUM_IDS)
    initial = {t: table.options.initializer.rows(ids, table.dim, seed=table.options.seed,
                                                 table_id=table.table_id)
               for t, table in local.tables.items()}
    twin = TorchRecTwin(_tables(), initial, FUSED[name])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # configured: no default-optimizer notice
        for kjt in _batches():
            out, ref = dmp(kjt), twin(kjt)
            loss, ref_loss = _loss(out), _loss(ref)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-4)
            loss.backward()
            ref_loss.backward()
    rows, found = dmp.module.dyn.read_rows("t0", ids)
    ref_rows = twin.weights()["t0"]
    torch.testing.assert_close(rows[found], ref_rows[found], rtol=1e-4, atol=1e-5)
    assert not torch.equal(rows[found], initial["t0"][found])  # they trained


def test_module_optimizer_that_conflicts_with_fused_params_is_refused():
    model = _Model(OptimizerConfig(OptimizerType.ADAM))
    with pytest.raises(ValueError, match=r"DynamicEmbCollection at 'dyn': optimizer=.*ADAM.*"
                                         r"conflicts with its sharder's fused_params.*"
                                         r"ROWWISE_ADAGRAD"):
        _shard(model, FUSED["rowwise_adagrad"])


def test_module_optimizer_equal_to_fused_params_is_accepted():
    config = fused_params_optimizer(FUSED["rowwise_adagrad"])
    assert config == OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD, learning_rate=0.1, eps=1e-4)
    dmp = _shard(_Model(config), FUSED["rowwise_adagrad"])
    assert dmp.module.dyn.local.optimizer_config == config


def test_fused_params_without_optimizer_keys_keep_the_module_optimizer():
    config = OptimizerConfig(OptimizerType.ADAGRAD, learning_rate=0.3)
    dmp = _shard(_Model(config), {"cache_load_factor": 0.2})
    assert dmp.module.dyn.local.optimizer_config == config


def test_sharder_refuses_fused_params_it_cannot_honour():
    with pytest.raises(ValueError, match="LAMB is not supported"):
        DynamicEmbCollectionSharder(fused_params={"optimizer": EmbOptimType.LAMB})
    with pytest.raises(ValueError, match=r"fused_params\['max_norm'\] is not supported"):
        DynamicEmbCollectionSharder(fused_params={"learning_rate": 0.1, "max_norm": 1.0})
    with pytest.raises(TypeError, match="fused_params must be a dict"):
        DynamicEmbCollectionSharder(fused_params=[("learning_rate", 0.1)])


def test_planner_sizes_optimizer_state_from_fused_params():
    model = _Model()  # no optimizer on the module: Adam comes from the sharder
    recorder = SearchSpaceRecorder()
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cuda"),
                                       stats=recorder.planner_stats())
    planner.plan(model, [DynamicEmbCollectionSharder(
        fused_params={"optimizer": EmbOptimType.ADAM, "learning_rate": 0.01})])
    (option,) = recorder.search_space
    expected = table_footprint(_tables()[0], OPTIONS, OptimizerConfig(OptimizerType.ADAM),
                               batch_size=option.batch_size,
                               input_lengths=option.input_lengths)
    assert expected.state_dim == 16
    assert option.shards[0].storage == expected.storage()


def _training_warnings(module, kjt, steps=2):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(steps):
            _loss(module(kjt)).backward()
    return [w for w in seen if "default optimizer" in str(w.message)]


def test_module_without_optimizer_warns_once_at_first_training_use():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing at construction or in eval
        ec = DynamicEmbCollection(_tables(), table_options=OPTIONS)
        kjt = _batches()[0]
        ec.eval()
        ec(kjt)
    ec.train()
    (warning,) = _training_warnings(ec, kjt)
    assert "learning_rate=0.01" in str(warning.message)
    assert "apply_optimizer_in_backward" in str(warning.message)
    configured = DynamicEmbCollection(_tables(), table_options=OPTIONS,
                                      optimizer=OptimizerConfig())
    assert _training_warnings(configured, kjt) == []


def test_sharded_module_without_any_optimizer_warns_once():
    dmp = _shard(_Model())
    assert len(_training_warnings(dmp, _batches()[0])) == 1


def test_apply_optimizer_in_backward_configures_a_dynamic_module_without_notice():
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
    ec = DynamicEmbCollection(_tables(), table_options=OPTIONS)
    apply_optimizer_in_backward(RowWiseAdagrad, ec.parameters(), {"lr": 0.1})
    assert _training_warnings(ec, _batches()[0]) == []  # see tests/test_marked_optimizer.py
    assert ec.optimizer_config.type is OptimizerType.ROWWISE_ADAGRAD


def test_default_optimizer_notice_on_its_own():
    given, not_given = (DefaultOptimizerNotice("M", given=True),
                        DefaultOptimizerNotice("M", given=False))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            given.at_training(OptimizerConfig())
            not_given.at_training(OptimizerConfig())
    assert [str(w.message).split(" trains")[0] for w in seen] == ["M"]
