"""CUSTOMIZED scores on the modules: ``set_scores`` gives the score a training batch writes
for its keys; scores and evictions against hand-computed values in every storage mode, on
the CPU and CUDA kernels; a training step without a score is refused before any table
changes; bad calls set nothing. (Checkpoint round trips of CUSTOMIZED tables are in
test_checkpoint_*.py, which set a score per step.)"""
import pytest
import torch
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from conftest import BACKENDS
from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig,
                    ScorePolicy, StorageMode)
from dynemb.rows.flat_table import RowLayout

DIM = 4
OPT = OptimizerConfig()
ROW = RowLayout(DIM, OPT.state_dim(DIM), torch.float32).row_bytes
#: four device rows in one bucket; DEFAULT adds a host tier of four
MODES = {"hbm_direct": dict(init_capacity=4, max_capacity=4),
         "cache": dict(caching=True, global_hbm_for_values=4 * ROW),
         "default": dict(global_hbm_for_values=4 * ROW, max_capacity=8)}
BACKEND_IDS = [b for b, _ in BACKENDS]


def module(mode="hbm_direct", backend=BACKENDS[0], *, lru_table=False):
    """``backend``: a (kernels, device) pair of conftest.BACKENDS."""
    options = {"c": DynamicEmbTableOptions(score_strategy=ScorePolicy.CUSTOMIZED,
                                           bucket_size=4, **MODES[mode])}
    configs = [EmbeddingConfig(name="c", embedding_dim=DIM, num_embeddings=64,
                               feature_names=["fc"])]
    if lru_table:
        options["l"] = DynamicEmbTableOptions()
        configs.append(EmbeddingConfig(name="l", embedding_dim=DIM, num_embeddings=64,
                                       feature_names=["fl"]))
    ec = DynamicEmbCollection(configs, table_options=options, optimizer=OPT,
                              backend=backend[0], device=torch.device(backend[1]))
    assert ec.storage_modes()["c"] is StorageMode(mode)
    return ec


def kjt(ids, other=None):
    """A KJT of ``ids`` for the CUSTOMIZED table and, when given, ``other`` for the LRU one."""
    features = ["fc"] if other is None else ["fc", "fl"]
    values = list(ids) + list(other or [])
    lengths = [len(ids)] + ([] if other is None else [len(other)])
    return KeyedJaggedTensor.from_lengths_sync(features, torch.tensor(values, dtype=torch.int64),
                                               torch.tensor(lengths))


def step(ec, ids, score=None, other=None):
    if score is not None:
        ec.set_scores({"c": score})
    out = ec(kjt(ids, other).to(ec.device))
    sum(jt.values().sum() for jt in out.values()).backward()


def stored_scores(ec):
    """{key: score} of every key the CUSTOMIZED table holds in its tiers (device, host)."""
    table = ec.tables["c"]
    out = {}
    for tier in (table.tier, getattr(table, "host_tier", None)):
        if tier is not None:
            exported = tier.hash.export()
            out.update(zip(exported.keys.tolist(), exported.scores.tolist()))
    return out


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_key_of_a_training_batch_gets_the_score_set(mode, backend):
    ec = module(mode, backend)
    step(ec, [1, 2, 2], score=50)
    assert stored_scores(ec) == {1: 50, 2: 50}
    step(ec, [2, 3])                   # the score stays until set again
    assert stored_scores(ec) == {1: 50, 2: 50, 3: 50}
    step(ec, [3], score=-7)            # a hit takes the new score, even a lower one
    assert stored_scores(ec) == {1: 50, 2: 50, 3: -7}
    assert ec.scores == {"c": -7}


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("mode", ["hbm_direct", "cache"])
def test_a_full_bucket_evicts_the_lowest_score_set(mode, backend):
    ec = module(mode, backend)
    step(ec, [1, 2], score=50)
    step(ec, [3], score=10)
    step(ec, [4], score=20)            # full: 1: 50, 2: 50, 3: 10, 4: 20
    step(ec, [5], score=30)            # evicts 3 (10)
    assert stored_scores(ec) == {1: 50, 2: 50, 4: 20, 5: 30}
    step(ec, [6], score=5)             # evicts 4 (20), the lowest before the call
    assert stored_scores(ec) == {1: 50, 2: 50, 5: 30, 6: 5}
    if mode == "cache":                # evicted rows went to the store with their scores
        rows, found, scores = ec.tables["c"].store.find(torch.tensor([3, 4], device=ec.device))
        assert found.tolist() == [True, True] and scores.tolist() == [10, 20]
        step(ec, [3], score=40)        # back from the store: the new score (evicts 6)
        assert stored_scores(ec) == {1: 50, 2: 50, 5: 30, 3: 40}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_training_step_without_a_score_is_refused_before_any_table_changes(mode):
    ec = module(mode, lru_table=True)
    with pytest.raises(ValueError, match=r"set_scores\(\{'c': score\}\)"):
        ec(kjt([1, 2], [7, 8]))
    assert stored_scores(ec) == {}
    assert ec.tables["l"].tier.hash.size() == 0        # the other table is untouched too
    assert ec.stats()["l"]["lookups"] == 0
    with pytest.raises(ValueError, match="set_scores"):
        ec.prefetch(kjt([1], [7]))
    assert ec.pending_prefetches == 0
    ec.eval()                           # eval writes no score: none needed
    with torch.no_grad():
        ec(kjt([1, 2], [7]))
    ec.train()
    step(ec, [1], score=3, other=[7])
    assert stored_scores(ec) == {1: 3}


def test_a_prefetched_batch_keeps_the_score_it_was_prefetched_with():
    ec = module()
    ec.set_scores({"c": 11})
    ec.prefetch(kjt([1]))
    ec.set_scores({"c": 22})
    step(ec, [1])                       # the prefetched batch: 11
    assert stored_scores(ec) == {1: 11}
    step(ec, [2])
    assert stored_scores(ec) == {1: 11, 2: 22}


@pytest.mark.parametrize("scores,error,message", [
    ({"nope": 1}, KeyError, "no table 'nope'"),
    ({"c": 1, "l": 2}, ValueError, "table 'l' has score_strategy LRU"),
    ({"c": 1.5}, ValueError, "a score must be an int"),
    ({"c": True}, ValueError, "a score must be an int"),
    ({"c": 2**63}, ValueError, "int64 range"),
    ([("c", 1)], TypeError, "must map table names"),
])
def test_bad_scores_set_nothing(scores, error, message):
    ec = module(lru_table=True)
    ec.set_scores({"c": 4})
    with pytest.raises(error, match=message):
        ec.set_scores(scores)
    assert ec.scores == {"c": 4}


def test_tensor_and_numpy_integers_are_scores():
    import numpy as np
    ec = module()
    ec.set_scores({"c": torch.tensor(9)})
    assert ec.scores == {"c": 9}
    ec.set_scores({"c": np.int64(2**63 - 1)})
    step(ec, [1])
    assert stored_scores(ec) == {1: 2**63 - 1}


def test_the_score_set_survives_a_checkpoint_load_and_a_reset():
    ec = module("cache")
    step(ec, [1, 2], score=8)
    state = ec.state_dict()
    ec.load_state_dict(state)
    ec.reset_parameters()
    step(ec, [3])
    assert stored_scores(ec) == {3: 8}
