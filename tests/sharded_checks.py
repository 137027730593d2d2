"""What the spawned sharded tests share (tests/test_sharded.py, tests/test_sharded_bag.py,
tests/test_stashing_sharded.py): running named scenarios on a world of ranks, and the check
of rows on their owners."""
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from examples.spawn import run_on_ranks
from tests.key_reference import owner


def spawn_scenarios(world: int, runner: Callable, scenarios: Dict[str, Any]
                    ) -> Dict[str, List[Any]]:
    """``runner(rank, world, [scenario, ...])`` on ``world`` spawned ranks -> per scenario
    name, each rank's result (rank order)."""
    results = run_on_ranks(world, runner, list(scenarios.values()), timeout=600)
    return {name: [per_rank[i] for per_rank in results] for i, name in enumerate(scenarios)}


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
