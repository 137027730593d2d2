"""Launch every CUDA kernel of dynemb at small sizes and check it against the CPU backend.

A short, deterministic run to put under ``compute-sanitizer`` (memcheck, racecheck,
synccheck, initcheck): each kernel of ``dynemb.kernels.ptx_check.kernel_signatures()`` is
reached through dynemb's public API on tensors of ``--device``, and every result is compared
with the same calls on the CPU backend (exactly where the outcome is deterministic, by
invariants where the CUDA kernels may legitimately choose otherwise, e.g. which of two
equal-score victims to evict or which free slot of a bucket to take).

Usage::

    python scripts/gpu_sanitize.py                               # on a GPU
    python scripts/gpu_sanitize.py --device cpu --backend cuda   # numba's simulator, no GPU
    compute-sanitizer --tool memcheck python scripts/gpu_sanitize.py

Prints one PASS/FAIL line per check and which kernels ran; exits 1 if any check failed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="device of the tensors (default cuda)")
    parser.add_argument("--backend", default="cuda", choices=["cuda"],
                        help="kernels under test; with --device cpu: numba's simulator")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this JSON file")
    return parser.parse_args(argv)


def use_simulator_if_asked(args) -> None:
    """CUDA kernels on CPU tensors run in numba's simulator, which must be chosen before
    numba.cuda is imported."""
    if args.device == "cpu":
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


class Report:
    """PASS/FAIL per check, printed as they come."""

    def __init__(self):
        self.results: List[Dict] = []

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.results.append({"check": name, "ok": bool(ok), "detail": detail})
        print(f"{'PASS' if ok else 'FAIL'}  {name}{'  ' + detail if detail else ''}", flush=True)

    @property
    def failed(self) -> int:
        return sum(not r["ok"] for r in self.results)


class Twins:
    """Builds the same object on the CPU backend and on the backend under test."""

    def __init__(self, device: str, backend: str):
        import torch
        self.torch = torch
        self.device = torch.device(device)
        self.backend = backend

    def sides(self):
        """``(label, device, backend)`` of the reference and of the side under test."""
        return (("cpu", self.torch.device("cpu"), "cpu"), ("dev", self.device, self.backend))


def _key_set(table) -> Dict[int, int]:
    """key -> score of every live entry, read with ``export`` in chunks (export_kernel)."""
    out, start = {}, 0
    while start < table.capacity:
        chunk = table.export(start, 40)
        for k, s in zip(chunk.keys.tolist(), chunk.scores.tolist()):
            out[k] = s
        start = chunk.next_start
    return out


def _evicted(result) -> set:
    from dynemb.types import EMPTY_KEY, TOMBSTONE_KEY
    prev = result.previous_keys[result.inserted]
    keep = (prev != EMPTY_KEY) & (prev != TOMBSTONE_KEY)
    return set(prev[keep].tolist())


def _consistent(table, result) -> bool:
    """Every placed key is found at the slot the call returned, and that slot holds it."""
    placed = result.slots >= 0
    keys, slots = result.keys[placed], result.slots[placed]
    return bool((table.find(keys) == slots).all()) and bool((table.keys_at(slots) == keys).all())


def check_custom_scores_with_evictions(report: Report, twins: Twins, gen) -> Dict:
    """CUSTOMIZED scores, all distinct: eviction is deterministic, so the key sets, the
    evicted keys and the scores must equal the CPU's exactly (find, lookup_update,
    insert_missing, add_refcounts, export kernels)."""
    import torch
    from dynemb import ScorePolicy
    from dynemb.rows.hash_table import ScoredHashTable
    tables = {label: ScoredHashTable(128, bucket_size=16, policy=ScorePolicy.CUSTOMIZED,
                                     device=dev, backend=be)
              for label, dev, be in twins.sides()}
    universe = torch.randperm(10**6, generator=gen)[:400] * 7919 + 11
    score_of = torch.randperm(10**6, generator=gen)[:400]  # distinct: no ties to break
    same = True
    evictions = 0
    for step in range(10):
        pick = torch.randint(0, 400, (36,), generator=gen)  # duplicates included
        keys, scores = universe[pick], score_of[pick]
        evicted = {}
        for label, dev, _ in twins.sides():
            res = tables[label].find_or_insert(keys.to(dev), scores.to(dev))
            evicted[label] = _evicted(res)
            if not _consistent(tables[label], res):
                report.check(f"custom scores: {label} slots consistent at step {step}", False)
                return tables
        evictions += len(evicted["cpu"])
        same &= evicted["cpu"] == evicted["dev"]
        same &= _key_set(tables["cpu"]) == _key_set(tables["dev"])
    report.check("find_or_insert, CUSTOMIZED: evicted keys and key/score sets equal the CPU's",
                 same and evictions > 0, f"{evictions} evictions over 10 batches")
    probe = universe.clone()
    hits = [(tables[label].find(probe.to(dev)) >= 0).cpu() for label, dev, _ in twins.sides()]
    report.check("find: hits equal the CPU's", torch.equal(hits[0], hits[1]),
                 f"{int(hits[0].sum())} of {probe.numel()} keys live")
    scored = [tables[label].find(probe.to(dev), update_scores=True,
                                 scores=score_of.to(dev)) >= 0
              for label, dev, _ in twins.sides()]
    report.check("find(update_scores): scores equal the CPU's",
                 torch.equal(scored[0].cpu(), scored[1].cpu())
                 and _key_set(tables["cpu"]) == _key_set(tables["dev"]))
    return tables


def check_pins_erase_grow(report: Report, twins: Twins, tables, gen) -> None:
    """Pins survive eviction and erase; erase and grow (erase_kernel, add_refcounts_kernel,
    rehash_kernel) match the CPU; grow's remap points each key at its new slot."""
    import torch
    live = sorted(_key_set(tables["cpu"]))
    pinned_keys = torch.tensor(live[:6])
    erase = torch.tensor(live[:3] + live[10:16] + [123456789, 987654321])
    results = {}
    for label, dev, _ in twins.sides():
        table = tables[label]
        slots = table.find(pinned_keys.to(dev))
        table.pin(slots)
        res = table.erase(erase.to(dev))
        results[label] = (res.erased.cpu(), res.pinned.cpu(), table.pinned_count(), table.size())
        table.unpin(slots)
    a, b = results["cpu"], results["dev"]
    report.check("erase: erased and pinned flags equal the CPU's",
                 torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2:] == b[2:],
                 f"erased {int(a[0].sum())}, kept pinned {int(a[1].sum())}")
    ok = True
    for label, dev, _ in twins.sides():
        table = tables[label]
        before = _key_set(table)
        keys = torch.tensor(sorted(before), device=dev)
        old_slots = table.find(keys)
        table.pin(old_slots[:4])
        remap = table.grow(256)
        ok &= bool((remap[old_slots] == table.find(keys)).all())
        ok &= _key_set(table) == before and table.pinned_count() == 4
        table.unpin(table.find(keys[:4]))
    report.check("grow: keys, scores and pins move; remap matches find",
                 ok and _key_set(tables["cpu"]) == _key_set(tables["dev"]))


