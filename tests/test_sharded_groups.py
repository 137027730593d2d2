"""Table groups in sharded modules, on 2 and 3 spawned CPU ranks: the same model sharded
with its tables grouped and table by table (``group_tables=False``) gives bit-identical
outputs at every step and bit-identical local rows, optimizer state, scores and counters on
every rank (tests/sharded_groups_worker.py), sequence and pooled, HBM_DIRECT and CACHE, with
evictions; then eval lookups, bit-identical too."""
import numpy as np
import pytest

from tests.sharded_checks import spawn_scenarios
from tests.sharded_groups_worker import GroupScenario, run_group_twins

SCENARIOS = {
    "sequence_adam": GroupScenario(module="sequence", optimizer="adam"),
    "sequence_sgd": GroupScenario(module="sequence", optimizer="sgd"),
    "bag_rowwise_adagrad": GroupScenario(module="bag", optimizer="rowwise_adagrad"),
    "sequence_cache_adam": GroupScenario(module="sequence", optimizer="adam", cache=True),
    "bag_cache_sgd": GroupScenario(module="bag", optimizer="sgd", cache=True),
}


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def world(request):
    return spawn_scenarios(request.param, run_group_twins, SCENARIOS)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_grouped_and_lone_sharded_tables_train_bit_for_bit_alike(world, name):
    ranks = world[name]
    assert sum(r["evictions"] for r in ranks) > 0  # the run evicts
    if SCENARIOS[name].cache:
        assert sum(r["write_backs"] for r in ranks) > 0
    for res in ranks:
        assert res["groups"]["grouped"] == [("t0", "t1", "t2"), ("t3",)]
        assert res["groups"]["alone"] == [("t0",), ("t1",), ("t2",), ("t3",)]  # of one
        for kind in ("outputs", "evals"):  # training steps, then eval lookups
            for got, want in zip(res[kind]["grouped"], res[kind]["alone"]):
                assert len(got) == len(want)
                for g, w in zip(got, want):
                    np.testing.assert_array_equal(g, w)
        assert len(res["evals"]["grouped"]) == 2
        grouped, alone = res["state"]["grouped"], res["state"]["alone"]
        assert grouped.keys() == alone.keys() and grouped
        for key in grouped:
            np.testing.assert_array_equal(grouped[key], alone[key], err_msg=key)
        assert res["stats"]["grouped"] == res["stats"]["alone"]
