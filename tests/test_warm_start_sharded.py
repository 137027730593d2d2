"""``warm_start`` between sharded modules on 2 spawned CPU ranks (gloo): a sharded
``DynamicEmbCollection`` warm-started from TorchRec's row-wise sharded
``EmbeddingCollection`` (fbgemm's fused row-wise AdaGrad, trained first) holds every row once,
on its owner, and then looks up and trains exactly as TorchRec does
(tests/sharded_warm_start_worker.py)."""
import pytest
import torch

from tests.sharded_checks import spawn_scenarios
from tests.sharded_warm_start_worker import NUM_IDS, run_warm_start


@pytest.fixture(scope="module")
def ranks():
    return spawn_scenarios(2, run_warm_start, {"warm": None})["warm"]


def test_every_row_lands_once_on_its_owner(ranks):
    for table in ("t0", "t1"):
        assert sum(r["written"][table] for r in ranks) == NUM_IDS  # each rank its shard
        assert sum(r["rows_held"][table] for r in ranks) == NUM_IDS


def test_the_warm_started_module_trains_on_as_torchrec(ranks):
    for res in ranks:
        for want, got in zip(res["outputs"]["torchrec"], res["outputs"]["dynemb"]):
            for w, g in zip(want, got):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
