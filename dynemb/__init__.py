"""dynemb: dynamic (hash-table-backed) embeddings for TorchRec.

Core pieces:
- :class:`ScoredHashTable`: int64 key -> slot, with scores for eviction and pins;
- :class:`FlatTable`: the value rows (row = slot);
- :class:`Initializer`: deterministic initial rows from (seed, table, key).
"""
from dynemb.flat_table import FlatTable
from dynemb.hash_table import ScoredHashTable
from dynemb.initializers import Initializer, InitializerKind
from dynemb.types import (EMPTY_KEY, RESERVED_KEYS, TOMBSTONE_KEY, EraseResult, ExportBatch,
                          FindOrInsertResult, ScorePolicy, TableFullError)

__all__ = [
    "EMPTY_KEY", "TOMBSTONE_KEY", "RESERVED_KEYS", "ScoredHashTable", "FlatTable", "Initializer",
    "InitializerKind", "ScorePolicy", "FindOrInsertResult", "EraseResult", "ExportBatch",
    "TableFullError",
]