def check_lru_pins_and_failures(report: Report, twins: Twins, gen) -> None:
    """LRU with a pinned batch, NO_EVICTION failures reported per key, and the collection's
    path: padded unique keys with counts (assume_unique).

    LRU victims among equal scores may differ from the CPU's, and so may every later hit or
    miss; a bucket's occupancy does not (min(bucket size, distinct keys sent to it)).
    """
    import torch
    from dynemb import ScorePolicy
    from dynemb.rows.hash_table import ScoredHashTable
    from dynemb.types import EMPTY_KEY
    ok, sizes, evictions = True, {}, {}
    batches = [torch.randint(1, 10**9, (24,), generator=gen) for _ in range(6)]
    for label, dev, be in twins.sides():
        table = ScoredHashTable(64, bucket_size=16, policy=ScorePolicy.LRU, device=dev,
                                backend=be)
        held = table.find_or_insert(torch.arange(1, 17, device=dev) * 1001, pin=True)
        evictions[label] = 0
        for keys in batches:
            res = table.find_or_insert(keys.to(dev), on_failure="report")
            evictions[label] += len(_evicted(res))
            ok &= _consistent(table, res) and not bool(res.failed.any())
        ok &= bool((table.find(held.keys) == held.slots).all())  # pinned: never evicted
        table.unpin(held.slots)
        sizes[label] = table.size()
    report.check("find_or_insert, LRU: pinned keys stay, sizes equal the CPU's",
                 ok and sizes["cpu"] == sizes["dev"] and evictions["dev"] > 0,
                 f"sizes {sizes}, evictions {evictions}")
    failed = {}
    for label, dev, be in twins.sides():
        table = ScoredHashTable(16, bucket_size=16, policy=ScorePolicy.NO_EVICTION, device=dev,
                                backend=be)
        res = table.find_or_insert(torch.arange(100, 120, device=dev), on_failure="report")
        failed[label] = (int(res.failed.sum()), table.size())
    report.check("find_or_insert, NO_EVICTION: failures reported per key",
                 failed["cpu"] == failed["dev"] == (4, 16), f"(failed, size) {failed}")
    scores = {}
    for label, dev, be in twins.sides():
        table = ScoredHashTable(256, bucket_size=32, policy=ScorePolicy.LFU, device=dev,
                                backend=be)
        for step in range(3):
            ukeys = torch.full((48,), EMPTY_KEY, dtype=torch.int64)
            ukeys[:30] = torch.arange(30) * 17 + step * 5
            occurrences = torch.zeros(48, dtype=torch.int64)
            occurrences[:30] = torch.arange(1, 31)
            res = table.find_or_insert(ukeys.to(dev), assume_unique=True,
                                       counts=occurrences.to(dev), on_failure="defer")
            ok &= bool((res.slots[30:] == -1).all())
        scores[label] = _key_set(table)
    report.check("find_or_insert(assume_unique, padded, counts): LFU scores equal the CPU's",
                 ok and scores["cpu"] == scores["dev"], f"{len(scores['cpu'])} keys")


