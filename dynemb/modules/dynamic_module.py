"""``DynamicModule``: the ``nn.Module`` face both drop-in modules share.

:class:`~dynemb.modules.collection.DynamicEmbCollection` and
:class:`~dynemb.modules.bag_collection.DynamicEmbBagCollection` are siblings, as TorchRec's
``EmbeddingCollection`` and ``EmbeddingBagCollection`` are: each is its TorchRec interface
plus this class, which holds a :class:`~dynemb.modules.dynamic_core.DynamicCore` (tables, prefetch
queue, pins, stash, fused optimizer, checkpoint state) and answers the PyTorch habits
(``state_dict``, ``.to()``, pickling, ``train()``) for it. Each sibling only says how rows
become its outputs.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb.checkpoint.table_state import SavedTable
from dynemb.modules.dynamic_core import DynamicCore
from dynemb.rows.fused_optimizer import DynamicEmbFusedOptimizer
from dynemb.modules.module_conversion import check_conversion, materialized_device, prepare_pickle
from dynemb.module_interface import DynamicModuleInterface
from dynemb.rows.optimizers import OptimizerConfig
from dynemb.options import DynamicEmbTableOptions, StorageMode
from dynemb.modules.prefetch import PrefetchState
from dynemb.stashing.collection_stash import CollectionStash
from dynemb.tables import DynamicTable
from dynemb.modules.table_weights import TableWeights
from dynemb.modules.tracing import ScriptingRefused
from dynemb.foundations.validation import canonical_device

_META_HINT = ("is on the meta device and holds no rows: shard it (DistributedModelParallel "
              "with its dynemb sharder), materialize it with .to_empty(device=...), or build "
              "it on a real device")


class DynamicModule(DynamicModuleInterface, FusedOptimizerModule, ScriptingRefused):
    """The part of a dynamic module that is the same for sequence and pooled outputs; the
    subclass builds ``self._core`` (:meth:`_build_core`) in its ``__init__``."""

    #: Read the KJT's weights as how many times each id occurred: the sharded modules feed
    #: their shares deduplicated ids this way, so admission, LFU scores and the lookup
    #: counters still count every occurrence.
    _weights_are_counts = False
    #: accept KJTs with a batch size per feature
    _variable_batch = True
    #: ``(rank, world size)`` the tables are saved as
    _checkpoint_group = (0, 1)
    #: give each table a parameter handle (:mod:`dynemb.modules.table_weights`); a sharded module's
    #: share of the tables has none (its optimizer is settled when it is sharded)
    _has_table_weights = True

    def _build_core(self, configs: List[BaseEmbeddingConfig], device, *, table_options,
                    optimizer, validate_inputs: bool, backend: Optional[str],
                    group_tables: bool = False) -> None:
        if device is None:  # as TorchRec's modules: the default device (meta inside
            device = torch.get_default_device()  # ``with torch.device("meta"):``)
        # host-side tensors made without a device stay on the host even inside a
        # ``with torch.device(...)`` block
        with torch.device("cpu"):
            self._core = DynamicCore(
                type(self).__name__, configs, canonical_device(device),
                table_options=table_options, optimizer=optimizer, backend=backend,
                validate_inputs=validate_inputs, weights_are_counts=self._weights_are_counts,
                variable_batch=self._variable_batch, group_tables=group_tables,
                with_table_weights=self._has_table_weights)
        if self._core.table_weights is not None:  # the child "table_weights"
            self.table_weights: TableWeights = self._core.table_weights

    # -- configuration views -----------------------------------------------------------------
    @property
    def tables(self) -> Dict[str, DynamicTable]:
        """Each table's :class:`~dynemb.tables.DynamicTable`, by name (none on meta)."""
        return self._core.tables

    def table_configs(self) -> List[BaseEmbeddingConfig]:
        return self._core.configs

    @property
    def table_options(self) -> Dict[str, DynamicEmbTableOptions]:
        return dict(self._core.table_options)

    @property
    def optimizer_config(self) -> OptimizerConfig:
        return self._core.optimizer_config

    @property
    def optimizer_given(self) -> bool:
        """Whether ``optimizer=`` was passed, or ``apply_optimizer_in_backward`` marked the
        tables' parameters and the module took that optimizer (if not, a sharder's
        ``fused_params`` may configure it; else the default applies and warns at first
        training use)."""
        return self._core.optimizer_notice.given

    @property
    def optimizer_source(self) -> Optional[str]:
        """Where the tables' optimizer came from: ``"optimizer="`` (the module's argument),
        ``"marks"`` (``apply_optimizer_in_backward``), ``"a dense optimizer"`` (one holding
        the tables' parameters, :mod:`dynemb.modules.table_weights`), or None (the default,
        so far; a sharder's ``fused_params`` may still configure it)."""
        return self._core.optimizer_source

    def marked_fused_params(self) -> Optional[Dict[str, Any]]:
        """The fused params that ``apply_optimizer_in_backward`` marks on the tables'
        parameters configure
        (:meth:`~dynemb.modules.table_weights.TableWeights.marked_fused_params`;
        None when unmarked): what a sharder reads."""
        weights = getattr(self, "table_weights", None)
        return None if weights is None else weights.marked_fused_params()

    @property
    def validate_inputs(self) -> bool:
        return self._core.validate_inputs

    @property
    def backend(self) -> Optional[str]:
        return self._core.backend

    @property
    def group_tables(self) -> bool:
        """Whether tables of one shape train as groups (:mod:`dynemb.tables.groups`); a
        sharder gives each rank's share the same setting."""
        return self._core.groups_on

    def table_groups(self) -> List[Tuple[str, ...]]:
        """The names of the tables of each group. A table that can group but has no
        partner is a group of one (tables with admission group only with each other);
        ``group_tables=False`` puts every table in a group of one.

        Example::

            >>> configs = [EmbeddingConfig(name=n, embedding_dim=8, num_embeddings=64,
            ...                            feature_names=[n]) for n in ("a", "b", "c")]
            >>> DynamicEmbCollection(configs).table_groups()
            [('a', 'b', 'c')]
            >>> DynamicEmbCollection(configs, group_tables=False).table_groups()
            [('a',), ('b',), ('c',)]
        """
        return [group.names for group in self._core.groups]

    @property
    def device(self) -> torch.device:
        """Where the tables live: the ``device`` argument, else the default device (meta
        when built inside ``with torch.device("meta"):``, as TorchRec's modules)."""
        return self._core.device

    @property
    def collection(self) -> "DynamicModule":
        """This module itself: the name under which a ``GraphModule`` traced from it (the
        module as the root of ``torchrec.fx.symbolic_trace``) holds and calls it (see
        :mod:`dynemb.modules.tracing`)."""
        return self

    @property
    def fused_optimizer(self) -> DynamicEmbFusedOptimizer:
        """The optimizer object of the tables (LR schedulers work on it). Reading it first
        adopts what configures the optimizer (marks of ``apply_optimizer_in_backward``, a
        dense optimizer holding the tables' parameters) and the learning rate the next step
        will use; a configuration the module cannot take raises ``ValueError``."""
        return self._core.optimizer_object()

    def rows_in_place(self) -> None:
        """Bring back the rows memory stashing moved to host memory between a training
        forward and its backward (the module's own methods do: ``read_rows``,
        ``state_dict``...; this is for code that reads ``tables`` directly meanwhile)."""
        self._core.rows_in_place()

    @property
    def memory_stash(self) -> Optional[CollectionStash]:
        """The stashes of the tables whose rows wait in host memory between a training
        forward and its backward (see :mod:`dynemb.stashing`); None if no table stashes."""
        return self._core.memory_stash

    @property
    def steps(self) -> Dict[str, int]:
        """Each table's optimizer step (a copy)."""
        return self._core.steps

    @property
    def generation(self) -> int:
        """How many times the tables were loaded or reset since construction."""
        return self._core.generation

    @property
    def pending_prefetches(self) -> int:
        return self._core.pending_prefetches

    def storage_modes(self) -> Dict[str, StorageMode]:
        """The storage mode each table runs in."""
        return self._core.storage_modes()

    def stats(self) -> Dict[str, Dict[str, Any]]:
        """Per-table counters and sizes (see :mod:`dynemb.foundations.counters`); one device read
        each."""
        return self._core.stats()

    def read_rows(self, table: str, keys: torch.Tensor, *, with_state: bool = False):
        """``(rows, found)``: the current rows of ``keys`` in ``table`` (see
        :meth:`dynemb.tables.DynamicTable.read_rows`); nothing is inserted or rescored."""
        self._refuse_on_meta("has no rows to read")
        return self._core.read_rows(table, keys, with_state=with_state)

    def write_rows(self, table: str, keys: torch.Tensor, rows: torch.Tensor, *,
                   optimizer_state: Optional[torch.Tensor] = None,
                   scores: Optional[torch.Tensor] = None) -> None:
        """Write ``rows`` [N, dim] for ``keys`` [N] into ``table``: a key the table holds
        has its row replaced, a new key is inserted with it (HierarchicalKV's
        ``insert_or_assign``); ``read_rows`` and the next forward read them bit for bit.
        All or nothing: bad input (an unknown table raises ``KeyError``; a row of another
        dim or dtype, keys not 1-D int64, a key twice or a reserved key, an
        ``optimizer_state`` of another width, ``scores`` of another shape raise
        ``ValueError``) and a batch that cannot fit (``TableFullError``) leave every
        table unchanged.

        ``rows`` are in the table's dtype. ``optimizer_state`` [N, state_dim] float32 is the
        optimizer state after the embedding in the layout ``read_rows(...,
        with_state=True)`` returns (default: a key held keeps its state, a new key starts
        from a new row's); ``scores`` [N] int64 set the keys' scores exactly (default: a
        key held keeps its score, a new key scores as one use; a CUSTOMIZED table without
        them takes its :meth:`set_scores` score). Where each storage mode puts the rows
        (a CACHE table: keys not cached go to its backing store), what becomes of rows of
        batches in flight, and the counts ``write_inserts`` / ``write_overwrites`` of ``stats()``: see
        :mod:`dynemb.tables.row_writes`.

        Example::

            >>> ec = DynamicEmbCollection([EmbeddingConfig(
            ...     name="t", embedding_dim=2, num_embeddings=64, feature_names=["f"])])
            >>> ec.write_rows("t", torch.tensor([3, 8]), torch.tensor([[1., 2.], [3., 4.]]))
            >>> kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([8, 3]),
            ...                                           torch.tensor([2]))
            >>> ec.eval()(kjt)["f"].values().tolist()
            [[3.0, 4.0], [1.0, 2.0]]
            >>> {k: ec.stats()["t"][k] for k in ("write_inserts", "write_overwrites")}
            {'write_inserts': 2, 'write_overwrites': 0}
        """
        self._refuse_on_meta("has no rows to write")
        self._core.write_rows(table, keys, rows, optimizer_state=optimizer_state,
                              scores=scores)

    def prepare_write(self, table: str, keys: torch.Tensor, rows: torch.Tensor, *,
                      optimizer_state: Optional[torch.Tensor] = None,
                      scores: Optional[torch.Tensor] = None):
        """:meth:`write_rows` in steps, a :class:`~dynemb.tables.row_writes.RowWrite`
        checked and ready to ``claim()``, then ``commit()`` or ``undo()`` (a sharded module
        claims on every rank before any rank writes)."""
        self._refuse_on_meta("has no rows to write")
        return self._core.prepare_write(table, keys, rows, optimizer_state, scores)

    def set_scores(self, scores: Dict[str, int]) -> None:
        """Set, per table, the score that training batches write for their keys: every key of
        such a batch (found or inserted) gets it, e.g. a timestamp or a business value, and
        eviction takes the lowest. For tables with ``score_strategy=ScorePolicy.CUSTOMIZED``,
        whose training batches need one (a training step without it raises ``ValueError``
        before any table changes). A score stays until set again and applies from the next
        prefetch (batches prefetched before keep the score they were prefetched with); it is
        module configuration, not table state: checkpoints keep the keys' scores, not it.

        Unknown tables raise ``KeyError``, tables of another policy or non-int64 scores
        ``ValueError``, and nothing is set.

        Example::

            >>> ec = DynamicEmbCollection([EmbeddingConfig(
            ...     name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"])],
            ...     table_options=DynamicEmbTableOptions(score_strategy=ScorePolicy.CUSTOMIZED))
            >>> ec.set_scores({"t": 1234})
            >>> _ = ec(KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([3, 5]),
            ...                                            torch.tensor([2])))
            >>> table = ec.tables["t"].tier.hash
            >>> table.scores_at(table.find(torch.tensor([3, 5]))).tolist()
            [1234, 1234]
        """
        self._core.set_scores(scores)

    @property
    def scores(self) -> Dict[str, int]:
        """The scores :meth:`set_scores` set, by table (a copy)."""
        return self._core.scores

    def flush(self) -> Dict[str, int]:
        """Write every cached row of each CACHE table to its backing store (the rows stay
        cached), so the store holds the latest rows without a checkpoint; returns the rows
        written per CACHE table. Tables of the other modes keep no second copy and are left
        out. Stashed rows (:mod:`dynemb.stashing`) come back first. See
        :meth:`dynemb.tables.cache.CacheTable.flush` for lookups awaiting their backward.

        Example::

            >>> ec = DynamicEmbCollection([EmbeddingConfig(
            ...     name="t", embedding_dim=4, num_embeddings=1024, feature_names=["f"])],
            ...     table_options=DynamicEmbTableOptions(caching=True,
            ...                                          global_hbm_for_values=256 * 16))
            >>> _ = ec(KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([2, 5, 2]),
            ...                                            torch.tensor([3])))
            >>> ec.flush()  # ids 2 and 5
            {'t': 2}
        """
        return self._core.flush()

    def expire(self, tables: Optional[Iterable[str]] = None, *,
               older_than: Optional[int] = None, where=None) -> Dict[str, int]:
        """Erase now, from every tier of each table (``tables``: a name or names, None: all),
        the rows not looked up in the last ``older_than`` of its steps (its training
        batches; ``STEP`` tables: inserted that long ago), or those ``where(keys, scores)``
        chooses ([N] int64 each -> [N] bool, as HierarchicalKV's ``erase_if``). Rows pinned
        by a batch in flight stay. Returns the rows erased per table, also counted in
        ``stats()[table]["expired"]``. Every table's expiry is planned before any row goes:
        an unknown table (``KeyError``), a policy whose scores hold no step with
        ``older_than``, or a ``where`` that answers wrongly (``ValueError`` / ``TypeError``)
        erases nothing. See :mod:`dynemb.tables.expiry`; ``ttl_steps`` in the table options
        sweeps by itself.

        Example::

            >>> ec = DynamicEmbCollection([EmbeddingConfig(
            ...     name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"])])
            >>> for ids in ([1, 2], [2], [2]):  # key 1 last looked up two steps ago
            ...     _ = ec(KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor(ids),
            ...                                                torch.tensor([len(ids)])))
            >>> ec.expire(older_than=2)
            {'t': 1}
            >>> ec.expire(where=lambda keys, scores: keys == 2)  # pinned: awaits its backward
            {'t': 0}
            >>> ec.stats()["t"]["expired"]
            1
        """
        self._refuse_on_meta("has no rows to expire")
        return self._core.expire(tables, older_than, where)

    # -- lifecycle ---------------------------------------------------------------------------
    def reset_parameters(self, tables: Optional[Iterable[str]] = None) -> None:
        """Empty every table (or only the names in ``tables``) as just constructed (rows,
        optimizer state, scores, store or host tier, admission counts, counters; steps back
        to 0): each id reads its initial row again. Prefetches and pins end, of every table;
        a backward of a forward run before raises (it would update rows no longer there).
        The learning rate stays. An unknown name raises ``KeyError`` and nothing changes.
        No-op on meta.

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
            >>> ec.reset_parameters(tables=["t"])  # one table alone
        """
        self._core.reset(tables)

    @torch.compiler.disable
    def prefetch(self, kjt: KeyedJaggedTensor,
                 forward_stream: Optional[torch.cuda.Stream] = None) -> PrefetchState:
        """Resolve ``kjt``'s ids to slots ahead of ``forward`` and queue the result.

        On CUDA the work runs on a side stream, after the current stream (where the input is
        ready) and ``forward_stream`` (where earlier steps update the tables); ``forward``
        waits for it. Rows of queued batches stay pinned: a cache too small for all of them
        raises ``TableFullError``. A prefetch in eval mode is read-only; training and eval
        prefetches queue apart, each forward taking the oldest of its own mode (an
        evaluation pass may prefetch its batches while a training batch is queued ahead).
        """
        self._refuse_on_meta("cannot prefetch")
        self._check_input(kjt)
        return self._core.prefetch(kjt, self.training, forward_stream)

    def _refuse_on_meta(self, what: str) -> None:
        """Raise ``RuntimeError`` saying the module ``what`` on meta, and how to get rows."""
        if self._core.is_meta:
            raise RuntimeError(f"this {type(self).__name__} {what}: it {_META_HINT}")

    def _check_input(self, kjt: KeyedJaggedTensor) -> None:
        """Checks of a sibling's own, before any table changes (the shared ones run in the
        core)."""

    def clear_prefetched(self) -> None:
        """Drop every queued prefetch, and end the pins of looked-up batches whose backward
        has not run (such a backward still updates the rows that are still stored)."""
        self._core.clear_prefetched()

    def train(self, mode: bool = True):
        """``nn.Module.train``; leaving training also ends the pins of looked-up batches
        whose backward has not run."""
        if not mode:
            self._core.end_awaiting_backward()
        return super().train(mode)

    # -- nn.Module conversions ---------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        """Where ``.to()``, ``.cuda()``, ``.half()``... reach this module: a call that would
        move or convert the tables raises
        (:func:`dynemb.modules.module_conversion.check_conversion`).
        ``to_empty(device=...)`` of a module on meta builds its tables there (TorchRec's way
        to materialize a meta module; :meth:`_materialize`)."""
        target = materialized_device(fn, self._core.device)
        if target is not None:
            self._materialize(target)
        else:
            check_conversion(fn, self._core.device)
        return super()._apply(fn, recurse)

    def _materialize(self, device: torch.device) -> None:
        """The module, described on meta, built on ``device`` with the same configuration
        (options, optimizer, the fused optimizer object with its learning rate, scores): the
        tables start empty, as they would have been built there. If building fails, the
        module stays on meta."""
        meta = self._core
        self._build_core(meta.configs, device, table_options=meta.table_options,
                         optimizer=meta.optimizer_config if meta.optimizer_source is not None
                         else None, validate_inputs=meta.validate_inputs,
                         backend=meta.backend, group_tables=meta.groups_on)
        # the fused optimizer object (its lr, schedulers on it), the same handles (their
        # marks, optimizers on them) and where the optimizer came from
        self._core.take_optimizer_of(meta)
        if meta.table_weights is not None:
            self.table_weights = meta.table_weights
        if meta.scores:
            self._core.set_scores(meta.scores)

    def settle_optimizer(self) -> None:
        """Adopt now what configures the tables' optimizer: new marks of
        ``apply_optimizer_in_backward``, or a dense optimizer holding the tables' parameters
        (:meth:`~dynemb.modules.dynamic_core.DynamicCore.settle_optimizer`); done before
        training steps and checkpoint loads."""
        self._core.settle_optimizer()

    def __getstate__(self):
        """``torch.save(module)`` pickles the whole module (see
        :func:`~dynemb.modules.module_conversion.prepare_pickle`)."""
        prepare_pickle(self)
        return self.__dict__.copy()

    # -- checkpoints -------------------------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """Every table's rows, scores, optimizer state, step and counters (see
        :mod:`dynemb.checkpoint.module_state`): host copies of the live entries only, so the
        state dict's size follows the rows the tables hold, not their capacity."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        self._core.save_state(destination, prefix, *self._checkpoint_group)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        self._core.load_state(state_dict, prefix, strict, missing_keys, unexpected_keys)

    def load_tables(self, saved: Dict[str, List[SavedTable]]) -> None:
        """Replace the named tables' contents with their saved images, all or nothing.

        Every image is checked first (a table of another dim, optimizer, dtype or score
        policy raises ``ValueError`` naming it, and nothing changes; another storage mode
        loads by key). Then queued
        prefetches are dropped and pins of lookups awaiting backward end: a backward of a
        forward run before the load raises instead of updating the loaded rows."""
        self._core.load_tables(saved)

    def install_tables(self, tables: Dict[str, DynamicTable], steps: Dict[str, int]) -> None:
        """Swap in ``tables`` (rebuilt from a checkpoint) with their optimizer ``steps``:
        queued prefetches are dropped, pins of lookups awaiting backward end, and a backward
        of a forward run before raises instead of updating the new rows."""
        self._core.install_tables(tables, steps)

    def extra_repr(self) -> str:
        return ", ".join(repr(t) for t in self._core.tables.values())
