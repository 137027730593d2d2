"""``DynamicEmbCollection``: a drop-in ``EmbeddingCollection`` backed by dynamic tables."""
from __future__ import annotations

import collections
from typing import Any, Deque, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollectionInterface
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from dynemb.checkpoint.module_state import (NAMESPACE, check_saved_tables, collect_saved,
                                           save_tables)
from dynemb.checkpoint.table_state import SavedTable, restore
from dynemb.collection_config import (build_configured_table, check_configs, output_name_of,
                                      output_names_by_table, settle_table_options)
from dynemb.fused_optimizer import DynamicEmbFusedOptimizer, checked_lr
from dynemb.jagged import cut_by_feature, meta_outputs
from dynemb.module_conversion import check_conversion, prepare_pickle
from dynemb.module_interface import DynamicModuleInterface
from dynemb.occurrence_lookup import OccurrenceLookup
from dynemb.optimizer_config import DefaultOptimizerNotice
from dynemb.optimizers import OptimizerConfig
from dynemb.options import DynamicEmbTableOptions, StorageMode
from dynemb.prefetch import PrefetchState, check_state_matches, prefetch_on_stream
from dynemb.stashing.collection_stash import CollectionStash
from dynemb.tables import DynamicTable, TableBatch
from dynemb.table_inputs import split_by_table
from dynemb.tracing import ScriptingRefused, call_as_leaf, is_traced
from dynemb.validation import check_kjt