def check_initializers(report: Report, twins: Twins, gen) -> None:
    """init_rows_kernel for every initializer kind; init_rows_at_kernel through
    ``FlatTable.initialize_where`` (masked, -1 slots skipped)."""
    import torch
    from dynemb import Initializer, InitializerKind
    from dynemb.rows.flat_table import FlatTable
    keys = torch.cat([torch.randint(-2**62, 2**62, (50,), generator=gen), torch.tensor([0, 1])])
    inits = {"normal": Initializer(InitializerKind.NORMAL, mean=0.1, std=0.2),
             "truncated_normal": Initializer.truncated_normal(std=0.3),
             "uniform": Initializer(InitializerKind.UNIFORM, low=-0.5, high=0.25),
             "constant": Initializer(InitializerKind.CONSTANT, value=0.75)}
    for name, init in inits.items():
        rows = [init.rows(keys.to(dev), 37, seed=5, table_id=9, backend=be).cpu()
                for _, dev, be in twins.sides()]
        report.check(f"Initializer.rows ({name}) equals the CPU's",
                     torch.allclose(rows[0], rows[1], rtol=1e-6, atol=1e-6))
    slots = torch.tensor([3, -1, 7, 0, 12, 5])
    row_keys = torch.tensor([10, 11, 12, 13, 14, 15])
    mask = torch.tensor([True, True, False, True, True, True])
    weights = []
    for _, dev, be in twins.sides():
        flat = FlatTable(16, dim=9, optimizer_state_dim=2, device=dev, backend=be)
        flat.weights.fill_(-3.0)
        flat.initialize_where(slots.to(dev), row_keys.to(dev), mask.to(dev),
                              inits["truncated_normal"], seed=1, table_id=2)
        weights.append(flat.weights.cpu())
    report.check("FlatTable.initialize_where equals the CPU's",
                 torch.allclose(weights[0], weights[1], rtol=1e-6, atol=1e-6))


