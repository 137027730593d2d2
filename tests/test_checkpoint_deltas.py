"""Incremental dumps (dump(since=...)): a full dump and the deltas after it, loaded in order,
give back every tier of every table as it was at the last delta (keys, rows, optimizer
state, scores, clocks, step, counters) while the tables evict, grow, write back to and evict
from a CACHE store; a delta holds what changed (about 1% of the rows after touching 1%); a
random sequence of training, dumps and loads always reproduces the last dump."""
import json
import weakref
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from checkpoint_files_models import (assert_same_rows, assert_same_state, logical_rows, make,
                                     module_state)
from checkpoint_models import MODES, batches, train
from conftest import BACKENDS
from dynemb import ScorePolicy
from dynemb.checkpoint import changes, dump, load
from dynemb.checkpoint.files import CheckpointFileError

KJTS = batches(30, seed=11, batch=12)  # small batches: they fit 32 device rows


def chain(tmp_path, ec, cuts=(1, 10, 18)):
    """Train ``ec``; a full dump at the first cut, deltas at the others. Returns the paths,
    the infos and the module's state at the last dump."""
    paths, infos, done = [], [], 0
    for i, cut in enumerate(cuts):
        train(ec, [kjt.to(ec.device) for kjt in KJTS[done:cut]])
        done = cut
        paths.append(tmp_path / f"d{i}")
        infos.append(dump(ec, paths[-1], since=infos[-1] if infos else None))
    return paths, infos, module_state(ec)


@pytest.mark.parametrize("policy", [ScorePolicy.LRU, ScorePolicy.LFU, ScorePolicy.STEP,
                                    ScorePolicy.LFU_LRU, ScorePolicy.CUSTOMIZED])
@pytest.mark.parametrize("mode", MODES)
def test_a_full_dump_and_its_deltas_give_back_the_last_dump(tmp_path, mode, policy):
    kwargs = dict(mode=mode, optimizer="adam", policy=policy, evicting=True)
    ec = make(**kwargs)
    paths, infos, expected = chain(tmp_path, ec)
    counters = ec.stats()["t0"]
    assert counters["evictions"] > 0
    if mode == "cache":
        assert counters["write_backs"] > 0 and counters["loads"] > 0
    if mode == "hbm_direct":  # it grew after the full dump
        full = json.loads((paths[0] / "rank0_of_1" / "manifest.json").read_text())
        assert full["tables"]["t0"]["tiers"]["device"]["capacity"] < ec.tables[
            "t0"].tier.hash.capacity
    assert [i.kind for i in infos] == ["full", "delta", "delta"]
    assert infos[2].previous == infos[1].id and infos[1].previous == infos[0].id
    train(ec, KJTS[18:22])  # the live module moves on
    resumed = make(**kwargs)
    info = load(resumed, paths)
    assert_same_state(module_state(resumed), expected)
    assert info.id == infos[-1].id and info.rows == sum(i.rows for i in infos)


@pytest.mark.parametrize("mode", MODES)
def test_the_sync_free_cuda_path_tracks_the_same_changes(tmp_path, mode):
    # padded batches, failures recorded instead of raised: -1 slots mark nothing
    kwargs = dict(mode=mode, optimizer="sgd", evicting=True, backend="cuda",
                  device=torch.device(BACKENDS[1][1]))
    ec = make(**kwargs)
    paths, _, expected = chain(tmp_path, ec, cuts=(1, 4, 7))
    assert mode == "default" or ec.stats()["t0"]["evictions"] > 0
    resumed = make(**kwargs)
    load(resumed, paths)
    assert_same_state(module_state(resumed), expected)


@pytest.mark.parametrize("mode", MODES)
def test_the_admission_counter_and_half_rows_follow_the_chain(tmp_path, mode):
    kwargs = dict(mode=mode, optimizer="rowwise_adagrad", admission=True, evicting=True,
                  dtype=torch.float16)
    ec = make(**kwargs)
    paths, _, expected = chain(tmp_path, ec)
    assert ec.stats()["t0"]["admission_rejects"] > 0
    resumed = make(**kwargs)
    load(resumed, paths)
    assert_same_state(module_state(resumed), expected)


def test_a_store_that_evicted_is_written_whole_and_the_chain_stays_exact(tmp_path):
    ec = make(mode="cache", optimizer="sgd", evicting=True, store_evicts=True)
    paths, _, expected = chain(tmp_path, ec)
    assert ec.stats()["t0"]["store_evictions"] > 0
    manifest = json.loads((paths[2] / "rank0_of_1" / "manifest.json").read_text())
    tiers = manifest["tables"]["t0"]["tiers"]
    assert tiers["host"]["write"] == "replace" and tiers["device"]["write"] == "patch"
    resumed = make(mode="cache", optimizer="sgd", evicting=True, store_evicts=True)
    load(resumed, paths)
    assert_same_state(module_state(resumed), expected)


