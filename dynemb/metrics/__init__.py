"""What the dynamic tables do over time (see docs/collection.md, "Metrics over time").

- :class:`DynamicTableMetrics`: per-table counters per interval (deltas of ``stats()``), hit
  rate and load factor, as a ``torchmetrics.Metric`` reduced over the ranks of a sharded
  model;
- :class:`TensorBoardWriter`: those values as TensorBoard scalars (the ``metrics`` extra).
"""
from dynemb.metrics.table_metrics import DynamicTableMetrics
from dynemb.metrics.tensorboard import TensorBoardWriter

__all__ = ["DynamicTableMetrics", "TensorBoardWriter"]
