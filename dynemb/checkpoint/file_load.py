"""``load``: put a module's dynamic tables back from checkpoint files (a full dump, then the
deltas written after it), all or nothing."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import torch

from dynemb.checkpoint.changes import start_tracking
from dynemb.checkpoint.file_dump import DumpInfo
from dynemb.checkpoint.files import (CheckpointFileError, check_paths, check_sizes,
                                     rank_dir_name, read_file)
from dynemb.checkpoint.manifest import read_manifest
from dynemb.checkpoint.module_tables import ModuleTables, module_tables
from dynemb.checkpoint.replay import holds_nothing, replay
from dynemb.checkpoint.table_state import describe_mismatch, saved_scheme

Paths = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]


def load(module: torch.nn.Module, paths: Paths) -> DumpInfo:
    """Load the checkpoint directories ``paths`` into ``module``'s dynamic tables: a full
    :func:`~dynemb.checkpoint.dump`, then any deltas dumped after it, in order.

    Afterwards every table holds what it held at the last dump: each key's row, optimizer
    state and score, each tier's clock, the step and the counters (rows may sit in other
    slots after deltas; a full dump alone into a module of the same layout puts back every
    slot, so training continues bit for bit). Queued prefetches are dropped, and a backward
    of a forward run before the load raises.

    Nothing in the module changes unless everything loads: the chain is checked first
    (each manifest's checksum, then its fields; their order by id, this rank and world
    size, every table's configuration, every data file's path, inside its rank directory,
    and size), then each table is rebuilt aside, every file's sha256 checked as it is read
    and every slot image checked (each key in its bucket, once), and only then are the
    tables replaced. An edited manifest, a missing, truncated or corrupted file or a data
    path leaving the directory raises :class:`~dynemb.checkpoint.files.CheckpointFileError`
    naming it. Files written by another world size, or by a sharded module of another
    ``ShardingScheme``, are refused (reshard through ``torch.distributed.checkpoint``).

    Returns the :class:`DumpInfo` of the last directory, with what was read (``rows``,
    ``deleted``, ``bytes``, ``files``) and the ``seconds`` the load took. A delta may follow
    it: ``dump(module, path, since=<that info>)``.

    Example::

        >>> import tempfile
        >>> from dynemb.checkpoint import dump, load
        >>> def make():
        ...     return DynamicEmbCollection([EmbeddingConfig(
        ...         name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"])])
        >>> ec = make()
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([5, 6]),
        ...                                           torch.tensor([2]))
        >>> ec(kjt)["f"].values().sum().backward()
        >>> path = tempfile.mkdtemp()
        >>> _ = dump(ec, path)
        >>> resumed = make()
        >>> load(resumed, path).rows
        2
        >>> keys = torch.tensor([5, 6])
        >>> torch.equal(resumed.read_rows("t", keys)[0], ec.read_rows("t", keys)[0])
        True
    """
    start = time.perf_counter()
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not paths:
        raise ValueError("load needs at least one checkpoint directory")
    scan = module_tables(module)
    for collection in scan.collections.values():  # tables built for their optimizer first
        collection.settle_optimizer()
    dirs = [Path(p) / rank_dir_name(scan.rank, scan.world_size) for p in paths]
    chain = [read_manifest(d) for d in dirs]
    _check_chain(chain, dirs, scan)
    _check_tables(chain, dirs, scan)
    for d, manifest in zip(dirs, chain):  # every path first: nothing outside is looked at
        check_paths(d, manifest)
    for d, manifest in zip(dirs, chain):
        check_sizes(d, manifest)
    reader = _Reader(dirs)
    fresh = {}
    # tables that hold nothing (a module built to be loaded) load in place: no second copy
    # of their memory; if anything fails they are put back empty, as they were
    empty = {key: _EmptyTable(collection.tables[name])
             for key, _, collection, name in scan.tables()
             if holds_nothing(collection.tables[name])}
    try:
        for key, _, collection, name in scan.tables():
            links = [manifest["tables"][key] for manifest in chain]
            fresh[key] = replay(collection.tables[name], links, reader,
                                in_place=key in empty)
    except BaseException:
        for key, _, collection, name in scan.tables():
            if key in empty:
                collection.tables[name] = empty[key].rebuild()
        raise
    last = chain[-1]
    for fqn, collection in scan.collections.items():
        keys = {name: key for key, owner, _, name in scan.tables() if owner == fqn}
        # the tables go in as rebuilt: one that grew since the dump gets its capacity back
        collection.install_tables({name: fresh[key] for name, key in keys.items()},
                                  {name: int(last["tables"][key]["step"])
                                   for name, key in keys.items()})
        start_tracking(collection.tables, last["id"], collection.generation)
    return DumpInfo(str(paths[-1]), last["id"], last["kind"], last["previous"], scan.rank,
                    scan.world_size, rows=reader.rows, deleted=reader.deleted,
                    bytes=reader.bytes, files=reader.files,
                    seconds=time.perf_counter() - start)


class _EmptyTable:
    """What an empty table is besides its (absent) rows: its counters and clocks, to build
    it again if a load into it fails half-way."""

    def __init__(self, table):
        self.table = table
        self.counters = table.counters.snapshot()
        self.clocks = {n: p.hash.clock for n, p in table.checkpoint_tiers().items()
                       if p.hash is not None}

    def rebuild(self):
        table = self.table.empty_copy()
        table.counters.load(torch.tensor(list(self.counters.values()), dtype=torch.int64))
        for name, part in table.checkpoint_tiers().items():
            if part.hash is not None:
                part.hash.set_clock(self.clocks[name])
        return table


class _Reader:
    """Reads the data files of the chain (checked), counting what it read."""

    def __init__(self, dirs: List[Path]):
        self.dirs = dirs
        self.rows = self.deleted = self.bytes = self.files = 0
        # one read buffer for every file: each file's tensors (views into it) are consumed
        # before the next file is read
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def __call__(self, link: int, record: Dict) -> Dict[str, torch.Tensor]:
        if self._buffer.numel() < record["bytes"]:
            self._buffer = torch.empty(record["bytes"], dtype=torch.uint8)
        data = read_file(self.dirs[link], record, self._buffer)
        self.files += 1
        self.bytes += record["bytes"]
        if record["content"] == "entries":
            self.rows += record["rows"]
        elif record["content"] == "deleted":
            self.deleted += record["rows"]
        return data


def _check_chain(chain: List[Dict], dirs: List[Path], scan: ModuleTables) -> None:
    for i, (d, manifest) in enumerate(zip(dirs, chain)):
        if (manifest["rank"], manifest["world_size"]) != (scan.rank, scan.world_size):
            raise CheckpointFileError(f"{d} was written by rank {manifest['rank']} of "
                                      f"{manifest['world_size']}, this is rank {scan.rank} of "
                                      f"{scan.world_size}")
        if i == 0 and manifest["kind"] != "full":
            raise CheckpointFileError(f"{d} is a delta (it follows dump "
                                      f"{manifest['previous']}): load its full dump first, "
                                      f"then the deltas in order")
        if i > 0 and (manifest["kind"] != "delta" or manifest["previous"] != chain[i - 1]["id"]):
            what = ("a full dump" if manifest["kind"] == "full"
                    else f"a delta of dump {manifest['previous']}")
            raise CheckpointFileError(f"{d} is {what}, it does not follow {dirs[i - 1]} (dump "
                                      f"{chain[i - 1]['id']}): give a full dump, then each "
                                      f"delta after the one it follows")


def _check_tables(chain: List[Dict], dirs: List[Path], scan: ModuleTables) -> None:
    tables = {key: collection.tables[name] for key, _, collection, name in scan.tables()}
    for d, manifest in zip(dirs, chain):
        saved = manifest["tables"]
        if set(saved) != set(tables):
            raise CheckpointFileError(
                f"{d} holds tables {sorted(saved)}, the module has {sorted(tables)}")
        for key, table in tables.items():
            problem = describe_mismatch(table, torch.tensor(saved[key]["signature"]))
            expected = set(table.checkpoint_tiers())
            if problem is None and set(saved[key]["tiers"]) != expected:
                problem = (f"tiers {sorted(saved[key]['tiers'])} in the checkpoint, "
                           f"{sorted(expected)} here (admission on in one and off in the "
                           f"other?)")
            if problem is None and scan.world_size > 1:
                problem = _describe_scheme_change(table, saved[key]["signature"])
            if problem is not None:
                raise CheckpointFileError(f"table {key!r}: cannot load {d}: {problem}")


def _describe_scheme_change(table, saved_signature: List[int]) -> Optional[str]:
    """What to do if the files' keys were placed by another sharding scheme than the table's
    (a rank's files load on that rank, slot for slot); None if not, or if the files predate
    the scheme's record (they are taken to be of the table's scheme)."""
    saved = saved_scheme(torch.tensor(saved_signature))
    mine = table.options.sharding
    if saved is None or saved is mine:
        return None
    return (f"its keys were placed by ShardingScheme.{saved.name}, this module shards by "
            f"ShardingScheme.{mine.name} (the files of a rank load on that rank as they are). "
            f"Load them into a module sharded with ShardingScheme.{saved.name}, then move the "
            f"keys through its state_dict: load_state_dict or torch.distributed.checkpoint "
            f"into the ShardingScheme.{mine.name} module sends every key to its owner")