def check_fused_updates(report: Report, twins: Twins, gen) -> None:
    """fused_update_kernel for each optimizer (dims below, at and above a warp), float32 in
    place and float16 / bfloat16 through round_rows_kernel."""
    import torch
    from dynemb import OptimizerConfig, OptimizerType
    from dynemb.rows.optimizers import fused_update
    from dynemb.rows.flat_table import RowLayout
    configs = [OptimizerConfig(OptimizerType.SGD, learning_rate=0.1),
               OptimizerConfig(OptimizerType.ADAM, learning_rate=0.01, weight_decay=0.01),
               OptimizerConfig(OptimizerType.ADAGRAD, learning_rate=0.1, eps=1e-4),
               OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD, learning_rate=0.1,
                               weight_decay=0.05, initial_accumulator_value=0.1)]
    slots = torch.tensor([5, -1, 0, 9, 2, 14])
    keys = torch.tensor([50, 51, 52, 53, 54, 55])
    for config in configs:
        for dim in (5, 32, 70):
            width = dim + config.state_dim(dim)
            w0 = torch.randn(16, width, generator=gen) * 0.1
            w0[:, dim:] = w0[:, dim:].abs()  # accumulators are non-negative
            grads = torch.randn(slots.numel(), dim, generator=gen)
            got = []
            for _, dev, be in twins.sides():
                w = w0.to(dev, copy=True)  # on the CPU side .to() alone would update w0
                for step in (1, 2):
                    fused_update(w, slots.to(dev), grads.to(dev), dim=dim, config=config,
                                 lr=config.learning_rate, step=step, backend=be)
                got.append(w.cpu())
            report.check(f"fused_update {config.type.value} float32 dim {dim} equals the CPU's",
                         torch.allclose(got[0], got[1], rtol=1e-5, atol=1e-6))
        # rows of more than optim_cuda.PIECE occurrences: summed in pieces (piece_sums_kernel)
        from dynemb.rows.optimizers import OccurrenceGrads
        dim = 40
        inverse = torch.repeat_interleave(torch.arange(4), torch.tensor([3, 65, 300, 64]))
        inverse = inverse[torch.randperm(inverse.numel(), generator=gen)]
        src = torch.randn(inverse.numel(), dim, generator=gen)
        w0 = torch.randn(6, dim + config.state_dim(dim), generator=gen).abs() * 0.1
        got = []
        for _, dev, be in twins.sides():
            w = w0.to(dev, copy=True)
            occ = OccurrenceGrads.from_inverse(src.to(dev), inverse.to(dev), 4, clip=2.0)
            fused_update(w, torch.tensor([1, 3, 5, 0], device=dev), occ, dim=dim,
                         config=config, lr=config.learning_rate, step=1, backend=be)
            got.append(w.cpu())
        report.check(f"fused_update {config.type.value}, rows of 65 and 300 occurrences, equals "
                     "the CPU's", torch.allclose(got[0], got[1], rtol=1e-4, atol=1e-5))
        for dtype in (torch.float16, torch.bfloat16):
            dim = 24
            weights = []
            for _, dev, be in twins.sides():
                layout = RowLayout(dim, config.state_dim(dim), dtype)
                logical = torch.randn(16, dim + config.state_dim(dim),
                                      generator=torch.Generator().manual_seed(3)).abs() * 0.1
                w = layout.to_physical(logical).to(dev)
                fused_update(w, slots.to(dev), torch.ones(slots.numel(), dim, device=dev) * 0.01,
                             dim=dim, config=config, lr=config.learning_rate, step=1,
                             backend=be, keys=keys.to(dev), seed=4, table_id=6)
                weights.append(layout.to_logical(w.cpu()))
            report.check(f"fused_update {config.type.value} {str(dtype)[6:]} equals the CPU's",
                         torch.allclose(weights[0], weights[1], rtol=1e-2, atol=1e-3))


