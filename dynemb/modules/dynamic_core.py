"""``DynamicCore``: what both drop-in modules share, composed by each (see
:mod:`dynemb.modules.dynamic_module`): the tables, the prefetch queue, the pins of lookups awaiting
backward, memory stashing, the fused optimizer's step and learning rate, and the checkpoint
state.

A training lookup (:meth:`DynamicCore.lookup`) takes the oldest prefetched batch (or prefetches
inline), pins its rows until its backward or the next training lookup, and hands the batch
to the module, which turns rows into its outputs (per occurrence or pooled) and, in backward,
calls :meth:`DynamicCore.apply_gradients`.

A batch is a :class:`~dynemb.tables.lookup_batch.LookupBatch`: a group's tables share one,
a table alone has its own; every path here is the same for both.
"""
from __future__ import annotations

import collections
import contextlib
from typing import (Any, Deque, Dict, Iterable, Iterator, List, Mapping, Optional,
                    Sequence, Tuple)

import torch
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb.checkpoint.module_state import check_saved_tables, save_tables, tables_to_load
from dynemb.checkpoint.table_state import SavedTable, restore
from dynemb.modules.batch_claims import check_failures, prefetch_all
from dynemb.modules.collection_config import build_configured_tables, settle_table_options
from dynemb.rows.fused_optimizer import DynamicEmbFusedOptimizer, checked_lr
from dynemb.modules.fused_params import fused_params_optimizer
from dynemb.modules.learning_rates import FollowedGroup, FollowedLearningRate
from dynemb.optimizer_config import DefaultOptimizerNotice
from dynemb.rows.optimizers import OptimizerConfig
from dynemb.options import DynamicEmbTableOptions, StorageMode
from dynemb.modules.prefetch import PrefetchState, check_state_matches, prefetch_on_stream
from dynemb.stashing.collection_stash import CollectionStash
from dynemb.modules.table_inputs import TableInputs, split_by_table
from dynemb.tables import DynamicTable
from dynemb.tables.lookup_batch import check_batch_score, check_score
from dynemb.tables.expiry import plan_expiry
from dynemb.tables.groups import TableGroup
from dynemb.tables.grouping import group_tables
from dynemb.tables.lookup_batch import LookupBatch
from dynemb.tables.row_writes import RowWrite, check_write
from dynemb.modules.table_weights import TableWeights
from dynemb.types import ScorePolicy


