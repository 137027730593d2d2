"""torch.distributed.checkpoint of a whole DistributedModelParallel model (dense layer,
TorchRec table with fused optimizer state, three dynamic tables in the three storage
modes), saved on 2 and 3 spawned CPU ranks and loaded on 1, 2 and 3: each key lands on its
new owner and training continues as the uninterrupted run does (see
tests/checkpoint_dcp_worker.py)."""
import numpy as np
import pytest

from examples.spawn import run_on_ranks
from tests.checkpoint_dcp_worker import run

STEPS_BEFORE, STEPS_AFTER = 6, 4
RTOL, ATOL = 1e-5, 1e-6


def _spawn(world, jobs):
    results = run_on_ranks(world, run, jobs, timeout=600)
    return [[per_rank[i] for per_rank in results] for i in range(len(jobs))]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of 2- and 3-rank runs, and those runs continued uninterrupted."""
    root = tmp_path_factory.mktemp("dcp")
    out = {}
    for world in (2, 3):
        path = str(root / f"world{world}")
        jobs = [("save_and_continue", (path, STEPS_BEFORE, STEPS_AFTER))]
        if world == 2:  # and with dcp.async_save, training while it writes
            jobs.append(("async_save_and_continue", (path + "_async", STEPS_BEFORE,
                                                     STEPS_AFTER)))
        results = _spawn(world, jobs)
        out[world] = (path, results[0])
        if world == 2:
            out["async"] = (path + "_async", results[1])
    return out


@pytest.fixture(scope="module")
def resumed(saved):
    """The checkpoints loaded on other world sizes (and the same one), then trained on."""
    loads = {1: [2, "async"], 2: [3, 2, "async"], 3: [2]}  # new world -> saved worlds
    out = {}
    for world, sources in loads.items():
        jobs = [("load_and_continue", (saved[s][0], STEPS_BEFORE, STEPS_AFTER))
                for s in sources]
        if world == 2:  # the same world size with DCP's default planner: in place
            jobs.append(("load_and_continue", (saved[2][0], STEPS_BEFORE, STEPS_AFTER,
                                               "default")))
            jobs.append(("load_and_continue", (saved[3][0], STEPS_BEFORE, STEPS_AFTER,
                                               "default")))
        results = _spawn(world, jobs)
        for source, result in zip(sources, results):
            out[(source, world)] = result
        if world == 2:
            out[(2, 2, "default")], out[(3, 2, "default")] = results[-2:]
    return out


def _check_continuation(uninterrupted, resumed_ranks):
    for rank_result in resumed_ranks:
        assert "error" not in rank_result, rank_result
    expected = uninterrupted[0]
    got = resumed_ranks[0]
    np.testing.assert_allclose(got["after"], expected["after"], rtol=RTOL, atol=ATOL)
    for name, (rows, count) in expected["rows"].items():
        got_rows, got_count = got["rows"][name]
        np.testing.assert_array_equal(got_count, count)  # each stored key on one owner
        np.testing.assert_allclose(got_rows, rows, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("source,target", [(2, 1), (2, 3), (3, 2), (2, 2)])
def test_resumed_on_another_world_size_continues_as_the_uninterrupted_run(saved, resumed,
                                                                          source, target):
    _check_continuation(saved[source][1], resumed[(source, target)])


def test_the_loaded_rows_are_the_saved_rows_on_their_new_owners(saved, resumed):
    # before any further step, the rows every owner holds after 2 -> 3 equal what the
    # 2-rank run held when it saved (read back from the 2 -> 2 load)
    same_world = resumed[(2, 2)][0]["loaded_rows"]
    for target in (1, 3):
        moved = resumed[(2, target)][0]["loaded_rows"]
        for name, (rows, count) in same_world.items():
            np.testing.assert_array_equal(moved[name][1], count)
            np.testing.assert_array_equal(moved[name][0], rows)
    assert same_world["t1"][1].sum() > 0


def test_the_same_world_size_loads_in_place_with_the_default_planner(saved, resumed):
    _check_continuation(saved[2][1], resumed[(2, 2, "default")])
    # exact, slot for slot: counters too
    for rank, result in enumerate(resumed[(2, 2, "default")]):
        assert result["stats"] == saved[2][1][rank]["stats"]


def test_another_world_size_without_the_planner_is_a_clear_error(resumed):
    errors = [r["error"] for r in resumed[(3, 2, "default")]]
    for rank, error in enumerate(errors):
        assert "Missing key in checkpoint state_dict" in error, error
        assert f"dynamic_tables.t0.rank{rank}_of_2" in error, error


def test_the_loaded_scores_are_the_saved_scores_on_their_new_owners(resumed):
    # every policy's scores (LFU_LRU's counts and clocks, t4's CUSTOMIZED scores) move
    # with their keys: after 2 -> 1 and 2 -> 3 each id scores what it scored after 2 -> 2
    same_world = resumed[(2, 2)][0]["loaded_scores"]
    assert set(same_world) == {"t0", "t1", "t2", "t3", "t4"}
    for target in (1, 3):
        moved = resumed[(2, target)][0]["loaded_scores"]
        for name, scores in same_world.items():
            np.testing.assert_array_equal(moved[name], scores, err_msg=name)
    assert (same_world["t3"] >> 40).max() > 1          # counts above one use
    assert set(np.unique(same_world["t4"])) - {0} <= {
        (s * 37) % 11 * 1000 + s for s in range(STEPS_BEFORE)}


def test_a_sharded_checkpoint_loads_into_the_unsharded_module(saved, resumed):
    # no process group here: the whole table lands in one DynamicEmbCollection
    import torch
    import torch.distributed.checkpoint as dcp
    from torchrec import EmbeddingConfig

    from dynemb import DynamicEmbCollection
    from dynemb.checkpoint import DynamicEmbLoadPlanner
    from tests.checkpoint_dcp_worker import DIM, FEATURES, NUM_IDS, dynamic_options
    opt, options = dynamic_options()
    ec = DynamicEmbCollection([EmbeddingConfig(name=f"t{i}", embedding_dim=DIM,
                                               num_embeddings=NUM_IDS, feature_names=[f"f{i}"])
                               for i in range(len(FEATURES))], table_options=options,
                              optimizer=opt)
    state = {"model": {f"dyn.{k}": v for k, v in ec.state_dict().items()}}
    dcp.load(state, checkpoint_id=saved[2][0], planner=DynamicEmbLoadPlanner())
    ec.load_state_dict({k[len("dyn."):]: v for k, v in state["model"].items()})
    ids = torch.arange(NUM_IDS) * 1009 - 77
    expected = resumed[(2, 2)][0]["loaded_rows"]   # what the 2 ranks held when they saved
    for name, (rows, count) in expected.items():
        got, found = ec.read_rows(name, ids, with_state=True)
        np.testing.assert_array_equal(found.numpy(), count > 0)
        np.testing.assert_array_equal((got * found[:, None]).numpy(), rows)


@pytest.mark.parametrize("change,message", [
    ("dim", r"table '.*dynamic_tables.t0': cannot load the checkpoint: rows of width \(24,\)"),
    ("dtype", r"dtype torch.float32 in the checkpoint, width \(\d+,\) and dtype torch.float16"),
])
def test_a_table_that_differs_is_refused_before_anything_loads(saved, change, message):
    import dataclasses

    import torch
    import torch.distributed.checkpoint as dcp
    from torchrec import EmbeddingConfig

    from dynemb import DynamicEmbCollection
    from dynemb.checkpoint import DynamicEmbLoadPlanner
    from tests.checkpoint_dcp_worker import DIM, FEATURES, NUM_IDS, dynamic_options
    opt, options = dynamic_options()
    dim = 2 * DIM if change == "dim" else DIM
    if change == "dtype":
        options = {n: dataclasses.replace(o, embedding_dtype=torch.float16)
                   for n, o in options.items()}
    ec = DynamicEmbCollection([EmbeddingConfig(name=f"t{i}", embedding_dim=dim,
                                               num_embeddings=NUM_IDS, feature_names=[f"f{i}"])
                               for i in range(len(FEATURES))], table_options=options,
                              optimizer=opt)
    before = {k: v.clone() for k, v in ec.state_dict().items()}
    state = {"model": {f"dyn.{k}": v for k, v in ec.state_dict().items()}}
    from torch.distributed.checkpoint.api import CheckpointException
    with pytest.raises(CheckpointException, match=message):
        dcp.load(state, checkpoint_id=saved[2][0], planner=DynamicEmbLoadPlanner())
    for key, value in ec.state_dict().items():
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("target", [2, 1])
def test_async_save_while_training_resumes_as_the_uninterrupted_run(saved, resumed, target):
    # dcp.async_save with DynamicEmbAsyncStager: the steps run while it wrote are not in it
    path, async_run = saved["async"]
    for rank_result in async_run:
        assert "error" not in rank_result, rank_result
        assert rank_result["written_during_training"] is False
    np.testing.assert_allclose(async_run[0]["after"], saved[2][1][0]["after"], rtol=RTOL,
                               atol=ATOL)
    _check_continuation(saved[2][1], resumed[("async", target)])
    # what was loaded is what the synchronous save of the same step holds
    same = resumed[(2, target)][0]["loaded_rows"]
    for name, (rows, count) in same.items():
        got_rows, got_count = resumed[("async", target)][0]["loaded_rows"][name]
        np.testing.assert_array_equal(got_count, count)
        np.testing.assert_array_equal(got_rows, rows)
