"""``DynamicTableMetrics``: what the dynamic tables of a model did over an interval, as a
``torchmetrics.Metric``.

``stats()`` gives running totals since a table was built. A long job watches rates per
interval: this metric keeps the totals it last read and, at each :meth:`update`, adds what
changed since to its state (``counts``, one row per table, one column per name of
:data:`COUNTED`: the counters of :data:`~dynemb.foundations.counters.COUNTER_NAMES`, the
rows expired, the keys refused a slot and the rows ``write_rows`` wrote) and records the
tables' sizes then (``sizes``: rows on the device, device capacity, rows behind it). :meth:`compute` gives, per table,

=======================  ====================================================================
``<table>/<counter>``    the counter's increase over the interval (lookups, hits, misses,
                         inserts, evictions, write-backs, loads, admission rejects,
                         expired, refused, ...)
``<table>/hit_rate``     hits / (hits + misses) of the interval (NaN without lookups)
``<table>/load_factor``  rows on the device / device capacity at the last update
``<table>/rows_device``  rows on the device, ``rows_backing`` rows behind it (DEFAULT's host
                         tier, CACHE's store), at the last update
=======================  ====================================================================

and :meth:`reset` starts the next interval. A sharded model's metric is reduced over the
ranks by torchmetrics' own synchronization at :meth:`compute` (every rank calls it): counts
and sizes are summed, so a table's load factor is its summed rows over its summed capacity,
and its hit rate the summed hits over the summed lookups, not a mean of the ranks' ratios.

Why a ``Metric``: it is what TorchRec's own metrics build on, what Lightning logs and
``MetricCollection`` holds, and its state synchronization is the reduction over ranks, with
its process group and ``sync_on_compute`` options; the interval is ``update`` ...
``compute``, ``reset``. The totals it last read are not a state: ``reset`` leaves them, so
intervals follow one another with nothing counted twice or lost.

Reading the totals is a ``stats()`` per table (one small device read each): call :meth:`update` at the end of an interval, not every step, to keep the steps
between free of host synchronizations. A table loaded from a checkpoint or reset since the
last update (the module's ``generation`` moved) starts over from its new totals: that update
counts nothing for it.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import nn
from torchmetrics import Metric

from dynemb.foundations.counters import COUNTER_NAMES
from dynemb.module_interface import DynamicModuleInterface, find_dynamic_modules

#: Totals of ``stats()`` counted per interval, in the order of the ``counts`` state.
COUNTED = COUNTER_NAMES + ("expired", "refused", "write_inserts", "write_overwrites")
#: Sizes of ``stats()`` recorded per table at each update, in the order of the ``sizes``
#: state.
SIZE_NAMES = ("rows_device", "device_capacity", "rows_backing")


def _tables(model: nn.Module) -> List[Tuple[str, DynamicModuleInterface, str]]:
    """``(key, module, table name)`` of every dynamic table of ``model`` on this rank; key
    ``<fqn>/<table>`` (the table name alone at the model's root), as checkpoint files name
    them."""
    found = find_dynamic_modules(model)
    if not found:
        raise TypeError(f"{type(model).__name__} holds no dynamic embedding module")
    return [((f"{fqn}/{name}" if fqn else name), module, name)
            for fqn, module in found.items() for name in module.tables]


class DynamicTableMetrics(Metric):
    """Per-table counters of ``model``'s dynamic tables over an interval (see the module
    docstring). The tables are fixed at construction; :meth:`update` takes the model again
    (any model holding the same tables, sharded or not). ``kwargs`` go to
    ``torchmetrics.Metric`` (``process_group``, ``sync_on_compute``, ...).

    Example::

        >>> from dynemb.metrics import DynamicTableMetrics
        >>> ec = DynamicEmbCollection([EmbeddingConfig(name="t", embedding_dim=4,
        ...                                            num_embeddings=64, feature_names=["f"])],
        ...                           optimizer=OptimizerConfig())
        >>> def step(ids):
        ...     kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor(ids),
        ...                                               torch.tensor([len(ids)]))
        ...     ec(kjt)["f"].values().sum().backward()
        >>> metrics = DynamicTableMetrics(ec)
        >>> step([1, 2, 3]); step([1, 2])
        >>> metrics.update(ec)                   # the first interval: 5 lookups, 2 hits
        >>> m = metrics.compute()
        >>> int(m["t/lookups"]), int(m["t/hits"]), float(m["t/hit_rate"])
        (5, 2, 0.4)
        >>> metrics.reset()
        >>> step([1, 4])
        >>> metrics.update(ec)                   # the next one: its own counts only
        >>> m = metrics.compute()
        >>> int(m["t/lookups"]), float(m["t/hit_rate"]), int(m["t/rows_device"])
        (2, 0.5, 4)
    """

    full_state_update = False
    higher_is_better = None
    is_differentiable = False

    def __init__(self, model: nn.Module, **kwargs):
        super().__init__(**kwargs)
        tables = _tables(model)
        self.table_keys: List[str] = [key for key, _, _ in tables]
        n = len(tables)
        self.add_state("counts", torch.zeros(n, len(COUNTED), dtype=torch.int64),
                       dist_reduce_fx="sum")
        self.add_state("sizes", torch.zeros(n, len(SIZE_NAMES), dtype=torch.int64),
                       dist_reduce_fx="sum")
        # not states: reset() keeps them, so the next interval starts where this one ends
        self._last, _, self._generations = self._read(tables)

    @staticmethod
    def _read(tables) -> Tuple[torch.Tensor, torch.Tensor, List[int]]:
        """The tables' totals [T, len(COUNTED)], sizes [T, len(SIZE_NAMES)] and modules'
        generations."""
        stats = [module.tables[name].stats() for _, module, name in tables]
        totals = torch.tensor([[int(s[n]) for n in COUNTED] for s in stats], dtype=torch.int64)
        sizes = torch.tensor([[int(s[n]) for n in SIZE_NAMES] for s in stats],
                             dtype=torch.int64)
        return totals, sizes, [module.generation for _, module, _ in tables]

    def update(self, model: nn.Module) -> None:
        """Add what ``model``'s tables counted since the last update (or construction) and
        record their sizes now. Raises ``ValueError`` if its tables are not the metric's."""
        tables = _tables(model)
        keys = [key for key, _, _ in tables]
        if keys != self.table_keys:
            raise ValueError(f"the model's dynamic tables {keys} are not the tables this "
                             f"metric was built for ({self.table_keys})")
        totals, sizes, generations = self._read(tables)
        delta = totals - self._last
        for i, (before, now) in enumerate(zip(self._generations, generations)):
            if before != now:  # loaded or reset since: its totals start over from here
                delta[i] = 0
        self.counts += delta.to(self.counts.device)
        self.sizes = sizes.to(self.sizes.device)
        self._last, self._generations = totals, generations

    def compute(self) -> Dict[str, torch.Tensor]:
        """``{"<table>/<name>": value}`` for the interval (see the module docstring);
        summed over the ranks when ``torch.distributed`` is initialized."""
        out: Dict[str, torch.Tensor] = {}
        hits = COUNTED.index("hits")
        misses = COUNTED.index("misses")
        for i, key in enumerate(self.table_keys):
            counts, sizes = self.counts[i], self.sizes[i]
            for j, name in enumerate(COUNTED):
                out[f"{key}/{name}"] = counts[j]
            looked_up = (counts[hits] + counts[misses]).double()
            out[f"{key}/hit_rate"] = counts[hits].double() / looked_up if looked_up > 0 \
                else torch.tensor(float("nan"), dtype=torch.float64)
            capacity = sizes[SIZE_NAMES.index("device_capacity")].double()
            rows = sizes[SIZE_NAMES.index("rows_device")]
            out[f"{key}/load_factor"] = rows.double() / capacity if capacity > 0 \
                else torch.tensor(0.0, dtype=torch.float64)
            out[f"{key}/rows_device"] = rows
            out[f"{key}/rows_backing"] = sizes[SIZE_NAMES.index("rows_backing")]
        return out