class DynamicCore:
    """The dynamic tables of one module and everything that happens to them in a step.

    Args:
        owner: the owning module's class name (for messages).
        configs: the tables' TorchRec configs, checked.
        device, backend, validate_inputs: as the modules take them.
        table_options: as the modules take them (one for all, a dict by name, or None).
        optimizer: the fused optimizer's config, None for the default.
        weights_are_counts: read each KJT's weights as occurrence counts (the sharded
            modules' shares get deduplicated ids).
        variable_batch: accept KJTs with a batch size per feature.
        group_tables: train tables of one shape as one group (:mod:`dynemb.tables.groups`);
            False runs every table alone.
        with_table_weights: give each table a parameter handle
            (:attr:`table_weights`, :mod:`dynemb.modules.table_weights`), whose
            ``apply_optimizer_in_backward`` marks, or a dense optimizer holding them,
            configure the optimizer (see :meth:`settle_optimizer`).
    """

    def __init__(self, owner: str, configs: List[BaseEmbeddingConfig], device: torch.device,
                 *, table_options, optimizer: Optional[OptimizerConfig],
                 backend: Optional[str], validate_inputs: bool, weights_are_counts: bool,
                 variable_batch: bool, group_tables: bool = True,
                 with_table_weights: bool = False):
        self.configs = configs
        self._inputs = TableInputs(configs)  # which KJT features each table reads
        self.device = device
        self.optimizer_config = optimizer if optimizer is not None else OptimizerConfig()
        if not isinstance(self.optimizer_config, OptimizerConfig):
            raise TypeError(f"optimizer must be an OptimizerConfig, got {optimizer!r}")
        # a sharder's fused_params may still configure it: say so at first training use
        self.optimizer_notice = DefaultOptimizerNotice(owner, given=optimizer is not None)
        self._table_options_given = table_options  # settled again for a marked optimizer
        self.table_options: Dict[str, DynamicEmbTableOptions] = settle_table_options(
            table_options, configs, self.optimizer_config)
        self.backend = backend
        self.validate_inputs = validate_inputs
        self._weights_are_counts = weights_are_counts
        self._variable_batch = variable_batch
        self.tables: Dict[str, DynamicTable] = build_configured_tables(
            configs, self.table_options, self.optimizer_config, device, backend)  # {} on meta
        # the CUDA kernels report keys without a slot at a later prefetch
        self._defers_failures = any(t.kernels.defers_failures for t in self.tables.values())
        self.groups_on = group_tables
        self.groups: List[TableGroup] = []
        self._regroup()
        self._queue: Deque[PrefetchState] = collections.deque()
        # batches looked up by training lookups whose backward has not run: pinned until
        # their backward or the next training lookup (see lookup)
        self._awaiting_backward: List[Tuple[str, LookupBatch]] = []
        self._steps = {name: 0 for name in self.tables}
        self._scores: Dict[str, int] = {}  # CUSTOMIZED tables: what training batches write
        #: tables with ``ttl_steps``: each training prefetch sweeps those due
        self._expiring = [name for name, options in self.table_options.items()
                          if options.ttl_steps is not None]
        self._scored = [name for name, options in self.table_options.items()
                        if options.score_strategy is ScorePolicy.CUSTOMIZED]
        self._generation = 0  # bumped by every checkpoint load: older lookups cannot backward
        self.fused_optimizer = DynamicEmbFusedOptimizer(self.optimizer_config.learning_rate)
        # the param groups besides fused_optimizer's that set the learning rate
        self.learning_rate = FollowedLearningRate()
        self._prefetch_stream = (torch.cuda.Stream(device=device)
                                 if device.type == "cuda" else None)
        # memory stashing (dynemb.stashing): None unless a table's options ask for it
        self.memory_stash = CollectionStash.build(self.tables, device, self._prefetch_stream,
                                                  self.row_units)
        self.table_weights = TableWeights(configs, owner) if with_table_weights else None
        self._marks_seen: Optional[Tuple[int, ...]] = None
        #: where the optimizer came from: "optimizer=", "marks", "a dense optimizer", or
        #: None (the default, so far)
        self.optimizer_source: Optional[str] = "optimizer=" if optimizer is not None else None
        # the default is final from the first training step (no dense optimizer held the
        # handles then)
        self._default_settled = False
        if self.table_weights is not None:
            self.table_weights.on_mark = self.marks_changed
            if optimizer is not None:
                self.table_weights.mark_trained_in_backward()

    def __setstate__(self, state: Dict[str, Any]) -> None:
        """Unpickling: plain ``pickle`` copies every tensor on its own, so each group makes
        its tables' arrays views of their parts again (see
        :meth:`~dynemb.tables.group_storage.GroupStorage.view_parts_again`)."""
        self.__dict__.update(state)
        for group in self.groups:
            group.view_parts_again()

    # -- the optimizer marked by apply_optimizer_in_backward, or a dense one -------------------
    def marks_changed(self) -> None:
        """Every handle carries a new mark (:mod:`dynemb.modules.table_weights`): adopt it
        now. A mark the module cannot take is refused later, at the next training step,
        checkpoint load or read of ``fused_optimizer`` (raising inside torch's marking
        loop would leave its marks half made)."""
        try:
            self.settle_marked_optimizer()
        except (TypeError, ValueError):
            pass

    def settle_optimizer(self, training: bool = False) -> None:
        """Settle the tables' optimizer before a training step (``training``), a checkpoint
        load or a read of ``fused_optimizer``: adopt new marks
        (:meth:`settle_marked_optimizer`); then, while nothing configured the optimizer,
        adopt that of a dense optimizer holding the table handles
        (:meth:`~dynemb.modules.table_weights.TableWeights.dense_optimizer`), as a mark.
        At the first training step with neither, the default is final. Nothing changes
        when it raises."""
        self.settle_marked_optimizer()
        weights = self.table_weights
        if weights is None or self.optimizer_source is not None or self._default_settled \
                or self.is_meta:
            return
        found = weights.dense_optimizer()
        if found is not None:
            params, groups = found
            self._adopt(fused_params_optimizer(params), groups,
                        f"{groups[0].name} holds the tables' parameters and configures",
                        "a dense optimizer")
        elif training:
            self._default_settled = True
            weights.mark_trains_with_default()

    def settle_marked_optimizer(self) -> None:
        """Adopt the optimizer that ``apply_optimizer_in_backward`` marked on the table
        handles (:mod:`dynemb.modules.table_weights`) when a mark is new; runs when the
        last handle is marked, and before a training step, a checkpoint load or a read of
        ``fused_optimizer``. A mark equal to the module's ``optimizer=`` changes
        nothing; one that differs raises ``ValueError``, as does one that comes after the
        tables hold rows (trained, loaded or filled with the default optimizer's layout).
        Otherwise the tables, still empty, are built again with the marked optimizer (its
        learning rate becomes the fused optimizer's, and the marks' optimizer objects set it
        from then on, :mod:`dynemb.modules.learning_rates`) and no default-optimizer
        warning comes. Nothing changes when it raises."""
        weights = self.table_weights
        if weights is None:
            return
        signature = weights.marks_signature()
        if signature == self._marks_seen:
            return
        fused = weights.marked_fused_params()
        if fused is not None:
            self._adopt(fused_params_optimizer(fused), weights.mark_groups(),
                        "apply_optimizer_in_backward marks", "marks")
        self._marks_seen = signature

    def _adopt(self, marked: OptimizerConfig, groups: List[FollowedGroup], what: str,
               source: str) -> None:
        owner = self.optimizer_notice.owner
        if self.optimizer_source == "optimizer=":
            if marked != self.optimizer_config:
                raise ValueError(
                    f"{owner}: {what} {marked} on the tables but "
                    f"the module trains with optimizer={self.optimizer_config}; configure "
                    f"the optimizer in one place (nothing was changed)")
            self.learning_rate.follow(self.fused_optimizer.param_groups[0], groups)
            self.table_weights.mark_trained_in_backward()
            return
        holding = [name for name, table in self.tables.items()
                   if self._steps[name] or _holds_rows(table)]
        if holding:
            raise ValueError(
                f"{owner}: {what} {marked} on the tables, but "
                f"tables {holding} already hold rows kept for the default optimizer "
                f"{self.optimizer_config} (trained, loaded or filled before the mark); mark "
                f"the tables' parameters (or build the dense optimizer holding them) before "
                f"the first training step or checkpoint load, or pass optimizer= to the "
                f"module (nothing was changed)")
        options = settle_table_options(self._table_options_given, self.configs, marked)
        self.clear_prefetched()
        self.optimizer_config, self.table_options = marked, options
        for config in self.configs:  # one table's memory goes before its new one comes
            if config.name in self.tables:
                del self.tables[config.name]
                self.tables[config.name] = self._build_table(config)
        self._defers_failures = any(t.kernels.defers_failures for t in self.tables.values())
        self._regroup()
        self.memory_stash = CollectionStash.build(self.tables, self.device,
                                                  self._prefetch_stream, self.row_units)
        self.fused_optimizer.param_groups[0]["lr"] = marked.learning_rate
        self.learning_rate.follow(self.fused_optimizer.param_groups[0], groups)
        self.optimizer_source = source
        self.optimizer_notice.configured()
        self.table_weights.mark_trained_in_backward()

    def take_optimizer_of(self, meta: "DynamicCore") -> None:
        """Materializing ``meta`` into this core (built with its optimizer config): keep
        its fused optimizer object (its lr, and schedulers on it), the groups that set the
        lr, its table handles (their marks and the optimizers on them) and where its
        optimizer came from."""
        self.fused_optimizer = meta.fused_optimizer
        self.learning_rate = meta.learning_rate
        self.optimizer_notice = meta.optimizer_notice
        self.optimizer_source = meta.optimizer_source
        self._table_options_given = meta._table_options_given
        self._marks_seen = meta._marks_seen
        self._default_settled = meta._default_settled
        if meta.table_weights is not None:
            self.table_weights = meta.table_weights
            self.table_weights.on_mark = self.marks_changed

    def optimizer_object(self) -> DynamicEmbFusedOptimizer:
        """``fused_optimizer`` as it stands for the next step: the optimizer settled
        (:meth:`settle_optimizer`) and its learning rate the one the tables will use."""
        self.settle_optimizer()
        self.learning_rate.current(self.fused_optimizer.param_groups[0])
        return self.fused_optimizer

    def _regroup(self) -> None:
        """Group the current tables (each group copies its tables into its own arrays):
        with ``group_tables=False``, each table in a group of one."""
        self.groups = []  # the old groups' arrays go with the last table that views them
        # in config order (a reset table comes last in self.tables)
        self.groups = group_tables({c.name: self.tables[c.name] for c in self.configs
                                    if c.name in self.tables}, apart=not self.groups_on)

    def row_units(self) -> List[Tuple[Tuple[str, ...], object]]:
        """``[(table names, rows)]``: where the rows of each group live now (its record: its
        tables share one tensor), for memory stashing; a table whose group was replaced
        since (a checkpoint load, a reset) its own tier until the next batch regroups it."""
        groups = [g for g in self.groups if g.intact(self.tables)]
        grouped = {name for group in groups for name in group.names}
        return ([(group.names, group.storage) for group in groups]
                + [((name,), table.tier) for name, table in self.tables.items()
                   if name not in grouped])

    def _current_groups(self) -> List[TableGroup]:
        """The groups a batch goes through; regrouped first if a table, or its
        arrays, were replaced since (a group keeps its tables' storage, not the module's
        names). Batches in flight, and those whose pins ended but whose backward may still
        come, move to the new groups; a batch whose group's tables changed ends its pins,
        queued prefetches are dropped, and a backward of an earlier lookup raises, as after a
        checkpoint load."""
        grouped = sum(len(group.names) for group in self.groups)
        if grouped == len(self.tables) and all(g.intact(self.tables) for g in self.groups):
            return self.groups
        in_flight = {id(b): b for state in self._queue for b in state.batches.values()}
        in_flight.update((id(b), b) for _, b in self._awaiting_backward)
        # and the lookups whose pins ended but whose backward may still come
        in_flight.update((id(b), b) for group in self.groups for b in group.live_batches())
        self.rows_in_place()  # the new groups copy the rows
        self._regroup()
        lost = False
        for batch in in_flight.values():
            if not batch.rehome(self.groups):
                batch.end_pins_alone()
                lost = True
        if lost:
            self.clear_prefetched()
            self._generation += 1
        return self.groups

    def _build_table(self, config: BaseEmbeddingConfig) -> Optional[DynamicTable]:
        return build_configured_tables([config], self.table_options, self.optimizer_config,
                                       self.device, self.backend).get(config.name)

    # -- views -------------------------------------------------------------------------------
    @property
    def is_meta(self) -> bool:
        return self.device.type == "meta"

    @property
    def steps(self) -> Dict[str, int]:
        return dict(self._steps)

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def pending_prefetches(self) -> int:
        return len(self._queue)

    @property
    def max_gradient(self) -> Optional[float]:
        return self.optimizer_config.max_gradient

    def storage_modes(self) -> Dict[str, StorageMode]:
        return {name: t.mode for name, t in self.tables.items()}

    def stats(self) -> Dict[str, Dict[str, Any]]:
        return {name: t.stats() for name, t in self.tables.items()}

    def rows_in_place(self, tables: Optional[Iterable[str]] = None) -> None:
        """Bring back the rows of ``tables`` (None: all) that memory stashing moved to host
        memory between a training forward and its backward: before anything reads or moves
        them."""
        if self.memory_stash is not None:
            self.memory_stash.bring_back(tables)

    def read_rows(self, table: str, keys: torch.Tensor, *, with_state: bool = False):
        if table not in self.tables:
            raise KeyError(f"no table {table!r}; tables: {list(self.tables)}")
        self.rows_in_place([table])
        return self.tables[table].read_rows(keys, with_state=with_state)

    def prepare_write(self, table: str, keys: torch.Tensor, rows: torch.Tensor,
                      optimizer_state: Optional[torch.Tensor] = None,
                      scores: Optional[torch.Tensor] = None) -> RowWrite:
        """A write of rows into ``table``, checked and ready to claim (see
        :mod:`dynemb.tables.row_writes`): the optimizer settled first (the state's layout
        is final), stashed rows back. Unknown tables raise ``KeyError``, bad input
        ``ValueError``; nothing changes."""
        if table not in self.tables:
            raise KeyError(f"no table {table!r} to write rows into; tables: "
                           f"{list(self.tables)}")
        self.settle_optimizer()
        self.rows_in_place([table])
        target = self.tables[table]
        default = self._scores.get(table)
        return RowWrite(target, check_write(target, keys, rows, optimizer_state, scores,
                                            default), default)

    def write_rows(self, table: str, keys: torch.Tensor, rows: torch.Tensor, *,
                   optimizer_state: Optional[torch.Tensor] = None,
                   scores: Optional[torch.Tensor] = None) -> None:
        write = self.prepare_write(table, keys, rows, optimizer_state, scores)
        write.claim()
        write.commit()

    def flush(self) -> Dict[str, int]:
        """Rows written back per table that keeps a copy of every row (CACHE), see
        :meth:`dynemb.tables.DynamicTable.flush`; other tables are left out."""
        self.rows_in_place()
        counts = {name: table.flush() for name, table in self.tables.items()}
        return {name: count for name, count in counts.items() if count is not None}

    def expire(self, tables: Optional[Iterable[str]], older_than: Optional[int],
               where) -> Dict[str, int]:
        """Rows erased per table (see :meth:`DynamicModule.expire
        <dynemb.modules.dynamic_module.DynamicModule.expire>`): every table's expiry is
        planned before any is applied."""
        names = list(self.tables) if tables is None else (
            [tables] if isinstance(tables, str) else list(tables))
        unknown = [n for n in names if n not in self.tables]
        if unknown:
            raise KeyError(f"no table {unknown[0]!r} to expire; tables: {list(self.tables)}")
        self.rows_in_place(names)
        plans = {n: plan_expiry(self.tables[n], older_than=older_than, where=where)
                 for n in names}
        return {name: plan.apply() for name, plan in plans.items()}

    def reset(self, tables: Optional[Iterable[str]] = None) -> None:
        """The named tables (every table when None) empty as just built, their steps back to
        0; prefetches and pins end. Unknown names raise ``KeyError`` before anything
        changes."""
        if tables is not None:
            names = [tables] if isinstance(tables, str) else list(tables)
            known = [config.name for config in self.configs]
            unknown = [n for n in names if n not in known]
            if unknown:
                raise KeyError(f"no table {unknown[0]!r} to reset; tables: {known}")
        if self.is_meta:
            return
        self.rows_in_place()  # the tables kept copy theirs into the new groups
        self.clear_prefetched()
        for config in self.configs:  # one table's memory goes before its new one comes
            if tables is not None and config.name not in names:
                continue
            del self.tables[config.name]
            self.tables[config.name], self._steps[config.name] = self._build_table(config), 0
        self._regroup()
        self._generation += 1

    # -- prefetch ----------------------------------------------------------------------------
    def set_scores(self, scores: Mapping[str, int]) -> None:
        """The score training batches write for the keys of each named CUSTOMIZED table,
        from the next prefetch on (kept until set again), all or nothing."""
        if not isinstance(scores, Mapping):
            raise TypeError(f"scores must map table names to ints, got {scores!r}")
        checked = {}
        for name, score in scores.items():
            options = self.table_options.get(name)
            if options is None:
                raise KeyError(f"no table {name!r}; tables: {list(self.table_options)}")
            if options.score_strategy is not ScorePolicy.CUSTOMIZED:
                raise ValueError(f"table {name!r} has score_strategy "
                                 f"{options.score_strategy.name}: only CUSTOMIZED tables take "
                                 f"scores (nothing was set)")
            checked[name] = check_score(name, score)
        self._scores.update(checked)

    @property
    def scores(self) -> Dict[str, int]:
        """The scores :meth:`set_scores` set, by table (a copy)."""
        return dict(self._scores)

    def prefetch(self, kjt: KeyedJaggedTensor, training: bool,
                 forward_stream: Optional[torch.cuda.Stream] = None) -> PrefetchState:
        """Resolve ``kjt``'s ids to slots and queue the result (on CUDA on the side stream,
        after the current stream and ``forward_stream``)."""
        if training:
            self.settle_optimizer(training=True)
        if self._prefetch_stream is None:
            state = self._prefetch_now(kjt, training)
        else:
            state = prefetch_on_stream(lambda: self._prefetch_now(kjt, training), kjt,
                                       self._prefetch_stream, self.device, forward_stream)
        self._queue.append(state)
        return state

    def _prefetch_now(self, kjt: KeyedJaggedTensor, training: bool) -> PrefetchState:
        per_table = split_by_table(kjt, self._inputs, self.device, validate=self.validate_inputs,
                                   weights_are_counts=self._weights_are_counts,
                                   variable_batch=self._variable_batch)
        for name in self._scored:  # before any table changes (no other policy can fail)
            check_batch_score(name, ScorePolicy.CUSTOMIZED, training, self._scores.get(name))
        if self.memory_stash is not None:  # rows this prefetch reads come back first
            self.memory_stash.before_prefetch(training)
        groups = self._current_groups()
        if training and self._defers_failures:  # earlier batches' keys without a slot (CUDA)
            check_failures(groups)
        if training and self._expiring:  # ttl_steps: rows unseen for long go before a claim
            for name in self._expiring:
                self.tables[name].expire_if_due()
        batches = prefetch_all(groups, per_table, training, self._scores, self._release)
        batches = {name: batches[name] for name in self.tables}
        features = {name: per_table[name][1] for name in self.tables}
        lengths = per_table["__lengths__"]
        return PrefetchState(batches, features, tuple(kjt.keys()), training,
                             lengths=lengths, values=kjt.values(), all_lengths=kjt.lengths())

    # -- lookup ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def lookup(self, kjt: KeyedJaggedTensor, trains: bool) -> Iterator[PrefetchState]:
        """The batch of ``kjt`` looked up, for the module to read its rows in the ``with``
        block. ``trains`` (a training forward with autograd on): the oldest batch queued for
        training is taken (or ``kjt`` is prefetched inline) and its pins last until its
        backward or the next training lookup; else the lookup is read-only and its pins end
        with the block."""
        if trains:
            self.settle_optimizer(training=True)
            self._check_lr()
            self.optimizer_notice.at_training(self.optimizer_config)
        self.rows_in_place()  # (rows still away: a backward that never came, an eval forward)
        state = self._take(kjt, trains)
        if trains:
            # the previous step's lookups end their pins now, after this batch pinned its
            # own rows: a lookup whose backward never comes (a table unused by the loss, an
            # output dropped, an exception) cannot hold rows for ever
            earlier, self._awaiting_backward = self._awaiting_backward, []
        try:
            for name in self.tables:
                batch = state.batches[name]
                batch.consumed = True
                if trains:
                    self._awaiting_backward.append((name, batch))
            yield state
        finally:
            if trains:
                self._release(earlier)
            else:  # read-only lookups hold their pins until their rows are read
                self._release(state.batches.items())
        if trains and self.memory_stash is not None:  # every lookup is done: rows can go
            self.memory_stash.after_lookup()

    def _take(self, kjt: KeyedJaggedTensor, trains: bool) -> PrefetchState:
        # training and eval prefetches queue apart: a forward takes the oldest of its own
        # mode, whatever the order they were made in (an eval pass prefetching its batches
        # while a training batch is queued ahead, or the other way round)
        at = next((i for i, queued in enumerate(self._queue) if queued.training == trains),
                  None)
        if at is not None:
            # a mismatch raises with the queue as it was: the batch prefetched is still the
            # next one, and its lookups were counted once, by prefetch
            check_state_matches(self._queue[at], kjt, sync_free=not self.validate_inputs)
            state = self._queue[at]
            del self._queue[at]
        else:  # nothing queued for this mode (e.g. an eval between steps): inline
            state = self._prefetch_now(kjt, trains)
        if state.ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(state.ready)
            for batch in state.batches.values():  # made on the prefetch stream, used here
                for tensor in batch.tensors():
                    tensor.record_stream(stream)
        return state

    def clear_prefetched(self) -> None:
        """Drop every queued prefetch, and end the pins of looked-up batches whose backward
        has not run (such a backward still updates the rows that are still stored)."""
        while self._queue:
            self._release(self._queue.popleft().batches.items())
        self.end_awaiting_backward()

    def end_awaiting_backward(self) -> None:
        """End the pins of the looked-up batches whose backward has not run."""
        self._release(self._awaiting_backward)
        self._awaiting_backward = []

    def _release(self, looked_up: Iterable[Tuple[str, LookupBatch]]) -> None:
        released = set()  # a group's batch stands for each of its tables: release it once
        for _, batch in looked_up:
            if id(batch) not in released:
                released.add(id(batch))
                batch.release()  # for all its tables

    # -- backward ----------------------------------------------------------------------------
    def before_backward(self) -> None:
        """Stashed rows come back now at the latest."""
        if self.memory_stash is not None:
            self.memory_stash.restore()

    def apply_gradients(self, batch: LookupBatch, grads, taking: Sequence[bool],
                        generation: int) -> None:
        """The fused update of the rows of ``batch`` (looked up at load ``generation``) from
        ``grads`` (an :class:`~dynemb.rows.optimizers.OccurrenceGrads` of its unique keys) for its
        tables ``taking`` a gradient (one flag per table of the batch), each at its own
        step."""
        names = batch.names
        if generation != self._generation:
            # named by the forward, not by the batch: grouped or not, a training forward
            # looks up every table, and the same error comes whichever batch's backward
            # runs first
            looked_up = [config.name for config in self.configs if config.name in self.tables]
            what = (f"table {looked_up[0]!r}" if len(looked_up) == 1 else
                    f"tables {looked_up}")
            raise RuntimeError(
                f"a checkpoint was loaded or tables were reset after this forward (of "
                f"{what}); its backward would update rows that are no longer there. Run a "
                f"new forward")
        again = [n for n, takes in zip(names, taking) if takes and batch.applied_to(n)]
        if again:
            raise RuntimeError(
                f"table {again[0]!r}: the backward of this lookup already ran and applied its "
                f"update; a second backward through the same forward (retain_graph=True) would "
                f"apply it twice. Sum the losses and call backward once, or run a new forward")
        lr = self._check_lr()  # read here: a scheduler may change it after the forward
        for name, takes in zip(names, taking):
            if takes:
                self._steps[name] += 1
        batch.apply_gradients(grads, taking, lr=lr, steps=self._steps)

    def _check_lr(self) -> float:
        try:
            given = self.learning_rate.current(self.fused_optimizer.param_groups[0])
            return checked_lr(given, "fused_optimizer.param_groups[0]['lr']")
        except (TypeError, ValueError) as err:
            raise type(err)(f"{err}; nothing was updated") from None

    # -- checkpoints -------------------------------------------------------------------------
    def save_state(self, destination, prefix: str, rank: int, world_size: int) -> None:
        """Every table's rows, scores, optimizer state, step and counters into a state dict
        (see :mod:`dynemb.checkpoint.module_state`): host copies of their live entries."""
        self.rows_in_place()
        save_tables(self.tables, self._steps, destination, prefix, rank, world_size)

    def load_state(self, state_dict: Mapping[str, Any], prefix: str, strict: bool,
                   missing_keys: List[str], unexpected_keys: List[str]) -> None:
        """``nn.Module._load_from_state_dict``'s part for the tables; errors raise
        (DistributedModelParallel's loader drops ``error_msgs``)."""
        saved = tables_to_load(state_dict, prefix, list(self.tables), strict, missing_keys,
                               unexpected_keys)
        if saved is None:
            return  # no table here, or strict: load_state_dict raises on the missing keys
        try:
            self.load_tables(saved)
        except ValueError as err:
            raise RuntimeError(str(err)) from None

    def load_tables(self, saved: Dict[str, List[SavedTable]]) -> None:
        """Replace the named tables' contents with their saved images, all or nothing (see
        :meth:`dynemb.modules.dynamic_module.DynamicModule.load_tables`)."""
        self.settle_optimizer()
        self.rows_in_place()
        exact = check_saved_tables(self.tables, saved)
        # fallible loads (by key, into new tables) first; in-place ones cannot fail
        restored = {n: restore(self.tables[n], parts) for n, parts in saved.items()
                    if n not in exact}
        self.clear_prefetched()
        restored.update({n: restore(self.tables[n], saved[n]) for n in exact})
        self.install_tables(restored, {n: max(p.step for p in saved[n]) for n in restored})

    def install_tables(self, tables: Dict[str, DynamicTable], steps: Dict[str, int]) -> None:
        """Swap in ``tables`` with their optimizer ``steps``: queued prefetches drop, pins
        end, and a backward of an earlier lookup raises instead of updating the new rows."""
        self.rows_in_place()
        self.clear_prefetched()
        for name, table in tables.items():
            self.tables[name] = table
            self._steps[name] = steps[name]
        self._regroup()
        self._generation += 1


def _holds_rows(table: DynamicTable) -> bool:
    stats = table.stats()
    return bool(stats["rows_device"] or stats["rows_backing"] or stats["admission_pending"])


def trains_now(module: torch.nn.Module) -> bool:
    """A training forward with autograd on (anything else reads rows only)."""
    return module.training and torch.is_grad_enabled()