class DynamicEmbCollection(EmbeddingCollectionInterface, DynamicModuleInterface,
                           FusedOptimizerModule, ScriptingRefused):
    """``torchrec.EmbeddingCollection`` with hash-table rows: any int64 id, rows created on
    first sight, evicted by score, trained by a fused optimizer in backward.

    Same input and output as ``EmbeddingCollection``: ``forward(kjt)`` returns one
    ``JaggedTensor`` of float32 embeddings per feature, with the KJT's lengths.

    Args:
        tables: TorchRec ``EmbeddingConfig``s. The default ``max_capacity`` has room for
            ``num_embeddings`` distinct ids without evicting; several features may share a
            table, and a feature read by several tables gives one output per table,
            ``feature@table`` (TorchRec's names). Initial rows follow the config's
            ``weight_init_min/max`` (or ``init_fn``) as TorchRec's do.
        device: where the tables live.
        table_options: one :class:`DynamicEmbTableOptions` for every table, or a dict by
            table name (tables left out get the defaults).
        optimizer: the fused optimizer (:class:`~dynemb.optimizers.OptimizerConfig`); its
            learning rate can be changed between steps through :attr:`fused_optimizer`.
        need_indices: also return the ids as the ``weights`` of each JaggedTensor.
        validate_inputs: check each KJT (features, dtype, lengths, reserved ids) before any
            table changes. On CUDA this reads the lengths on the host; turn it off for a
            sync-free step once inputs are trusted.
        backend: "cpu" or "cuda" to override the kernels picked by device (e.g. "cuda" to
            run the CUDA kernels under numba's simulator).

    On ``device="meta"`` no table is allocated: the module only describes its tables, for
    :class:`~dynemb.sharding.DynamicEmbCollectionSharder` to build them on each rank; its
    ``forward`` returns meta outputs of the right shapes, as TorchRec's does.

    Example::

        >>> ec = DynamicEmbCollection(
        ...     tables=[EmbeddingConfig(name="t", embedding_dim=8, num_embeddings=1024,
        ...                             feature_names=["f"])],
        ...     optimizer=OptimizerConfig(OptimizerType.ADAM, learning_rate=1e-3))
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([10**12, 7]),
        ...                                           torch.tensor([1, 1]))
        >>> ec(kjt)["f"].values().shape
        torch.Size([2, 8])
    """

    #: Read the KJT's weights as how many times each id occurred: the sharded module feeds
    #: its shards deduplicated ids this way, so admission, LFU scores and the lookup counters
    #: still count every occurrence (see :mod:`dynemb.sharding.local_collection`).
    _weights_are_counts = False
    #: the config class ``tables`` must hold
    _config_type = EmbeddingConfig
    #: accept KJTs with a batch size per feature (each output keeps its feature's lengths)
    _variable_batch = True

    def __init__(self, tables: List[EmbeddingConfig], device: Optional[torch.device] = None, *,
                 table_options: Union[DynamicEmbTableOptions,
                                      Mapping[str, DynamicEmbTableOptions], None] = None,
                 optimizer: Optional[OptimizerConfig] = None, need_indices: bool = False,
                 validate_inputs: bool = True, backend: Optional[str] = None):
        super().__init__()
        self._configs = check_configs(tables, self._config_type)
        self._device = torch.device(device if device is not None else "cpu")
        self._optimizer_config = optimizer if optimizer is not None else OptimizerConfig()
        if not isinstance(self._optimizer_config, OptimizerConfig):
            raise TypeError(f"optimizer must be an OptimizerConfig, got {optimizer!r}")
        # a sharder's fused_params may still configure it: say so at first training use
        self._optimizer_notice = DefaultOptimizerNotice(type(self).__name__,
                                                        given=optimizer is not None)
        self._table_options = settle_table_options(table_options, self._configs,
                                                   self._optimizer_config)
        self._backend = backend
        self._need_indices = need_indices
        self._validate = validate_inputs
        self.tables: Dict[str, DynamicTable] = {}
        for config in self._configs:
            table = self._build_table(config)
            if table is not None:  # None on the meta device
                self.tables[config.name] = table
        self._output_name = output_name_of(self._configs)  # (table, feature) -> output
        self._output_names = [n for names in output_names_by_table(self._configs)
                              for n in names]
        self._queue: Deque[PrefetchState] = collections.deque()
        # batches looked up by training forwards whose backward has not run: pinned until
        # their backward or the next training forward (see forward)
        self._awaiting_backward: List[Tuple[str, TableBatch]] = []
        self._steps = {name: 0 for name in self.tables}
        self._generation = 0  # bumped by every checkpoint load: older lookups cannot backward
        self._fused_optimizer = DynamicEmbFusedOptimizer(self._optimizer_config.learning_rate)
        self._prefetch_stream = (torch.cuda.Stream(device=self._device)
                                 if self._device.type == "cuda" else None)
        # memory stashing (dynemb.stashing): None unless a table's options ask for it
        self._stash = CollectionStash.build(self.tables, self._device, self._prefetch_stream)

    def _build_table(self, config: EmbeddingConfig) -> Optional[DynamicTable]:
        return build_configured_table(config, self._table_options[config.name],
                                      self._optimizer_config, self._device, self._backend)

    def reset_parameters(self) -> None:
        """Empty every table as just constructed (rows, optimizer state, scores, store or
        host tier, admission counts, counters; steps back to 0): each id reads its initial
        row again. Prefetches and pins end; the learning rate stays. No-op on meta.

        Example::

            >>> ec = DynamicEmbCollection([EmbeddingConfig(
            ...     name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"])])
            >>> kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([3]),
            ...                                           torch.tensor([1]))
            >>> first = ec(kjt)["f"].values()
            >>> first.sum().backward()  # trains the row of id 3
            >>> ec.reset_parameters()
            >>> torch.equal(ec(kjt)["f"].values(), first)
            True
        """
        if self._device.type == "meta":
            return
        self.clear_prefetched()
        for config in self._configs:  # one table's memory goes before its new one comes
            del self.tables[config.name]
            self.tables[config.name], self._steps[config.name] = self._build_table(config), 0
        self._generation += 1

    # -- configuration views -----------------------------------------------------------------
    def embedding_configs(self) -> List[EmbeddingConfig]:
        return self._configs

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        dims = sorted({c.embedding_dim for c in self._configs})
        if len(dims) > 1:
            raise ValueError(f"tables have different embedding dims {dims}")
        return dims[0]

    def embedding_names_by_table(self) -> List[List[str]]:  # TorchRec's (feature@table)
        return output_names_by_table(self._configs)

    @property
    def table_options(self) -> Dict[str, DynamicEmbTableOptions]:
        return dict(self._table_options)

    @property
    def optimizer_config(self) -> OptimizerConfig:
        return self._optimizer_config

    @property
    def optimizer_given(self) -> bool:
        """Whether ``optimizer=`` was passed (if not, a sharder's ``fused_params`` may
        configure it; else the default applies and warns at first training use)."""
        return self._optimizer_notice.given

    @property
    def validate_inputs(self) -> bool:
        return self._validate

    @property
    def backend(self) -> Optional[str]:
        return self._backend

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def fused_optimizer(self) -> "DynamicEmbFusedOptimizer":
        return self._fused_optimizer

    @property
    def memory_stash(self) -> Optional[CollectionStash]:
        """The stashes of the tables whose rows wait in host memory between a training
        forward and its backward (see :mod:`dynemb.stashing`); None if no table stashes."""
        return self._stash

    def storage_modes(self) -> Dict[str, StorageMode]:
        """The storage mode each table runs in."""
        return {name: t.mode for name, t in self.tables.items()}

    def stats(self) -> Dict[str, Dict[str, Any]]:
        """Per-table counters and sizes (see :mod:`dynemb.counters`); one device read each."""
        return {name: t.stats() for name, t in self.tables.items()}

    def read_rows(self, table: str, keys: torch.Tensor, *, with_state: bool = False):
        """``(rows, found)``: the current rows of ``keys`` in ``table`` (see
        :meth:`dynemb.tables.DynamicTable.read_rows`); nothing is inserted or rescored."""
        if table not in self.tables:
            raise KeyError(f"no table {table!r}; tables: {list(self.tables)}")
        return self.tables[table].read_rows(keys, with_state=with_state)

    @property
    def pending_prefetches(self) -> int:
        return len(self._queue)

    @property
    def steps(self) -> Dict[str, int]:
        """Each table's optimizer step (a copy)."""
        return dict(self._steps)

    @property
    def generation(self) -> int:
        """How many times the tables were loaded or reset since construction."""
        return self._generation

    def table_configs(self) -> List[EmbeddingConfig]:
        return self._configs

    # -- nn.Module conversions ---------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        """Where ``.to()``, ``.cuda()``, ``.half()``... reach this module: a call that would
        move or convert the tables raises (:func:`dynemb.module_conversion.check_conversion`)."""
        check_conversion(fn, self._device)
        return super()._apply(fn, recurse)

    def __getstate__(self):
        """``torch.save(module)`` pickles the whole module (see
        :func:`~dynemb.module_conversion.prepare_pickle`)."""
        prepare_pickle(self)
        return self.__dict__.copy()

    # -- checkpoints -------------------------------------------------------------------------
    #: ``(rank, world size)`` the tables are saved as (a sharded module's shards set theirs)
    _checkpoint_group = (0, 1)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """Every table's rows, scores, optimizer state, step and counters (see
        :mod:`dynemb.checkpoint.module_state`): views of the tables, nothing is copied."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        save_tables(self.tables, self._steps, destination, prefix, *self._checkpoint_group)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # errors raise here: DistributedModelParallel's loader drops error_msgs
        try:
            saved, unexpected = collect_saved(state_dict, prefix, list(self.tables))
        except ValueError as err:
            raise RuntimeError(str(err)) from None
        unexpected_keys.extend(unexpected)
        absent = [n for n in self.tables if n not in saved]
        missing_keys.extend(f"{prefix}{NAMESPACE}.{n}.signature" for n in absent)
        if absent and strict:
            return  # load_state_dict raises on the missing keys; nothing changed
        try:
            self.load_tables(saved)
        except ValueError as err:
            raise RuntimeError(str(err)) from None

    def load_tables(self, saved: Dict[str, List[SavedTable]]) -> None:
        """Replace the named tables' contents with their saved images, all or nothing.

        Every image is checked first (a table of another dim, optimizer, dtype, storage mode
        or score policy raises ``ValueError`` naming it, and nothing changes). Then queued
        prefetches are dropped and pins of lookups awaiting backward end: a backward of a
        forward run before the load raises instead of updating the loaded rows."""
        exact = check_saved_tables(self.tables, saved)
        # fallible loads (by key, into new tables) first; in-place ones cannot fail
        restored = {n: restore(self.tables[n], parts) for n, parts in saved.items()
                    if n not in exact}
        self.clear_prefetched()
        restored.update({n: restore(self.tables[n], saved[n]) for n in exact})
        self.install_tables(restored, {n: max(p.step for p in saved[n]) for n in restored})

    def install_tables(self, tables: Dict[str, DynamicTable], steps: Dict[str, int]) -> None:
        """Swap in ``tables`` (rebuilt from a checkpoint) with their optimizer ``steps``:
        queued prefetches are dropped, pins of lookups awaiting backward end, and a backward
        of a forward run before raises instead of updating the new rows."""
        self.clear_prefetched()
        for name, table in tables.items():
            self.tables[name] = table
            self._steps[name] = steps[name]
        self._generation += 1

    # -- prefetch ----------------------------------------------------------------------------
    @torch.compiler.disable
    def prefetch(self, kjt: KeyedJaggedTensor,
                 forward_stream: Optional[torch.cuda.Stream] = None) -> PrefetchState:
        """Resolve ``kjt``'s ids to slots ahead of ``forward`` and queue the result.

        On CUDA the work runs on a side stream, after the current stream (where the input is
        ready) and ``forward_stream`` (where earlier steps update the tables); ``forward``
        waits for it. Rows of queued batches stay pinned: a cache too small for all of them
        raises ``TableFullError``.
        """
        if self._prefetch_stream is None:
            state = self._prefetch_now(kjt, self.training)
        else:
            state = prefetch_on_stream(
                lambda: self._prefetch_now(kjt, self.training), kjt, self._prefetch_stream,
                self._device, forward_stream)
        self._queue.append(state)
        return state

    def _prefetch_now(self, kjt: KeyedJaggedTensor, training: bool) -> PrefetchState:
        if self._device.type == "meta":
            raise RuntimeError("this DynamicEmbCollection is on the meta device and holds no "
                               "rows: shard it (DistributedModelParallel with "
                               "DynamicEmbCollectionSharder) or build it on a real device")
        per_table = self._split_by_table(kjt)
        batches: Dict[str, TableBatch] = {}
        try:
            for name, table in self.tables.items():
                keys, _, occurrences = per_table[name]
                batches[name] = table.prefetch(keys, training, occurrences=occurrences)
        except Exception:
            self._release(batches.items())
            raise
        features = {name: per_table[name][1] for name in self.tables}
        lengths = {f: jt.lengths() for f, jt in per_table["__jt__"].items()}
        return PrefetchState(batches, features, tuple(kjt.keys()), training,
                             lengths=lengths, values=kjt.values(), all_lengths=kjt.lengths())

    def _split_by_table(self, kjt: KeyedJaggedTensor):
        """Validate, then concatenate each table's feature values (int64)."""
        return split_by_table(kjt, self._configs, self._device, validate=self._validate,
                              weights_are_counts=self._weights_are_counts,
                              variable_batch=self._variable_batch)

    # -- forward -----------------------------------------------------------------------------
    # numba kernels and host-side bookkeeping: torch.compile runs this eagerly (graph break)
    @torch.compiler.disable
    def forward(self, kjt: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        """Embeddings of ``kjt`` per feature.

        A training forward with autograd on consumes the oldest prefetched state (or
        prefetches inline when none is queued) and its rows stay pinned until its backward or
        the next training forward, whichever comes first. In eval mode or under
        ``torch.no_grad()`` the lookup is read-only: nothing is inserted, rescored or
        updated, unseen ids get the eval initializer, and queued training batches are left
        for the training forward they were prefetched for."""
        if is_traced(kjt):  # symbolic tracing: one call_module node (dynemb.tracing)
            return call_as_leaf(self, kjt)
        if self._device.type == "meta":
            return self._meta_outputs(kjt)
        trains = self.training and torch.is_grad_enabled()
        if trains:
            self._check_lr()
            self._optimizer_notice.at_training(self._optimizer_config)
        if self._queue and self._queue[0].training == trains:
            # a mismatch raises with the queue as it was: the batch prefetched is still the
            # next one, and its lookups were counted once, by prefetch
            check_state_matches(self._queue[0], kjt, sync_free=not self._validate)
            state = self._queue.popleft()
        else:  # nothing queued, or queued for the other mode (e.g. an eval between steps)
            state = self._prefetch_now(kjt, trains)
        if state.ready is not None:
            stream = torch.cuda.current_stream(self._device)
            stream.wait_event(state.ready)
            for batch in state.batches.values():  # made on the prefetch stream, used here
                for tensor in batch.tensors():
                    tensor.record_stream(stream)
        if trains:
            # the previous step's lookups end their pins now, after this batch pinned its
            # own rows: a lookup whose backward never comes (a table unused by the loss, an
            # output dropped, an exception) cannot hold rows for ever
            earlier, self._awaiting_backward = self._awaiting_backward, []
        out: Dict[str, Any] = {}
        try:
            for name in self.tables:
                batch = state.batches[name]
                batch.consumed = True
                if trains:
                    self._awaiting_backward.append((name, batch))
                out.update(self._table_outputs(name, state, kjt, trains))
            result = self._collect_outputs(out, state, kjt, trains)
        finally:
            if trains:
                self._release(earlier)
            else:  # read-only lookups hold their pins until their rows are read
                self._release(state.batches.items())
        if trains and self._stash is not None:  # every lookup is enqueued: the rows can go
            self._stash.after_lookup()
        return result

    def _table_outputs(self, name: str, state: PrefetchState, kjt: KeyedJaggedTensor,
                       trains: bool) -> Dict[str, Any]:
        """How one table's rows become its features' outputs: here one JaggedTensor of rows
        per feature, gathered straight per occurrence (a pooled collection overrides this and
        :meth:`_collect_outputs`). Their backward hands the output gradients to the fused
        optimizer kernel, which clips and sums them per row itself."""
        batch = state.batches[name]
        if trains:
            anchor = torch.empty(0, device=self._device, requires_grad=True)
            rows = OccurrenceLookup.apply(anchor, self, name, batch)
        else:
            rows = self.tables[name].lookup_occurrences(batch)
        named = [(self._output_name[(name, f)], count) for f, count in state.features[name]]
        feature_of = {self._output_name[(name, f)]: f for f, _ in state.features[name]}
        ids = ({f: kjt[f].values() for f, _ in state.features[name]} if self._need_indices
               else None)
        return cut_by_feature(rows, named, state.lengths, ids, feature_of)

    def _collect_outputs(self, out: Dict[str, Any], state: PrefetchState,
                         kjt: KeyedJaggedTensor, trains: bool) -> Dict[str, JaggedTensor]:
        """The forward's result from :meth:`_table_outputs`' parts, here every output's
        JaggedTensor in config order (table by table), as TorchRec's."""
        return {n: out[n] for n in self._output_names if n in out}

    def _meta_outputs(self, kjt: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        """``forward`` on the meta device (see :func:`dynemb.jagged.meta_outputs`)."""
        check_kjt(kjt, kjt.values().device, check_lengths=False,
                  variable_batch=self._variable_batch)
        return meta_outputs(kjt, self._configs, self._output_name, self._need_indices)

    def clear_prefetched(self) -> None:
        """Drop every queued prefetch, and end the pins of looked-up batches whose backward
        has not run (such a backward still updates the rows that are still stored)."""
        while self._queue:
            self._release(self._queue.popleft().batches.items())
        self._end_awaiting_backward()

    def _release(self, looked_up: Iterable[Tuple[str, TableBatch]]) -> None:
        for name, batch in looked_up:
            self.tables[name].release(batch)

    def _end_awaiting_backward(self) -> None:
        self._release(self._awaiting_backward)
        self._awaiting_backward = []

    def train(self, mode: bool = True) -> "DynamicEmbCollection":
        """``nn.Module.train``; leaving training also ends the pins of looked-up batches
        whose backward has not run."""
        if not mode:
            self._end_awaiting_backward()
        return super().train(mode)

    def _check_lr(self) -> float:
        given = self._fused_optimizer.param_groups[0]["lr"]
        try:
            return checked_lr(given, "fused_optimizer.param_groups[0]['lr']")
        except (TypeError, ValueError) as err:
            raise type(err)(f"{err}; nothing was updated") from None

    def _apply_gradients(self, name: str, batch: TableBatch, grads: torch.Tensor,
                         generation: int) -> None:
        if generation != self._generation:
            raise RuntimeError(
                f"table {name!r} was loaded from a checkpoint or reset after this forward; "
                f"its backward would update rows that are no longer there. Run a new forward")
        lr = self._check_lr()  # read here: a scheduler may change it after the forward
        if not batch.applied:
            self._steps[name] += 1
        self.tables[name].apply_gradients(batch, grads, lr=lr, step=self._steps[name])

    def extra_repr(self) -> str:
        return ", ".join(repr(t) for t in self.tables.values())