def check_rounding(report: Report, twins: Twins, gen) -> None:
    """round_rows_kernel: stochastic and nearest rounding, bit-exact with the CPU."""
    import torch
    from dynemb.rows.optimizers import round_rows
    x = torch.randn(20, 33, generator=gen) * torch.logspace(-9, 5, 33)
    x[0, :3] = torch.tensor([float("inf"), float("nan"), 1e30])
    keys = torch.randint(-2**62, 2**62, (20,), generator=gen)
    for dtype in (torch.float16, torch.bfloat16):
        for stochastic in (True, False):
            got = [round_rows(x.to(dev), dtype, keys=keys.to(dev), step=7, seed=2, table_id=3,
                              stochastic=stochastic, backend=be).cpu().view(torch.int16)
                   for _, dev, be in twins.sides()]
            kind = "stochastic" if stochastic else "nearest"
            report.check(f"round_rows {str(dtype)[6:]} {kind}: bits equal the CPU's",
                         torch.equal(got[0], got[1]))


def check_table_groups(report: Report, twins: Twins, gen) -> None:
    """The group kernels (lookup_update_group, insert_missing_group, init_rows_at_group,
    find_group): three tables trained as one group, then an eval lookup of it; outputs and
    rows against the CPU backend's group."""
    import torch
    from torchrec import EmbeddingConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    from dynemb import DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig
    configs = [EmbeddingConfig(name=f"t{i}", embedding_dim=8, num_embeddings=64,
                               feature_names=[f"f{i}"]) for i in range(3)]
    options = DynamicEmbTableOptions(max_capacity=128, bucket_size=16)
    modules = [DynamicEmbCollection(configs, table_options=options, optimizer=OptimizerConfig(),
                                    device=dev, backend=be) for _, dev, be in twins.sides()]
    report.check("tables of one shape group on both backends",
                 all(m.table_groups() == [("t0", "t1", "t2")] for m in modules))
    same = True
    for _ in range(3):
        ids = torch.randint(0, 50, (18,), generator=gen)
        kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2"], ids,
                                                  torch.full((6,), 3))
        outs = []
        for module, (_, dev, _) in zip(modules, twins.sides()):
            out = module(kjt.to(dev))
            sum((out[f].values() ** 2).sum() for f in out).backward()
            outs.append({f: out[f].values().detach().cpu() for f in out})
        same &= all(torch.allclose(outs[0][f], outs[1][f], rtol=1e-5, atol=1e-6)
                    for f in outs[0])
    keys = torch.arange(50)
    for name in ("t0", "t1", "t2"):
        rows = [m.read_rows(name, keys.to(dev))[0].cpu()
                for m, (_, dev, _) in zip(modules, twins.sides())]
        same &= torch.allclose(rows[0], rows[1], rtol=1e-5, atol=1e-6)
    report.check("a table group trains as the CPU backend's", bool(same))
    report.check("a table group counts as the CPU backend's",
                 modules[0].stats() == modules[1].stats())
    # find_group: an eval lookup of the group, seen and unseen keys
    ids = torch.randint(0, 100, (18,), generator=gen)
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2"], ids, torch.full((6,), 3))
    outs = []
    for module, (_, dev, _) in zip(modules, twins.sides()):
        module.eval()
        with torch.no_grad():
            out = module(kjt.to(dev))
        outs.append({f: out[f].values().cpu() for f in out})
    report.check("a table group's eval lookup reads as the CPU backend's",
                 all(torch.allclose(outs[0][f], outs[1][f], rtol=1e-5, atol=1e-6)
                     for f in outs[0])
                 and modules[0].stats() == modules[1].stats())