@pytest.mark.parametrize("mode", MODES)
def test_a_chain_loads_by_key_into_another_layout(tmp_path, mode):
    ec = make(mode=mode, optimizer="rowwise_adagrad", evicting=True)
    paths, _, _ = chain(tmp_path, ec)
    expected = logical_rows(ec)
    # other buckets, and room: the saved tables are full, their keys fit only where they are
    resumed = make(mode=mode, optimizer="rowwise_adagrad", evicting=True, bucket_size=16,
                   max_capacity=256)
    load(resumed, paths)
    assert_same_rows(logical_rows(resumed), expected)
    assert resumed.steps == ec.steps


class DictStore:
    """A user backing store (no hash table of ours): rows and scores in a dict."""

    def __init__(self, width, dtype, device):
        self.width, self.dtype, self.entries = width, dtype, {}

    def find(self, keys):
        got = [self.entries.get(int(k)) for k in keys]
        rows = torch.stack([g[0] if g else torch.zeros(self.width, dtype=self.dtype)
                            for g in got]) if got else torch.zeros(0, self.width)
        found = torch.tensor([g is not None for g in got], dtype=torch.bool)
        scores = torch.tensor([g[1] if g else 0 for g in got], dtype=torch.int64)
        return rows, found, scores

    def insert(self, keys, rows, scores):
        for k, r, s in zip(keys.tolist(), rows.clone(), scores.tolist()):
            self.entries[k] = (r, s)
        return 0

    def export(self, start, batch):
        keys = sorted(self.entries)[start:start + batch]
        rows = torch.stack([self.entries[k][0] for k in keys]) if keys else torch.zeros(
            0, self.width, dtype=self.dtype)
        nxt = start + batch if start + batch < len(self.entries) else None
        return torch.tensor(keys, dtype=torch.int64), rows, nxt

    def size(self):
        return len(self.entries)


def test_a_cache_with_a_user_store_follows_the_chain_by_key(tmp_path):
    kwargs = dict(mode="cache", optimizer="adam", evicting=True, backing_store=DictStore)
    ec = make(**kwargs)
    paths, _, _ = chain(tmp_path, ec)
    assert ec.stats()["t0"]["write_backs"] > 0
    expected = logical_rows(ec)
    manifest = json.loads((paths[2] / "rank0_of_1" / "manifest.json").read_text())
    assert manifest["tables"]["t0"]["tiers"]["host"]["write"] == "patch"
    resumed = make(**kwargs)
    load(resumed, paths)
    assert_same_rows(logical_rows(resumed), expected)


def test_deltas_continue_after_a_load(tmp_path):
    ec = make(mode="default", optimizer="adagrad", evicting=True)
    paths, infos, _ = chain(tmp_path, ec)
    resumed = make(mode="default", optimizer="adagrad", evicting=True)
    loaded = load(resumed, paths)
    train(resumed, KJTS[18:24])
    paths.append(tmp_path / "after")
    dump(resumed, paths[-1], since=loaded)
    expected = module_state(resumed)
    third = make(mode="default", optimizer="adagrad", evicting=True)
    load(third, paths)
    assert_same_state(module_state(third), expected)


def test_updates_of_batches_looked_up_before_the_dump_are_in_the_next_delta(tmp_path):
    ec = make(mode="cache", optimizer="adam")
    train(ec, KJTS[:6])
    out = ec(KJTS[6])  # looked up before the dump, its backward runs after
    ec.prefetch(KJTS[7])  # prefetched before the dump, trained after
    base = dump(ec, tmp_path / "base")
    sum(jt.values().sum() for jt in out.values()).backward()
    train(ec, KJTS[7:9])
    dump(ec, tmp_path / "delta", since=base)
    expected = module_state(ec)
    resumed = make(mode="cache", optimizer="adam")
    load(resumed, [tmp_path / "base", tmp_path / "delta"])
    assert_same_state(module_state(resumed), expected)


def test_a_delta_after_touching_one_percent_of_the_rows_holds_about_one_percent(tmp_path):
    ec = make(mode="hbm_direct", optimizer="adam", max_capacity=32768, init_capacity=32768)
    ids = torch.arange(10_000) * 3 + 5
    for chunk in ids.split(2_500):
        train(ec, [kjt_of(chunk)])
    full = dump(ec, tmp_path / "full")
    assert full.rows == 2 * 10_000
    train(ec, [kjt_of(ids[:100])])
    delta = dump(ec, tmp_path / "delta", since=full)
    assert delta.rows == 2 * 100 and delta.deleted == 0
    assert delta.bytes < 0.02 * full.bytes
    resumed = make(mode="hbm_direct", optimizer="adam", max_capacity=32768,
                   init_capacity=32768)
    load(resumed, [tmp_path / "full", tmp_path / "delta"])
    assert_same_state(module_state(resumed), module_state(ec))


