"""Stateful property tests: random operation sequences against the pure-Python model.

Checked after every step: the live (key, slot, score) set, size and pin count equal the
model's. Checked per insert: hits keep their slot, new keys land in their bucket, each full
bucket evicts exactly the lowest-score unpinned keys that were there before the call (never a
pinned key, never a key of the same batch), and keys fail only when their bucket has no
candidate left (the raising mode then leaves the table as it was).
"""
import copy

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conftest import BACKENDS, ON_GPU
from dynemb import ScorePolicy, TableFullError
from dynemb.rows.hash_table import ScoredHashTable
from reference_model import Entry, ModelTable, batch_stats, bucket_of

KEY_POOL = st.one_of(st.integers(-40, 120), st.sampled_from([2**62, -(2**62), 2**63 - 1]))
KEYS = st.lists(KEY_POOL, min_size=0, max_size=12)


def make_machine(policy: ScorePolicy, backend: str, device: str, capacity: int, bucket: int):
    custom = policy is ScorePolicy.CUSTOMIZED

    class HashTableMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.table = ScoredHashTable(capacity, bucket_size=bucket, policy=policy,
                                         device=device, backend=backend)
            self.model = ModelTable(capacity // bucket, bucket, policy.value)

        def tensor(self, values):
            return torch.tensor(values, dtype=torch.int64, device=device)

        def scores_for(self, keys, data):
            if not custom:
                return None
            return data.draw(st.lists(st.integers(-5, 30), min_size=len(keys),
                                      max_size=len(keys)))

        @rule(keys=KEYS, pin=st.booleans(), report=st.booleans(), data=st.data())
        def find_or_insert(self, keys, pin, report, data):
            scores = self.scores_for(keys, data)
            model = self.model
            before = copy.deepcopy(model.entries)
            counts, given = batch_stats(keys, scores)
            expected_fail = self.expected_failures(counts)
            try:
                res = self.table.find_or_insert(
                    self.tensor(keys), None if scores is None else self.tensor(scores), pin=pin,
                    on_failure="report" if report else "raise")
            except TableFullError as err:
                assert not report and sum(expected_fail.values()) > 0
                assert set(err.failed_keys.tolist()) <= set(counts)
                self.check_matches_model()  # unchanged
                return
            assert sum(expected_fail.values()) == 0 or report
            model.clock += 1
            got = dict(zip(res.keys.tolist(), range(res.keys.numel())))
            assert set(got) == set(counts)
            assert res.keys[res.inverse].tolist() == keys
            slots, inserted = res.slots.tolist(), res.inserted.tolist()
            failed, prev = res.failed.tolist(), res.previous_keys.tolist()
            evicted = res.evicted.tolist()
            evicted_by_bucket, failed_by_bucket = {}, {}
            for k, i in got.items():
                b = bucket_of(k, model.num_buckets)
                if k in before:
                    assert slots[i] == before[k].slot and not inserted[i] and not failed[i]
                    e = model.entries[k]
                    e.score = model.hit_score(e.score, counts[k], given.get(k, 0))
                    e.pins += pin
                    continue
                if failed[i]:
                    assert slots[i] == -1 and not inserted[i]
                    failed_by_bucket[b] = failed_by_bucket.get(b, 0) + 1
                    continue
                assert inserted[i] and slots[i] in model.slot_range(k)
                if evicted[i]:
                    evicted_by_bucket.setdefault(b, []).append(prev[i])
            for b, victims in evicted_by_bucket.items():
                candidates = self.candidates(b, counts, before)
                assert set(victims) <= set(candidates), "evicted a pinned or same-batch key"
                lowest = sorted(before[k].score for k in candidates)[:len(victims)]
                assert sorted(before[k].score for k in victims) == lowest
                assert len(victims) == self.expected_evictions(b, counts, before)
                for k in victims:
                    del model.entries[k]
            assert failed_by_bucket == {b: n for b, n in expected_fail.items() if n}
            for k, i in got.items():
                if inserted[i]:
                    model.entries[k] = Entry(
                        slots[i], model.insert_score(counts[k], given.get(k, 0)), int(pin))

        def candidates(self, bucket, counts, entries):
            if policy is ScorePolicy.NO_EVICTION:
                return []
            return [k for k in self.model_bucket(bucket, entries)
                    if entries[k].pins == 0 and k not in counts]

        def model_bucket(self, bucket, entries):
            return [k for k in entries if bucket_of(k, self.model.num_buckets) == bucket]

        def missing_by_bucket(self, counts):
            out = {}
            for k in counts:
                if k not in self.model.entries:
                    b = bucket_of(k, self.model.num_buckets)
                    out[b] = out.get(b, 0) + 1
            return out

        def expected_evictions(self, bucket, counts, entries):
            missing = self.missing_by_bucket(counts).get(bucket, 0)
            free = self.model.bucket_size - len(self.model_bucket(bucket, entries))
            return min(max(0, missing - free), len(self.candidates(bucket, counts, entries)))

        def expected_failures(self, counts):
            entries = self.model.entries
            out = {}
            for b, missing in self.missing_by_bucket(counts).items():
                free = self.model.bucket_size - len(self.model_bucket(b, entries))
                out[b] = max(0, missing - free - len(self.candidates(b, counts, entries)))
            return out

        @rule(keys=KEYS, update=st.booleans(), data=st.data())
        def find(self, keys, update, data):
            scores = self.scores_for(keys, data) if update else None
            slots = self.table.find(self.tensor(keys), update_scores=update,
                                    scores=None if scores is None else self.tensor(scores))
            model = self.model
            assert slots.tolist() == [model.entries[k].slot if k in model.entries else -1
                                      for k in keys]
            if update:
                model.clock += 1
                counts, given = batch_stats(keys, scores)
                for k in counts:
                    if k in model.entries:
                        e = model.entries[k]
                        e.score = model.hit_score(e.score, counts[k], given.get(k, 0))

        @rule(keys=KEYS)
        def erase(self, keys):
            res = self.table.erase(self.tensor(keys))
            erased, pinned = res.erased.tolist(), res.pinned.tolist()
            for k in set(keys):
                idx = [i for i, x in enumerate(keys) if x == k]
                e = self.model.entries.get(k)
                if e is None:
                    assert not any(erased[i] or pinned[i] for i in idx)
                elif e.pins:
                    assert all(pinned[i] and not erased[i] for i in idx)
                else:
                    assert sum(erased[i] for i in idx) == 1
                    del self.model.entries[k]

        @precondition(lambda self: self.model.entries)
        @rule(data=st.data())
        def pin(self, data):
            keys = data.draw(st.lists(st.sampled_from(sorted(self.model.entries)), max_size=4))
            self.table.pin(self.tensor([self.model.entries[k].slot for k in keys]))
            for k in keys:
                self.model.entries[k].pins += 1

        @precondition(lambda self: any(e.pins for e in self.model.entries.values()))
        @rule(data=st.data())
        def unpin(self, data):
            pinned = sorted(k for k, e in self.model.entries.items() if e.pins)
            k = data.draw(st.sampled_from(pinned))
            self.table.unpin(self.tensor([self.model.entries[k].slot]))
            self.model.entries[k].pins -= 1

        @precondition(lambda self: self.table.capacity < 4 * capacity)
        @rule()
        def grow(self):
            remap = self.table.grow(self.table.capacity * 2)
            self.model.grow(self.model.num_buckets * 2, remap.tolist())

        @rule(chunk=st.integers(1, 40))
        def export_in_chunks(self, chunk):
            start, seen = 0, []
            while start < self.table.capacity:
                part = self.table.export(start, chunk)
                assert all(start <= s < part.next_start for s in part.slots.tolist())
                seen += list(zip(part.keys.tolist(), part.slots.tolist(), part.scores.tolist()))
                start = part.next_start
            assert sorted(seen) == sorted(self.model.live_triples())

        @invariant()
        def check_matches_model(self):
            exported = self.table.export()
            triples = set(zip(exported.keys.tolist(), exported.slots.tolist(),
                              exported.scores.tolist()))
            assert triples == self.model.live_triples()
            assert self.table.size() == len(self.model.entries)
            assert self.table.pinned_count() == sum(e.pins > 0 for e in self.model.entries.values())
            assert self.table.clock == self.model.clock

    return HashTableMachine


SIMULATED = not ON_GPU


@pytest.mark.parametrize("backend,device", BACKENDS, ids=[b for b, _ in BACKENDS])
@pytest.mark.parametrize("policy", list(ScorePolicy), ids=lambda p: p.value)
@pytest.mark.parametrize("capacity,bucket", [(32, 8), (16, 4)], ids=["32x8", "16x4"])
def test_hash_table_matches_model(policy, backend, device, capacity, bucket):
    machine = make_machine(policy, backend, device, capacity, bucket)
    slow = backend == "cuda" and SIMULATED
    machine.TestCase.settings = settings(
        max_examples=8 if slow else 40, stateful_step_count=12 if slow else 30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    machine.TestCase().runTest()
