"""One kernel protocol: the CPU and CUDA backends implement the same operations of
``KernelBackend`` with the same signatures (the CUDA class is read without a GPU), and a
group operation called with the same arguments on either backend treats a lone table as a
group of one: it claims, finds and initializes exactly as the table's own operations do."""
import inspect

import pytest
import torch

from dynemb.backends import CpuBackend, get_backend
from dynemb.cuda_backend import CudaBackend
from dynemb.kernel_backend import INIT_UNIFORM, KernelBackend, Segments, TableArrays
from dynemb.types import ScorePolicy

#: Public members of a backend that are not kernel operations.
NOT_OPERATIONS = {"name", "defers_failures", "direct_launch_signatures"}


def operations(cls) -> set:
    return {name for name in dir(cls) if not name.startswith("_") and name not in NOT_OPERATIONS}


def parameters(cls, name):
    """``(name, kind, default)`` of each parameter of ``cls.name``, without ``self``."""
    member = inspect.getattr_static(cls, name)
    function = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
    found = list(inspect.signature(function).parameters.values())
    if not isinstance(member, staticmethod):
        found = found[1:]
    return [(p.name, p.kind, p.default) for p in found]


def test_cpu_and_cuda_implement_the_same_operations_with_the_same_signatures():
    protocol = operations(KernelBackend)
    assert operations(CpuBackend) == protocol
    assert operations(CudaBackend) == protocol
    for name in sorted(protocol):
        want = parameters(KernelBackend, name)
        assert parameters(CpuBackend, name) == want, f"CpuBackend.{name}"
        assert parameters(CudaBackend, name) == want, f"CudaBackend.{name}"


def test_the_group_operations_are_in_the_protocol():
    assert {"dedup_segments", "find_group", "find_or_insert_group", "claim_counts_group",
            "init_rows_at_group", "store_find_group", "store_moves_group", "occurrence_csr",
            "copy_rows", "remap_rows", "has_reserved_keys"} <= operations(KernelBackend)


def test_the_cuda_kernels_say_they_have_no_group_stores():
    """CACHE tables on the CUDA kernels do not group (``group_signature``): the host-store
    group operations refuse clearly instead of failing on a missing attribute."""
    cuda = CudaBackend.__new__(CudaBackend)  # no kernels loaded: the refusal comes first
    with pytest.raises(NotImplementedError, match="CACHE tables on them train alone"):
        cuda.store_find_group(*[None] * 10)
    with pytest.raises(NotImplementedError, match="CACHE tables on them train alone"):
        cuda.store_moves_group(*[None] * 26)


def test_segments_of_a_group_and_of_a_lone_table():
    segments = Segments([0, 3, 3, 5])
    assert segments.count == 3 and segments.table_of.tolist() == [0, 0, 0, 2, 2]
    assert Segments.single(4).table_of.tolist() == [0, 0, 0, 0]


def _claims(kernels, as_group, rounds):
    """Two claims of 80 keys each into one table of 64 slots (4 buckets of 16), the pins of
    the first dropped before the second (which then evicts): by the table's own
    ``find_or_insert`` or as a group of one. Returns the arrays and every output."""
    table = TableArrays.empty(64, 16, torch.device("cpu"))
    outputs = []
    for clock, ukeys in enumerate(rounds, start=5):
        n = ukeys.numel()
        counts, given = torch.arange(n) % 3 + 1, torch.zeros(n, dtype=torch.int64)
        slots, prev_keys, prev_scores = (torch.empty(n, dtype=torch.int64) for _ in range(3))
        inserted, failed = (torch.empty(n, dtype=torch.bool) for _ in range(2))
        if as_group:
            stats = torch.full((1, 3), -1, dtype=torch.int64)
            kernels.find_or_insert_group(
                table, table.size, Segments.single(n), torch.tensor([0]),
                torch.tensor([table.num_buckets]), ukeys, counts, given, ScorePolicy.LFU.code,
                torch.tensor([clock]), True, slots, inserted, prev_keys, prev_scores, failed,
                stats)
        else:
            stats = torch.zeros(2, dtype=torch.int64)
            kernels.find_or_insert(table, ukeys, counts, given, ScorePolicy.LFU.code, clock,
                                   True, True, slots, inserted, prev_keys, prev_scores, failed,
                                   stats)
        outputs.append((slots, inserted, prev_keys, prev_scores, failed, stats))
        kernels.add_refcounts(table, slots, -1)
    return table, outputs