def check_pooled_group(report: Report, twins: Twins, gen) -> None:
    """pool_bags_kernel: ``DynamicEmbBagCollection`` trained on both backends, unweighted (a
    SUM and a MEAN table) and weighted (SUM), empty bags among them; pooled outputs and rows
    against the CPU's."""
    import torch
    from torchrec import EmbeddingBagConfig, PoolingType
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    from dynemb import DynamicEmbBagCollection, DynamicEmbTableOptions, OptimizerConfig
    options = DynamicEmbTableOptions(max_capacity=128, bucket_size=16)
    for weighted in (False, True):
        configs = [EmbeddingBagConfig(name=f"b{i}", embedding_dim=40, num_embeddings=64,
                                      feature_names=[f"g{i}"],
                                      pooling=PoolingType.MEAN if i and not weighted
                                      else PoolingType.SUM)
                   for i in range(2)]
        modules = [DynamicEmbBagCollection(configs, is_weighted=weighted, table_options=options,
                                           optimizer=OptimizerConfig(), device=dev, backend=be)
                   for _, dev, be in twins.sides()]
        same = True
        for _ in range(3):
            lengths = torch.randint(0, 4, (10,), generator=gen)  # 5 samples, 2 features
            ids = torch.randint(0, 50, (int(lengths.sum()),), generator=gen)
            weights = torch.rand(ids.numel(), generator=gen) if weighted else None
            kjt = KeyedJaggedTensor.from_lengths_sync(["g0", "g1"], ids, lengths,
                                                      weights=weights)
            outs = []
            for module, (_, dev, _) in zip(modules, twins.sides()):
                out = module(kjt.to(dev)).values()
                (out ** 2).sum().backward()
                outs.append(out.detach().cpu())
            same &= torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)
        keys = torch.arange(50)
        for name in ("b0", "b1"):
            rows = [m.read_rows(name, keys.to(dev))[0].cpu()
                    for m, (_, dev, _) in zip(modules, twins.sides())]
            same &= torch.allclose(rows[0], rows[1], rtol=1e-5, atol=1e-5)
        kind = "weighted SUM" if weighted else "SUM and MEAN"
        report.check(f"pooled bags ({kind}) train as the CPU backend's", bool(same))


def kernels_that_ran() -> Optional[List[str]]:
    """Kernels of ptx_check's list compiled in this process (so launched at least once);
    None under the simulator, which compiles nothing."""
    from dynemb.kernels.constants import cuda_simulator_enabled
    from dynemb.kernels.ptx_check import kernel_signatures
    if cuda_simulator_enabled():
        return None
    return [name for name, (kernel, _) in kernel_signatures().items()
            if len(getattr(kernel, "overloads", ()))]


CHECKS: List[Callable] = [check_lru_pins_and_failures, check_initializers, check_fused_updates,
                          check_rounding, check_table_groups, check_pooled_group]


def run(args) -> Report:
    import torch
    report = Report()
    twins = Twins(args.device, args.backend)
    gen = torch.Generator().manual_seed(args.seed)
    steps = [lambda: check_pins_erase_grow(
        report, twins, check_custom_scores_with_evictions(report, twins, gen), gen)]
    steps += [lambda c=c: c(report, twins, gen) for c in CHECKS]
    for step in steps:
        try:
            step()
        except Exception as error:  # one broken kernel must not hide the others
            report.check(f"no exception ({type(error).__name__})", False, str(error)[:300])
            traceback.print_exc()
    if twins.device.type == "cuda":
        torch.cuda.synchronize()
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    use_simulator_if_asked(args)
    start = time.perf_counter()
    report = run(args)
    ran = kernels_that_ran()
    if ran is None:
        print("(the simulator compiles nothing: which kernels ran is not tracked)")
    else:
        from dynemb.kernels.ptx_check import kernel_signatures
        missing = sorted(set(kernel_signatures()) - set(ran))
        report.check("every CUDA kernel launched", not missing,
                     f"missing: {missing}" if missing else f"{len(ran)} kernels")
        from dynemb.backends.numba_backends import get_backend
        direct = get_backend("cuda").direct_launch_signatures()
        for name, why in sorted(get_backend("cuda").numba_launch_refusals().items()):
            print(f"numba's launch kept for {name}: {why}")
        report.check("kernels launch directly once numba's marshalling of their arguments is "
                     "matched (dynemb.bridges.numba_launch)", direct >= len(ran),
                     f"{direct} kernel signatures launch directly, {len(ran)} kernels ran")
    seconds = time.perf_counter() - start
    print(f"{len(report.results) - report.failed} passed, {report.failed} failed "
          f"in {seconds:.1f}s on {args.device} ({args.backend} kernels)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "backend": args.backend, "seconds": seconds,
                       "kernels": ran, "results": report.results}, f, indent=1)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
