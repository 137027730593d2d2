"""What every row-wise sharded dynemb module shares: the plan check, one rank's share of the
tables (checkpoints, counters, reads) and the fused optimizer.

:class:`ShardedDynamicEmbCollection` (sequence outputs) and
:class:`~dynemb.sharding.sharded_bag_collection.ShardedDynamicEmbBagCollection` (pooled
outputs) differ only in how ids travel to their owners and how results come back.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import ParameterSharding, ShardingType

from dynemb.checkpoint.module_state import save_tables, tables_to_load
from dynemb.checkpoint.redistribute import on_their_owners, redistribute
from dynemb.checkpoint.table_state import SavedTable
from dynemb.modules.collection import DynamicEmbCollection
from dynemb.module_interface import ShardedDynamicModuleInterface
from dynemb.sharding.routing import owner_ranks
from dynemb.sharding.sharded_writes import write_rows_sharded
from dynemb.sharding.step_check import BackwardStepCheck

SUPPORTED_SHARDING_TYPES = (ShardingType.ROW_WISE.value,)
SUPPORTED_COMPUTE_KERNELS = (EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value,)


class SavedBySharded:
    """For the per-rank module of a sharded one: its tables are saved and loaded by the
    sharded module, under the sharded module's names. It has no table parameters: its
    optimizer was settled when the module was sharded."""

    _has_table_weights = False

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        pass

    def _load_from_state_dict(self, *args, **kwargs):
        pass


class ShardedTables(ShardedDynamicModuleInterface):
    """Mixin for a sharded module whose share of the tables is the
    :class:`DynamicEmbCollection` in ``self.local``; :meth:`_join` sets its process group
    (``_pg``, ``_rank``, ``_world_size``) and plan (``_configs``, ``_table_shardings``)."""

    @property
    def local(self) -> DynamicEmbCollection:
        """This rank's share of the tables: the submodule ``local`` the sharded module
        registers (this property hides it from ``nn.Module``'s own lookup, asked here)."""
        return torch.nn.Module.__getattr__(self, "local")

    def _join(self, env, configs, shardings: Dict[str, ParameterSharding],
              module_fqn: Optional[str]) -> None:
        """Take the process group of ``env`` and check the plan of the tables ``configs``."""
        if env.process_group is None:
            raise ValueError(f"{type(self).__name__} needs a process group in its ShardingEnv")
        self._pg, self._world_size, self._rank = env.process_group, env.world_size, env.rank
        self._module_fqn = module_fqn
        check_plan(configs, shardings, self._world_size, module_fqn or "")
        self._configs = list(configs)
        self._where = f"{type(self).__name__} {module_fqn!r}" if module_fqn else type(
            self).__name__
        self._input_dists_run = 0
        self._table_shardings = dict(shardings)

    # routing and the tables run numba kernels and host-side bookkeeping: torch.compile runs
    # the whole sharded step eagerly (graph break)
    @torch.compiler.disable
    def forward(self, *input, **kwargs):
        return super().forward(*input, **kwargs)

    def compute_and_output_dist(self, ctx, input):
        return self.output_dist(ctx, self.compute(ctx, input))

    def _next_batch(self) -> int:
        """The number of this input dist (0, 1, ...): every rank that runs the same steps
        gives the same number; the collectives check it (:mod:`.step_check`)."""
        batch = self._input_dists_run
        self._input_dists_run += 1
        return batch

    def _backward_check(self, batch: int) -> BackwardStepCheck:
        return BackwardStepCheck(self._pg, batch, self._where)

    # -- checkpoints -------------------------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """This rank's share of every table, named ``rank<r>_of_<world>`` under the names the
        unsharded module uses (see :mod:`dynemb.checkpoint.module_state`)."""
        self.local.rows_in_place()
        save_tables(self.local.tables, self.local.steps, destination, prefix, self._rank,
                    self._world_size)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        """Load this rank's own saved share slot for slot when that is what it was given;
        anything else (another world size, an unsharded checkpoint, parts of several ranks'
        shares) is sent key by key to the keys' owners (collective: every rank loads)."""
        saved = tables_to_load(state_dict, prefix, list(self.local.tables), strict,
                               missing_keys, unexpected_keys)
        if saved is None:
            return  # no table here, or strict: load_state_dict raises on the missing keys
        try:
            saved = self._on_owners(saved)
            self.local.load_tables(saved)
        except ValueError as err:
            raise RuntimeError(str(err)) from None

    def _on_owners(self, saved: Dict[str, List[SavedTable]]) -> Dict[str, List[SavedTable]]:
        """``saved`` with every table's keys on their owners: a table given as this rank's own
        share, saved under its sharding scheme, as is (it loads slot for slot); any other
        table (another world size or scheme, an unsharded checkpoint, parts of several
        shares) sent key by key to its owners. Collective: the ranks agree on which tables
        move, then move them in name order."""
        options = self.local.table_options
        names = sorted(saved)
        if not names:
            return saved
        owner_of = {name: (lambda keys, scheme=options[name].sharding: owner_ranks(
            keys, self._world_size, scheme)) for name in names}
        in_place = torch.tensor(
            [on_their_owners(saved[n], self._rank, self._world_size, options[n].sharding)
             for n in names],
            dtype=torch.int64, device=self.local.device)
        dist.all_reduce(in_place, op=dist.ReduceOp.MIN, group=self._pg)
        return {name: saved[name] if keep else [redistribute(
                    saved[name], list(self.local.tables[name].checkpoint_tiers()),
                    owner_of[name], self._rank, self._world_size, self._pg)]
                for name, keep in zip(names, in_place.tolist())}

    # -- dynemb views ------------------------------------------------------------------------
    def embedding_configs(self):
        """The unsharded module's table configs (global sizes, its feature names)."""
        return list(self._configs)

    @property
    def fused_optimizer(self):
        return self.local.fused_optimizer

    def stats(self):
        """This rank's counters per table (see :meth:`DynamicEmbCollection.stats`)."""
        return self.local.stats()

    def storage_modes(self):
        return self.local.storage_modes()

    def flush(self) -> Dict[str, int]:
        """This rank's share of each CACHE table written to its backing store, rows per table
        (see :meth:`DynamicEmbCollection.flush`); no collective, each rank flushes its own."""
        return self.local.flush()

    def expire(self, tables=None, *, older_than: Optional[int] = None,
               where=None) -> Dict[str, int]:
        """This rank's share of each table expired (see :meth:`DynamicEmbCollection.expire
        <dynemb.modules.dynamic_module.DynamicModule.expire>`); rows erased here, per table.
        No collective: each rank sweeps the keys it owns."""
        return self.local.expire(tables, older_than=older_than, where=where)

    def read_rows(self, table: str, keys: torch.Tensor, *, with_state: bool = False):
        """Rows of the ``keys`` this rank owns (others come back not found)."""
        return self.local.read_rows(table, keys, with_state=with_state)

    def write_rows(self, table: str, keys: torch.Tensor, rows: torch.Tensor, *,
                   optimizer_state: Optional[torch.Tensor] = None,
                   scores: Optional[torch.Tensor] = None) -> None:
        """:meth:`DynamicEmbCollection.write_rows
        <dynemb.modules.dynamic_module.DynamicModule.write_rows>` over the ranks, a
        collective: every rank passes its own keys (any keys, possibly none), each key goes
        to its owner, and either every owner writes or, if any rank's input is bad or any
        owner's share does not fit, every rank raises and nothing is written anywhere (see
        :mod:`dynemb.sharding.sharded_writes`)."""
        write_rows_sharded(self.local, self._pg, self._rank, self._world_size, table, keys,
                           rows, optimizer_state, scores)

    def set_scores(self, scores: Dict[str, int]) -> None:
        """The score this rank's training batches write for the keys its share of each named
        CUSTOMIZED table receives (see :meth:`DynamicEmbCollection.set_scores
        <dynemb.modules.dynamic_module.DynamicModule.set_scores>`); call it on every rank with the
        same scores for one global score per step."""
        self.local.set_scores(scores)

    @property
    def table_shardings(self) -> Dict[str, ParameterSharding]:
        return dict(self._table_shardings)


def check_plan(configs, shardings: Dict[str, ParameterSharding], world_size: int,
               module_fqn: str) -> None:
    """Every table of the module is row-wise sharded over all ranks with our kernel."""
    where = f" of module {module_fqn!r}" if module_fqn else ""
    names: List[str] = [c.name for c in configs]
    missing = [n for n in names if n not in shardings]
    if missing:
        raise ValueError(f"the sharding plan{where} has no entry for dynamic tables {missing}")
    extra = sorted(set(shardings) - set(names))
    if extra:
        raise ValueError(f"the sharding plan{where} names unknown tables {extra}; "
                         f"tables: {names}")
    for name in names:
        ps = shardings[name]
        if ps.sharding_type not in SUPPORTED_SHARDING_TYPES:
            raise ValueError(
                f"dynamic table {name!r}{where}: sharding type {ps.sharding_type!r} is not "
                f"supported; dynamic tables shard {list(SUPPORTED_SHARDING_TYPES)} only (ids "
                f"are unbounded, so rows split by key, not by column or table)")
        if ps.compute_kernel not in SUPPORTED_COMPUTE_KERNELS:
            raise ValueError(
                f"dynamic table {name!r}{where}: compute kernel {ps.compute_kernel!r} is not "
                f"supported; use {list(SUPPORTED_COMPUTE_KERNELS)}")
        if ps.ranks is not None and sorted(ps.ranks) != list(range(world_size)):
            raise ValueError(
                f"dynamic table {name!r}{where}: row-wise shards must be on every rank "
                f"0..{world_size - 1}, the plan puts them on {ps.ranks}")
