"""Checkpoints of dynamic tables (see docs/checkpoint.md).

- ``module.state_dict()`` / ``load_state_dict()`` carry every table (rows, optimizer state,
  scores, clocks, steps, counters): :mod:`~dynemb.checkpoint.module_state`,
  :mod:`~dynemb.checkpoint.table_state`;
- ``torch.distributed.checkpoint`` on any world size: :class:`DynamicEmbLoadPlanner`;
  ``async_save`` with :class:`DynamicEmbAsyncStager`;
- files, full and incremental, blocking or not: :func:`dump` (:class:`PendingDump`),
  :func:`load`;
- rows of TorchRec's own tables (a warm start): :func:`warm_start`.

Exports for serving without a hash table are :mod:`dynemb.serving`.
"""
from dynemb.checkpoint.dcp_planner import DynamicEmbLoadPlanner
from dynemb.checkpoint.dcp_stager import DynamicEmbAsyncStager
from dynemb.checkpoint.file_dump import DumpInfo, PendingDump, dump
from dynemb.checkpoint.file_load import load
from dynemb.checkpoint.warm_start import warm_start

__all__ = ["DynamicEmbAsyncStager", "DynamicEmbLoadPlanner", "DumpInfo", "PendingDump", "dump",
           "load", "warm_start"]