@pytest.mark.parametrize("name", ["cpu", "cuda"])
def test_a_lone_table_is_a_group_of_one(name):
    """The same calls on both backends (per-table values as tensors: the CPU backend reads
    them as numpy, the CUDA simulator as device arrays)."""
    kernels = get_backend(name)
    gen = torch.Generator().manual_seed(3)
    rounds = [torch.randperm(200, generator=gen)[:80] + 1 for _ in range(2)]
    alone, alone_out = _claims(kernels, False, rounds)
    group, group_out = _claims(kernels, True, rounds)
    for a, b in zip(alone[:4], group[:4]):  # keys, scores, pins, size
        assert torch.equal(a, b)
    for a, b in zip(alone_out, group_out):
        for x, y in zip(a[:5], b[:5]):
            assert torch.equal(x, y)
        failed, evicted = a[5].tolist()
        added = int(b[1].sum()) - evicted
        assert b[5][0].tolist() == [added, evicted, failed] == [added, evicted,
                                                                int(b[4].sum())]
    assert group_out[1][5][0, 1] > 0  # the second claim evicted
    slots, inserted, prev_keys = group_out[1][:3]
    per_table = torch.zeros(1, 3, dtype=torch.int64)
    kernels.claim_counts_group(Segments.single(80), slots, inserted, prev_keys, per_table)
    assert per_table[0].tolist() == list(kernels.claim_summary(slots, inserted, prev_keys))

    ukeys = rounds[1]
    found_alone, found_group = (torch.empty(80, dtype=torch.int64) for _ in range(2))
    kernels.find(alone, ukeys, found_alone)
    kernels.find_group(group, Segments.single(80), torch.tensor([0]),
                       torch.tensor([group.num_buckets]), ukeys, found_group)
    assert torch.equal(found_alone, found_group) and torch.equal(found_group, slots)

    rows_alone, rows_group = torch.zeros(64, 6), torch.zeros(64, 6)
    kernels.init_rows_at(rows_alone, slots, ukeys, inserted, 4, 11, 2, INIT_UNIFORM, -1.0, 1.0,
                         0.0, 0.0)
    kernels.init_rows_at_group(rows_group, slots, ukeys, inserted, Segments.single(80), 4,
                               torch.tensor([11]), torch.tensor([2]),
                               torch.tensor([INIT_UNIFORM]),
                               *(torch.tensor([v], dtype=torch.float64)
                                 for v in (-1.0, 1.0, 0.0, 0.0)))
    assert torch.equal(rows_alone, rows_group) and bool(rows_group[:, :4].abs().sum() > 0)


def test_both_backends_give_a_group_the_same_claim():
    """Three tables of one group (one without keys), the same call on CPU and on the CUDA
    kernels: the CUDA threads claim slots in another order, but each table ends with the
    same keys, size, counts and failures."""
    gen = torch.Generator().manual_seed(7)
    ukeys = torch.cat([torch.randperm(90, generator=gen)[:n] + 1 for n in (30, 0, 50)])
    n = ukeys.numel()
    results = []
    for name in ("cpu", "cuda"):
        table = TableArrays.empty(3 * 32, 16, torch.device("cpu"),
                                  size=torch.zeros(3, dtype=torch.int64))
        slots, prev_keys, prev_scores = (torch.empty(n, dtype=torch.int64) for _ in range(3))
        inserted, failed = (torch.empty(n, dtype=torch.bool) for _ in range(2))
        stats = torch.zeros(3, 3, dtype=torch.int64)
        get_backend(name).find_or_insert_group(
            table, table.size, Segments([0, 30, 30, 80]), torch.tensor([0, 32, 64]),
            torch.tensor([2, 2, 2]), ukeys, torch.ones(n, dtype=torch.int64),
            torch.zeros(n, dtype=torch.int64), ScorePolicy.LRU.code, torch.tensor([1, 4, 9]),
            True, slots, inserted, prev_keys, prev_scores, failed, stats)
        per_table = [sorted(table.keys[lo:lo + 32].tolist()) for lo in (0, 32, 64)]
        results.append((per_table, table.size.tolist(), stats.tolist(), failed.tolist()))
    assert results[0] == results[1]
    sizes, stats = results[0][1], results[0][2]
    assert sizes[1] == 0 and sizes[2] == 32 and [row[0] for row in stats] == sizes
