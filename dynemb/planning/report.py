"""Footprints and measured allocations as text tables.

- :func:`footprint_report` / :func:`format_footprints`: the estimated bytes per table and rank;
- :func:`measure_allocated` / :func:`measure_table`: what built tables hold right now (their
  own :meth:`~dynemb.tables.DynamicTable.memory_breakdown`), :func:`format_allocated` prints it.

Example::

    >>> model = torch.nn.Sequential(DynamicEmbCollection(tables=[EmbeddingConfig(
    ...     name="items", embedding_dim=16, num_embeddings=1024, feature_names=["item"])]))
    >>> print(footprint_report(model, world_size=2, batch_size=256))
    Dynamic embedding footprint (batch size 256 per rank)
    ...
    total: device 187,584 bytes (183.19 KiB), host 0 bytes (0.00 KiB), all 187,584 bytes
    >>> print(format_allocated(measure_allocated(model)))
    table     values  optim    hash  admit  other   device  host  in flight
    -------  -------  -----  ------  -----  -----  -------  ----  ---------
    0.items  106,496      0  33,288      0     88  139,872     0          0
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from torch import nn
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import PipelineType

from dynemb.module_interface import find_dynamic_modules
from dynemb.planning.footprint import TableFootprint, UniqueRatios, footprints
from dynemb.tables import DynamicTable, MemoryBreakdown

_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))
_COLUMNS = (("values", "values_bytes"), ("optim", "optimizer_bytes"),
            ("hash", "hash_bytes"), ("admit", "admission_bytes"), ("input", "input_bytes"),
            ("output", "output_bytes"), ("pipe I/O", "io_bytes"),
            ("device", "device_bytes"), ("stashed", "stash_bytes"),
            ("dev. stashed", "device_bytes_stashed"), ("host", "host_bytes"))


def _pick_unit(largest: int) -> Tuple[str, int]:
    """MiB from 10 MiB up (GiB would round the I/O columns away), else KiB or bytes."""
    for name, size in _UNITS[1:]:
        if largest >= 10 * size:
            return name, size
    return "B", 1


def _pipeline_note(pipeline_type: PipelineType) -> str:
    return {
        PipelineType.TRAIN_SPARSE_DIST: "pipe I/O = 2 x input",
        PipelineType.TRAIN_PREFETCH_SPARSE_DIST:
            "pipe I/O = 3 x input + (1 + 6 / passes) x prefetch (CACHE tables: prefetch = input)",
    }.get(pipeline_type, "pipe I/O = input + output")


def format_footprints(items: Sequence[TableFootprint], *, title: str = "",
                      unit: Optional[str] = None) -> str:
    """The report of :func:`footprint_report` for given footprints (one line per table and
    rank, a line per table over all ranks, then totals per rank and overall).

    Example::

        >>> from dynemb.planning.footprint import table_footprint
        >>> config = EmbeddingConfig(name="items", embedding_dim=16, num_embeddings=1024,
        ...                          feature_names=["item"])
        >>> print(format_footprints([table_footprint(config, DynamicEmbTableOptions(),
        ...                                          OptimizerConfig())], unit="KiB"))
        Dynamic embedding footprint
        world size 1, pipeline none (pipe I/O = input + output), compute device cuda, sizes in KiB
        ...
        total: device 139,872 bytes (136.59 KiB), host 0 bytes (0.00 KiB), all 139,872 bytes
    """
    if not items:
        return "no dynamic tables"
    largest = max(max(f.device_bytes, f.host_bytes) for f in items) * max(
        f.world_size for f in items)
    unit_name, scale = (_pick_unit(largest) if unit is None
                        else next((n, s) for n, s in _UNITS if n == unit))

    def fmt(n: int) -> str:
        return f"{n:,}" if scale == 1 else f"{n / scale:,.2f}"

    header = ["table", "rank", "mode", "dev rows", "host rows"] + [c for c, _ in _COLUMNS]
    rows: List[List[str]] = []
    tables: Dict[str, List[TableFootprint]] = {}
    for f in items:
        tables.setdefault(f.table, []).append(f)
    for name, group in tables.items():
        for f in group:
            rows.append([name, str(f.rank), f.mode.name, f"{f.device_rows:,}",
                         f"{f.host_rows:,}"] + [fmt(getattr(f, a)) for _, a in _COLUMNS])
        rows.append([name, "all", "", f"{sum(f.device_rows for f in group):,}",
                     f"{sum(f.host_rows for f in group):,}"]
                    + [fmt(sum(getattr(f, a) for f in group)) for _, a in _COLUMNS])
    ranks = sorted({f.rank for f in items})
    for r in ranks:
        on = [f for f in items if f.rank == r]
        rows.append(["(all tables)", str(r), "", "", ""]
                    + [fmt(sum(getattr(f, a) for f in on)) for _, a in _COLUMNS])
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]

    def line(cells: List[str]) -> str:
        return "  ".join(c.ljust(w) if i < 3 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    first = items[0]
    lines = [title or "Dynamic embedding footprint",
             f"world size {first.world_size}, pipeline {first.pipeline_type.value} "
             f"({_pipeline_note(first.pipeline_type)}), compute device {first.compute_device}, "
             f"sizes in {unit_name}",
             line(header), line(["-" * w for w in widths])]
    lines += [line(r) for r in rows]
    device = sum(f.device_bytes for f in items)
    host = sum(f.host_bytes for f in items)
    lines.append(f"total: device {device:,} bytes ({fmt(device)} {unit_name}), host {host:,} "
                 f"bytes ({fmt(host)} {unit_name}), all {device + host:,} bytes")
    stashed = sum(f.stash_bytes for f in items)
    if stashed:
        peaks = [(r, sum(f.device_bytes for f in items if f.rank == r),
                  sum(f.device_bytes_stashed for f in items if f.rank == r)) for r in ranks]
        rank, without, with_stash = max(peaks, key=lambda p: p[1])
        lines.append(
            f"device peak between forward and backward (rank {rank}): {without:,} bytes "
            f"({fmt(without)} {unit_name}) without stashing, {with_stash:,} bytes "
            f"({fmt(with_stash)} {unit_name}) with stashing; {stashed:,} bytes stashed to "
            f"host buffers over all ranks")
    inexact = sorted({f.table for f in items if not f.host_exact})
    if inexact:
        lines.append(f"note: {inexact} use a custom backing store; host counts its rows only")
    return "\n".join(lines)


def footprint_report(model: nn.Module, world_size: int, batch_size: int,
                     pipeline_type: PipelineType = PipelineType.NONE, *,
                     constraints: Optional[Mapping[str, ParameterConstraints]] = None,
                     unique_ratios: UniqueRatios = None, compute_device: str = "cuda",
                     unit: Optional[str] = None) -> str:
    """Per table and per rank, the bytes of values, optimizer state, hash metadata,
    admission counter, input ids, output rows, pipelined I/O, device total and host tier,
    then per-rank and overall totals. Same numbers as the planner's
    :class:`~dynemb.planning.estimators.DynamicEmbStorageEstimator` with the same arguments
    (``batch_size`` per rank).

    Example::

        >>> from torchrec.distributed.types import PipelineType
        >>> model = torch.nn.Sequential(DynamicEmbCollection(tables=[EmbeddingConfig(
        ...     name="items", embedding_dim=16, num_embeddings=1024, feature_names=["item"])]))
        >>> print(footprint_report(model, world_size=2, batch_size=256,
        ...                        pipeline_type=PipelineType.TRAIN_SPARSE_DIST))
        Dynamic embedding footprint (batch size 256 per rank)
        ...
    """
    items = footprints(model, world_size=world_size, batch_size=batch_size,
                       pipeline_type=pipeline_type, constraints=constraints,
                       unique_ratios=unique_ratios, compute_device=compute_device)
    return format_footprints(items, unit=unit, title=(
        f"Dynamic embedding footprint (batch size {batch_size} per rank)"))


# -- measuring built tables --------------------------------------------------------------------
#: What a built table holds, by category (see :meth:`dynemb.tables.DynamicTable.memory_breakdown`).
AllocatedBytes = MemoryBreakdown


def measure_table(table: DynamicTable) -> AllocatedBytes:
    """What ``table`` has allocated right now (its own :meth:`memory_breakdown`).

    Example::

        >>> collection = DynamicEmbCollection(tables=[EmbeddingConfig(
        ...     name="items", embedding_dim=16, num_embeddings=1024, feature_names=["item"])])
        >>> measure_table(collection.tables["items"]).device_bytes
        139872
    """
    return table.memory_breakdown()


def measure_allocated(module: nn.Module) -> Dict[str, AllocatedBytes]:
    """:func:`measure_table` of every built dynamic table in ``module``: a
    :class:`DynamicEmbCollection`, a sharded one (its ``local`` collection: this rank's
    shards), or a model holding them (keys then are ``"<module path>.<table>"``).

    Example::

        >>> collection = DynamicEmbCollection(tables=[EmbeddingConfig(
        ...     name="items", embedding_dim=16, num_embeddings=1024, feature_names=["item"])])
        >>> measure_allocated(collection)["items"].host_bytes
        0
    """
    out: Dict[str, AllocatedBytes] = {}
    for path, m in find_dynamic_modules(module).items():
        for name, t in m.tables.items():
            out[f"{path}.{name}" if path else name] = measure_table(t)
    return out


def format_allocated(allocated: Mapping[str, AllocatedBytes]) -> str:
    """One line per table of :func:`measure_allocated`'s result, in bytes.

    Example::

        >>> collection = DynamicEmbCollection(tables=[EmbeddingConfig(
        ...     name="items", embedding_dim=16, num_embeddings=1024, feature_names=["item"])])
        >>> print(format_allocated(measure_allocated(collection)))
        table   values  optim    hash  admit  other   device  host  in flight
        -----  -------  -----  ------  -----  -----  -------  ----  ---------
        items  106,496      0  33,288      0     88  139,872     0          0
    """
    fields = ("values_bytes", "optimizer_bytes", "hash_bytes", "admission_bytes",
              "other_bytes", "device_bytes", "host_bytes", "in_flight_bytes")
    header = ["table", "values", "optim", "hash", "admit", "other", "device", "host",
              "in flight"]
    rows = [[name] + [f"{getattr(a, f):,}" for f in fields] for name, a in allocated.items()]
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) if rows else len(header[i])
              for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in [header, ["-" * w for w in widths]] + rows]
    return "\n".join(lines)
