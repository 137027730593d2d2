"""Checkpoints of dynamic tables."""
from dynemb.checkpoint.serving import (IdRemap, StaticExport, StaticServingCollection,
                                       iter_rows, merge_exports, to_static)
from dynemb.checkpoint.dcp_planner import DynamicEmbLoadPlanner
from dynemb.checkpoint.file_dump import DumpInfo, dump
from dynemb.checkpoint.file_load import load
