"""Sharded loads on spawned gloo ranks (see tests/checkpoint_reload_worker.py):

- under ``DistributedModelParallel`` on 2 ranks, a state dict lacking a table (its entries
  saved under another table's name) loads with ``strict=False`` as TorchRec's
  ``EmbeddingCollection`` does (its sharded one cannot: its load pre-hook raises
  ``KeyError``): the tables present load, the absent one is a missing key, the unknown one
  unexpected; with ``strict=True`` it raises as TorchRec's does, and no dynamic table
  changes;
- a DCP checkpoint of 2 ranks whose per-rank budget made its tables HBM_DIRECT loads on 1
  rank, where the same budget makes them CACHE, with ``DynamicEmbLoadPlanner``, and back
  (rows cached and rows only in the store onto 2 HBM_DIRECT shares): every saved row,
  optimizer state and score comes back, on its owner.
"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the spawned ranks import the worker

from examples.spawn import run_on_ranks  # noqa: E402
from checkpoint_reload_worker import IDS, TABLES, run, tables_in  # noqa: E402


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("reload") / "world2")
    partial, saved = zip(*run_on_ranks(2, run, [("partial_load", ()),
                                                ("save_in_own_mode", (path,))], timeout=600))
    return path, partial, saved


@pytest.fixture(scope="module")
def one_rank(two_ranks):
    path = str(Path(two_ranks[0]).parent / "world1")
    (loaded,), = run_on_ranks(1, run, [("load_in_own_mode", (two_ranks[0], path))],
                              timeout=600)
    return path, loaded


@pytest.fixture(scope="module")
def two_ranks_again(one_rank):
    return [loaded for (loaded,) in run_on_ranks(2, run, [("load_in_own_mode", (one_rank[0],))],
                                                 timeout=600)]


def _check_entries(expected, got):
    for table in TABLES:
        assert len(expected[table]) > 30 and sorted(got[table]) == sorted(expected[table])
        assert set(got[table]) <= set(IDS.tolist())
        for key, (row, score) in expected[table].items():
            assert torch.equal(got[table][key][0], row), (table, key)
            assert got[table][key][1] == score, (table, key)


def _no_error(*results):
    for result in results:
        assert "error" not in result, result["error"]


def test_without_strict_the_tables_present_load_as_torchrecs_do(two_ranks):
    for rank in two_ranks[1]:
        dyn, ec = rank[("dyn", False)], rank[("ec", False)]
        _no_error(dyn, ec)
        assert tables_in(dyn["missing"]) == tables_in(ec["missing"]) == ["t1"]
        assert tables_in(dyn["unexpected"]) == tables_in(ec["unexpected"]) == ["t9"]
        assert len(dyn["missing"]) == 1
        saved_rows, saved_count = rank["saved"]["t0"]
        rows, count = dyn["after"]["t0"]
        assert saved_count.sum() > 20 and torch.equal(count, saved_count)  # each on one owner
        assert torch.equal(rows, saved_rows)
        for was, now in zip(dyn["before"]["t1"], dyn["after"]["t1"]):
            assert torch.equal(was, now)


def test_with_strict_the_load_raises_as_torchrecs_and_no_table_changes(two_ranks):
    for rank in two_ranks[1]:
        dyn, ec = rank[("dyn", True)], rank[("ec", True)]
        for result in (dyn, ec):
            assert "Missing key(s) in state_dict" in result.get("error", ""), result
            assert "t1" in result["error"] and "t9" in result["error"]
        for name in TABLES:
            for was, now in zip(dyn["before"][name], dyn["after"][name]):
                assert torch.equal(was, now)


def test_a_checkpoint_of_hbm_direct_shares_loads_into_one_cache_table(two_ranks, one_rank):
    saved, loaded = two_ranks[2], one_rank[1]
    _no_error(*saved, loaded)
    assert set(saved[0]["modes"].values()) == {"hbm_direct"}
    assert set(loaded["modes"].values()) == {"cache"}
    assert loaded["rows_backing"] > 0
    assert loaded["steps"] == saved[0]["steps"]
    _check_entries(saved[0]["entries"], loaded["entries"])


def test_a_checkpoint_of_one_cache_table_loads_into_hbm_direct_shares(one_rank,
                                                                      two_ranks_again):
    saved = one_rank[1]["saved"]
    _no_error(saved, *two_ranks_again)
    assert set(saved["modes"].values()) == {"cache"}
    cached, stored = saved["rows"]
    assert cached > 0 and stored > cached  # rows only in the store, rows cached over it
    got = {}
    for rank in two_ranks_again:
        assert set(rank["modes"].values()) == {"hbm_direct"}
        assert rank["steps"] == saved["steps"]
        for table, entries in rank["entries"].items():
            assert not set(entries) & set(got.get(table, {}))  # each key on one owner
            got.setdefault(table, {}).update(entries)
    _check_entries(saved["entries"], got)
