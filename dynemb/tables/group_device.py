"""A table group's training prefetch on a backend that must not wait for the device (CUDA):
the same one dedup, one claim and one initialization per group as ``TableGroup.prefetch``,
with nothing read back on the host.

What the host cannot know without waiting, it does not need:

- **Sizes.** Each table's unique keys are padded to its number of input keys (``EMPTY_KEY``,
  count 0, slot -1), so the unique bounds are the key bounds, known from the input.
- **Failures.** A key that finds no slot (its bucket full of pinned rows, or NO_EVICTION) is
  served zeros and not trained, as a CUDA table alone does; each table's count of them is
  copied to the host without waiting and raised at a later prefetch
  (:class:`GroupFailures`).
- **Per-table values** (bounds, clocks) go to the device through pinned memory
  (:func:`dynemb.foundations.device_values.values_on`).

Within a table, the unique keys come sorted (as ``dedup.padded_unique`` sorts a table's own),
each at its table's position in the key bounds.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from dynemb.foundations.counters import COUNTER_NAMES
from dynemb.foundations.device_values import values_on
from dynemb.backends.protocol import Segments
from dynemb.tables.group_batch import GroupBatch, given_counts, key_bounds_of
from dynemb.types import EMPTY_KEY, TOMBSTONE_KEY, ScorePolicy, TableFullError

#: The counters a training prefetch adds to, in the order :meth:`DeviceGroupPrefetch._count`
#: sums them: the first columns of the counters, so that it adds to a view (indexing with a
#: list would copy the list to the device and wait for it).
PREFETCH_COUNTERS = ("lookups", "unique_keys", "hits", "misses", "inserts", "evictions")
assert COUNTER_NAMES[:len(PREFETCH_COUNTERS)] == PREFETCH_COUNTERS


class GroupFailures:
    """Per table of a group, the keys that found no slot, counted on the device and copied to
    the host without waiting; :meth:`check` raises at a later prefetch once the copy is in."""

    def __init__(self, names: Sequence[str], device: torch.device):
        self.names = list(names)
        self.total = torch.zeros(len(names), dtype=torch.int64, device=device)
        self._on_gpu = device.type == "cuda"
        self.host = torch.zeros(len(names), dtype=torch.int64, pin_memory=self._on_gpu)
        self._event = None

    def record(self, per_table: torch.Tensor) -> None:
        self.total += per_table
        self.host.copy_(self.total, non_blocking=self._on_gpu)
        if self._on_gpu:
            self._event = torch.cuda.Event()
            self._event.record()

    def check(self) -> None:
        if self._event is not None and not self._event.query():
            return
        counts = self.host.tolist()
        if not any(counts):
            return
        self.total.zero_()
        self.host.zero_()
        named = ", ".join(f"{name!r}: {n}" for name, n in zip(self.names, counts) if n)
        raise TableFullError(
            f"tables {named} keys of earlier batches found no slot (buckets full of pinned "
            f"rows or NO_EVICTION) and were served zeros without being trained",
            torch.empty(0, dtype=torch.int64), None)


class DeviceGroupPrefetch:
    """``TableGroup.prefetch`` without host reads, for a group on the CUDA kernels."""

    def __init__(self, group):
        self.group = group
        device = group.device
        self.device = device
        self.row_offset = values_on(group.row_offset[:-1], torch.int64, device)
        self.num_buckets = values_on(group.bucket_counts.tolist(), torch.int64, device)
        self.seeds = values_on(group.seeds.tolist(), torch.int64, device)
        self.table_ids = values_on(group.table_ids.tolist(), torch.int64, device)
        self.init_kinds = values_on(group.init_kinds.tolist(), torch.int64, device)
        self.init_params = [values_on(p.tolist(), torch.float64, device)
                            for p in group.init_params]
        evals = [t.options.eval_initializer.kernel_params() for t in group.tables]
        self.eval_kinds = values_on([p[0] for p in evals], torch.int64, device)
        self.eval_params = [values_on([p[i] for p in evals], torch.float64, device)
                            for i in range(1, 5)]
        self.failures = GroupFailures(group.names, device)

    def _dedup(self, keys: Sequence[torch.Tensor],
               occurrences: Sequence[Optional[torch.Tensor]]):
        """(key bounds, every table's segment of the keys, unique keys padded per table,
        inverse, counts, the given occurrences or None) of every table's keys."""
        key_bounds = key_bounds_of(keys)
        segments = Segments(key_bounds, self.device)
        all_keys = torch.cat(list(keys)) if len(keys) > 1 else keys[0]
        unique, inverse, counts, _ = self.group.kernels.dedup_segments(all_keys, segments)
        counts, given = given_counts(keys, occurrences, inverse, counts)
        return key_bounds, segments, unique, inverse, counts, given

    def lookup_batch(self, keys: Sequence[torch.Tensor],
                     occurrences: Sequence[Optional[torch.Tensor]]) -> GroupBatch:
        """A read-only (eval) lookup of every table's ``keys``, as
        :mod:`dynemb.tables.group_eval` does on the host kernels, with nothing read back:
        found keys pinned until released, the others' eval rows in ``batch.fallback``."""
        group = self.group
        key_bounds, segments, unique, inverse, counts, given = self._dedup(keys, occurrences)
        seg = segments.table_of
        slots = torch.empty_like(unique)
        group.kernels.find_group(group.arrays, segments, self.row_offset, self.num_buckets,
                                 unique, slots)
        group.kernels.add_refcounts(group.arrays, slots, 1)
        batch = GroupBatch(group, unique, inverse, counts, list(key_bounds), key_bounds, slots)
        batch.seg, batch.training = seg, False
        for table in group.tables:
            table.hold_group_batch(batch)
        real = unique != EMPTY_KEY
        found = slots >= 0
        batch.fallback = torch.zeros(unique.numel(), group.dim, device=self.device)
        group.kernels.init_rows_at_group(
            batch.fallback, torch.arange(unique.numel(), device=self.device), unique,
            real & ~found, segments, group.dim, self.seeds, self.table_ids, self.eval_kinds,
            *self.eval_params)
        lookups = torch.ones_like(seg) if given is None else given
        columns = torch.stack([lookups, real.to(torch.int64), found.to(torch.int64),
                               (real & ~found).to(torch.int64)], 1)
        group.counters[:, :4] += torch.zeros(len(group.tables), 4, dtype=torch.int64,
                                             device=self.device).index_add_(0, seg, columns)
        return batch

    def prefetch(self, keys: Sequence[torch.Tensor], occurrences: Sequence[Optional[torch.Tensor]],
                 scores: Sequence[Optional[int]]) -> GroupBatch:
        """Claim and pin the rows of every table's ``keys`` (see ``TableGroup.prefetch``)."""
        group = self.group
        self.failures.check()
        key_bounds, segments, unique, inverse, counts, given = self._dedup(keys, occurrences)
        seg = segments.table_of
        slots, inserted, prev_keys, prev_scores = self._claim(segments, unique, counts, scores)
        batch = GroupBatch(group, unique, inverse, counts, list(key_bounds), key_bounds, slots)
        batch.seg = seg
        for table in group.tables:
            table.hold_group_batch(batch)
        try:
            group.track_changes((unique, slots, inserted, prev_keys, prev_scores, key_bounds))
            if group.weights.dtype == torch.float32:
                group.kernels.init_rows_at_group(
                    group.weights, slots, unique, inserted, segments, group.dim, self.seeds,
                    self.table_ids, self.init_kinds, *self.init_params)
            else:  # float16 / bfloat16 rows: table by table
                group.initialize_rows(slots, unique, inserted, key_bounds)
        except Exception:
            group.release(batch)
            raise
        self._count(seg, unique, slots, inserted, prev_keys, given)
        return batch

    def _claim(self, segments, unique, counts, scores):
        """(slots, inserted, previous keys, previous scores) of one pinning claim of every
        table's unique keys, each table at its next clock; the keys that found no slot go to
        :attr:`failures`."""
        group = self.group
        clocks = values_on([t.tier.hash.tick() for t in group.tables], torch.int64,
                           self.device)
        slots, prev_keys, prev_scores = (torch.empty_like(unique) for _ in range(3))
        inserted = torch.empty(unique.shape, dtype=torch.bool, device=self.device)
        failed = torch.empty_like(inserted)
        if group.policy is ScorePolicy.CUSTOMIZED:  # each table's score, for its keys
            given = values_on(list(scores), torch.int64, self.device)[segments.table_of]
        else:
            given = unique.new_zeros(1).expand(unique.shape)
        group.kernels.find_or_insert_group(
            group.arrays, group.arrays.size, segments, self.row_offset, self.num_buckets, unique,
            counts, given, group.policy.code, clocks, group.allows_eviction, slots, inserted,
            prev_keys, prev_scores, failed)
        self.failures.record(torch.zeros(len(group.tables), dtype=torch.int64,
                                         device=self.device)
                             .index_add_(0, segments.table_of, failed.to(torch.int64)))
        return slots, inserted, prev_keys, prev_scores

    def _count(self, seg, unique, slots, inserted, prev_keys, given) -> None:
        """Every table's lookups, unique keys, hits, misses, inserts and evictions, summed
        per table on the device in one ``index_add_``."""
        group = self.group
        hits = (slots >= 0) & ~inserted
        evicted = inserted & (prev_keys != EMPTY_KEY) & (prev_keys != TOMBSTONE_KEY)
        real = unique != EMPTY_KEY
        lookups = (torch.ones_like(seg) if given is None else given)
        columns = torch.stack([lookups, real.to(torch.int64), hits.to(torch.int64),
                               (real & ~hits).to(torch.int64), inserted.to(torch.int64),
                               evicted.to(torch.int64)], 1)
        per_table = torch.zeros(len(group.tables), columns.shape[1], dtype=torch.int64,
                                device=self.device).index_add_(0, seg, columns)
        group.counters[:, :len(PREFETCH_COUNTERS)] += per_table
