"""``write_rows`` of a row-wise sharded module on 2 spawned CPU ranks (gloo): each rank's keys
go to their owners, who hold exactly the rows written (read back bit for bit with their
optimizer state, and looked up by the sharded forward from any rank); bad input on one
rank, a key sent by two ranks, a share that does not fit, or optimizer state from one rank
only make every rank raise, with no rank's tables changed (tests/sharded_writes_worker.py)."""
import pytest

from tests.sharded_checks import spawn_scenarios
from tests.sharded_writes_worker import run_writes


@pytest.fixture(scope="module")
def ranks():
    return spawn_scenarios(2, run_writes, {"writes": None})["writes"]


def test_each_owner_holds_the_rows_written_and_the_forward_reads_them(ranks):
    for res in ranks:
        for table, read in res["reads"].items():
            assert read["found_is_owned"] and read["rows"] and read["state"], table
        assert res["forward"]
    for table in ("t0", "t1"):  # 62 keys written, each counted once, by its owner
        inserted = sum(res["reads"][table]["inserted_overwritten"][0] for res in ranks)
        overwritten = sum(res["reads"][table]["inserted_overwritten"][1] for res in ranks)
        assert inserted + overwritten == 62 and overwritten > 0 and inserted > 0


@pytest.mark.parametrize("case,error", [
    ("bad_rows", "ValueError"), ("twice", "ValueError"), ("full", "TableFullError"),
    ("state_on_one_rank", "ValueError")])
def test_a_refusal_on_one_rank_raises_on_every_rank_and_changes_nothing(ranks, case, error):
    for res in ranks:
        assert res[case]["error"] is not None and res[case]["error"].startswith(error), \
            res[case]["error"]
        assert res[case]["unchanged"]
