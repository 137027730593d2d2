"""What the spawned sharded tests share (tests/test_sharded.py, tests/test_sharded_bag.py,
tests/test_stashing_sharded.py): running named scenarios on worlds of ranks, one test per
world over its scenarios, and the checks of rows on their owners and of lookup counts."""
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import pytest

from examples.spawn import run_on_ranks
from tests.key_reference import owner


def spawn_scenarios(world: int, runner: Callable, scenarios: Dict[str, Any]
                    ) -> Dict[str, List[Any]]:
    """``runner(rank, world, [scenario, ...])`` on ``world`` spawned ranks -> per scenario
    name, each rank's result (rank order)."""
    results = run_on_ranks(world, runner, list(scenarios.values()), timeout=600)
    return {name: [per_rank[i] for per_rank in results] for i, name in enumerate(scenarios)}


def world_fixtures(runner: Callable, worlds: Dict[int, Dict[str, Any]]) -> List[Any]:
    """Per world size ``n`` of ``worlds`` (in its order), a module-scoped fixture named
    ``world{n}``: it spawns that world once, when a test first asks for it, and gives what
    :func:`spawn_scenarios` gives. A test module binds them to those names::

        world2, world1 = world_fixtures(run_scenarios, {2: WORLD2, 1: WORLD1})
    """
    return [_world_fixture(n, runner, scenarios) for n, scenarios in worlds.items()]


def _world_fixture(world: int, runner: Callable, scenarios: Dict[str, Any]):
    @pytest.fixture(scope="module", name=f"world{world}")
    def spawned():
        return spawn_scenarios(world, runner, scenarios)
    return spawned


def world_tests(check: Callable, worlds: Dict[int, Dict[str, Any]]) -> List[Callable]:
    """Per world size ``n`` of ``worlds`` (in its order), a test parametrized by scenario
    name that runs ``check(ranks, scenario)`` on the ranks' results from the fixture
    ``world{n}`` (see :func:`world_fixtures`). A test module binds each to a ``test_`` name."""
    return [_world_test(n, scenarios, check) for n, scenarios in worlds.items()]


def _world_test(world: int, scenarios: Dict[str, Any], check: Callable) -> Callable:
    @pytest.mark.parametrize("name", list(scenarios))
    def test(request, name):
        check(request.getfixturevalue(f"world{world}")[name], scenarios[name])
    return test


def check_lookups_add_up(ranks: List[Dict[str, Any]]) -> None:
    """Ids travel to their owners once per occurrence (a dedup before the all-to-all keeps
    the counts): the owners' lookups add up to the unsharded reference's."""
    lookups = {n: sum(r["stats"][n]["lookups"] for r in ranks) for n in ("t0", "t1")}
    assert lookups == {n: ranks[0]["ref_stats"][n]["lookups"] for n in ("t0", "t1")}


def check_rows_on_owners(ranks: List[Dict[str, Any]], sharding: str, num_ids: int,
                         twin_rows: Optional[str], rtol: float, atol: float) -> None:
    """Every key the unsharded reference holds is on exactly its owner rank with the
    reference's row (none lost, none invented); with ``twin_rows`` (the result key of
    TorchRec's row-wise shards: (row offset, block) per table) TorchRec's rows agree too."""
    world = len(ranks)
    for name, (ref_keys, ref_rows) in ranks[0]["ref_rows"].items():
        held = {}
        for rank, res in enumerate(ranks):
            keys, rows = res["rows"][name]
            strays = [k for k in keys.tolist() if owner(k, world, sharding) != rank]
            assert not strays, f"rank {rank} holds keys it does not own: {strays[:5]}"
            for k, row in zip(keys.tolist(), rows):
                assert k not in held, f"key {k} on two ranks"
                held[k] = row
        assert sorted(held) == ref_keys.tolist()  # none lost, none invented
        got = np.stack([held[k] for k in ref_keys.tolist()])
        np.testing.assert_allclose(got, ref_rows, rtol=rtol, atol=atol)
        if twin_rows is not None:
            full = np.zeros((num_ids, ref_rows.shape[1]), dtype=np.float32)
            for res in ranks:
                offset, block = res[twin_rows][name]
                full[offset:offset + block.shape[0]] = block
            np.testing.assert_allclose(full[ref_keys], ref_rows, rtol=rtol, atol=atol)