def kjt_of(ids):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    return KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], torch.cat([ids, ids]),
                                               torch.tensor([ids.numel(), ids.numel()]))


# -- refused deltas and chains --------------------------------------------------------------------
def test_since_must_name_the_latest_dump_of_the_same_module(tmp_path):
    ec = make()
    train(ec, KJTS[:3])
    with pytest.raises(ValueError, match="has not been dumped"):
        dump(ec, tmp_path / "x", since=tmp_path / "x")  # never dumped: no manifest either
    first = dump(ec, tmp_path / "a")
    second = dump(ec, tmp_path / "b", since=first)
    with pytest.raises(ValueError, match=f"latest dump of table 't0' is {second.id}"):
        dump(ec, tmp_path / "c", since=first)
    with pytest.raises(ValueError, match="cannot be written over the dump it follows"):
        dump(ec, tmp_path / "b", since=tmp_path / "b")
    ec.load_state_dict(ec.state_dict())
    with pytest.raises(ValueError, match="loaded from a checkpoint after dump"):
        dump(ec, tmp_path / "c", since=second)
    assert not (tmp_path / "c").exists()


def test_a_chain_out_of_order_is_refused(tmp_path):
    ec = make()
    paths, _, _ = chain(tmp_path, ec)
    with pytest.raises(CheckpointFileError, match="is a delta .* load its full dump first"):
        load(make(), paths[1:])
    with pytest.raises(CheckpointFileError, match=r"d2.* does not follow .*d0"):
        load(make(), [paths[0], paths[2]])
    with pytest.raises(CheckpointFileError, match="is a full dump, it does not follow"):
        load(make(), [paths[0], paths[0]])


# -- the tracker ----------------------------------------------------------------------------------
def test_touched_marks_and_base_keys_follow_growth_and_logs_compact(monkeypatch):
    marks = changes.TierChanges(8, torch.device("cpu"))
    marks.mark(torch.tensor([1, -1, 5]), torch.tensor([10, changes.EMPTY_KEY, 50]))
    marks.mark(torch.tensor([5, 6]), torch.tensor([51, 60]))  # 5 keeps its first key
    assert marks.touched.nonzero().flatten().tolist() == [1, 5, 6]
    marks.remap(torch.tensor([-1, 9, 3, -1, -1, 12, 0, -1]), 16)
    assert marks.touched.nonzero().flatten().tolist() == [0, 9, 12]
    assert marks.left_keys().tolist() == [10, 50, 60]
    monkeypatch.setattr(changes, "COMPACT_AT", 4)
    log = changes.KeyLog()
    logged = []
    for keys in ([3, changes.EMPTY_KEY, 3], [7, 3], [3, 7, 8]):
        part = torch.tensor(keys)
        logged.append(weakref.ref(part))
        log.add(part)
        del part
    # the last add compacted the log: it holds none of the logged tensors any more
    assert [ref() for ref in logged] == [None, None, None]
    assert log.keys().tolist() == [3, 7, 8]


# -- property -------------------------------------------------------------------------------------
OPS = st.lists(st.one_of(st.tuples(st.just("train"), st.integers(1, 3)),
                         st.sampled_from([("full",), ("delta",), ("load",)])),
               min_size=3, max_size=9)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mode=st.sampled_from(MODES),
       policy=st.sampled_from([ScorePolicy.LRU, ScorePolicy.LFU, ScorePolicy.LFU_LRU,
                               ScorePolicy.CUSTOMIZED]),
       ops=OPS)
def test_any_sequence_of_training_dumps_and_loads_reproduces_the_last_dump(tmp_path_factory,
                                                                          mode, policy, ops):
    """The live module is loaded back from its own chain at random points, and keeps
    training and dumping from there; every load gives back the last dump exactly."""
    kwargs = dict(mode=mode, optimizer="adam", policy=policy, admission=mode == "default",
                  evicting=True, store_evicts=mode == "cache")
    root = Path(tmp_path_factory.mktemp("chain"))
    ec, kjts, step = make(**kwargs), KJTS, 0
    paths, last, expected = [], None, None
    for op in ops + [("delta",)]:
        if op[0] == "train":
            train(ec, kjts[step:step + op[1]])
            step += op[1]
        elif op[0] == "full" or (op[0] == "delta" and last is None):
            paths = [root / f"{len(list(root.iterdir()))}"]
            last = dump(ec, paths[-1])
            expected = module_state(ec)
        elif op[0] == "delta":
            paths.append(root / f"{len(list(root.iterdir()))}")
            last = dump(ec, paths[-1], since=last)
            expected = module_state(ec)
        elif last is not None:
            last = load(ec, paths)
            assert_same_state(module_state(ec), expected)
    fresh = make(**kwargs)
    load(fresh, paths)
    assert_same_state(module_state(fresh), expected)
