"""Checkpoints of dynamic tables (see docs/checkpoint.md).

- ``module.state_dict()`` / ``load_state_dict()`` carry every table (rows, optimizer state,
  scores, clocks, steps, counters): :mod:`~dynemb.checkpoint.module_state`,
  :mod:`~dynemb.checkpoint.table_state`;
- ``torch.distributed.checkpoint`` on any world size: :class:`DynamicEmbLoadPlanner`;
- files, full and incremental: :func:`dump`, :func:`load`;
- rows of TorchRec's own tables (a warm start): :func:`warm_start`.

Exports for serving without a hash table are :mod:`dynemb.serving`.
"""
from dynemb.checkpoint.dcp_planner import DynamicEmbLoadPlanner
from dynemb.checkpoint.file_dump import DumpInfo, dump
from dynemb.checkpoint.file_load import load
from dynemb.checkpoint.warm_start import warm_start

__all__ = ["DynamicEmbLoadPlanner", "DumpInfo", "dump", "load", "warm_start"]
