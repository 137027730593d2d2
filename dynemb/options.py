"""Per-table options of :class:`DynamicEmbCollection` and the storage mode they lead to."""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from dynemb.rows.flat_table import RowLayout
from dynemb.rows.hash_table import max_table_capacity
from dynemb.rows.hash_table_checks import slots_for_keys
from dynemb.rows.initializers import Initializer, InitializerKind, initializer_from_config
from dynemb.types import MAX_BUCKET_SIZE, SUPPORTED_DTYPES, ScorePolicy
from dynemb.foundations.validation import check_bucket_size, check_int


class StorageMode(enum.Enum):
    """Where a table's rows live (chosen per table by :func:`choose_storage_mode`).

    - ``HBM_DIRECT``: the whole table (values + optimizer state) fits the device budget: one
      hash table and one flat table on the device.
    - ``CACHE``: it does not fit and ``caching=True``: the device tables cache the hot rows of
      a backing store that holds every row; evicted rows are written back, missed rows loaded.
    - ``DEFAULT``: it does not fit and ``caching=False``: a device tier and a host tier side by
      side, each key placed in one of them by its hash; lookups run in ``forward``.
    - ``HOST_ONLY``: a device budget of 0 bytes: every row (values, optimizer state, hash
      table) lives in host memory, pinned when the module is on CUDA, and nothing on the
      device; the forward copies the rows it gathered there to the module's device.
    """

    HBM_DIRECT = "hbm_direct"
    CACHE = "cache"
    DEFAULT = "default"
    HOST_ONLY = "host_only"


class StashMode(enum.Enum):
    """What embedding memory stashing (EMS, :mod:`dynemb.stashing`) moves out of a table's
    device rows between a training forward's lookup and its backward.

    - ``NONE``: nothing (the default).
    - ``ALL``: whole rows, embedding values and optimizer state: one contiguous copy of the
      device tier's flat table, its whole storage freed.
    - ``VALUES``: the embedding columns only; the optimizer state is parked in a compact
      device buffer while the rows are away (frees ``rows x embedding bytes``).
    - ``OPTIMIZER_STATE``: the optimizer state only (frees ``rows x state bytes``); the
      optimizer must keep some (not SGD).

    The hash table (keys, scores, pins) never moves: the next batch's prefetch and eviction
    read and write it while the rows are away (see docs/ems.md).
    """

    NONE = "none"
    ALL = "all"
    VALUES = "values"
    OPTIMIZER_STATE = "optimizer_state"


class ShardingScheme(enum.Enum):
    """Which rank owns a key when a table is sharded row-wise (ids are unbounded, so there are
    no row blocks to split).

    - ``MOD``: rank ``key mod world``. Predictable; balanced when ids are dense or random, but
      ids sharing a stride with the world size (all even ids on 2 ranks) pile onto one rank.
    - ``HASH``: rank from a 64-bit mix of the key (independent of the hash the table uses for
      its buckets). Balanced for any id pattern; the default.
    """

    MOD = "mod"
    HASH = "hash"


#: Score policies whose scores hold a step, as expiry by age needs (dynemb.tables.expiry).
TIMED_POLICIES = (ScorePolicy.LRU, ScorePolicy.LFU_LRU, ScorePolicy.STEP)


@dataclass(frozen=True)
class FrequencyAdmission:
    """Admit a key into the table only once it has been seen ``threshold`` times.

    Occurrences of keys not yet admitted are counted in a separate LFU-scored hash table of
    ``counter_capacity`` slots (the least-seen counts are forgotten when it fills up). Until a
    key is admitted, nothing is stored, its gradients are dropped and training lookups return
    the row ``initializer`` draws for it: an :class:`~dynemb.rows.initializers.Initializer` (e.g.
    ``Initializer(InitializerKind.CONSTANT, value=0.0)`` for zeros), or None (the default)
    for the table's own initializer row, the row the key starts from once admitted. The
    initializer is configuration, not state: checkpoints do not hold it.

    Example::

        >>> DynamicEmbTableOptions(admission=FrequencyAdmission(threshold=3)).admission
        FrequencyAdmission(threshold=3, counter_capacity=65536, initializer=None)
        >>> zeros = Initializer(InitializerKind.CONSTANT, value=0.0)
        >>> FrequencyAdmission(threshold=3, initializer=zeros).initializer.value
        0.0
    """

    threshold: int = 2
    counter_capacity: int = 1 << 16
    initializer: Optional[Initializer] = None

    def __post_init__(self):
        check_int(self.threshold, "admission.threshold")
        check_int(self.counter_capacity, "admission.counter_capacity")
        if self.initializer is not None and not isinstance(self.initializer, Initializer):
            raise TypeError(f"admission.initializer must be an Initializer or None (the "
                            f"table's initializer), got {self.initializer!r}")


#: Builds a table's backing store: ``factory(width, dtype, device)`` where ``width`` is the
#: physical row width, :attr:`dynemb.rows.flat_table.RowLayout.width` (the embedding dim plus the
#: optimizer state dim for float32 tables; see :mod:`dynemb.stores.backing_store`).
BackingStoreFactory = Callable[[int, torch.dtype, torch.device], "object"]


@dataclass(frozen=True)
class DynamicEmbTableOptions:
    """How one dynamic table stores, grows, evicts and initializes its rows.

    Capacities count rows. Memory budgets count bytes of values plus optimizer state
    (``capacity * row_bytes``, :attr:`dynemb.rows.flat_table.RowLayout.row_bytes`: for float32
    ``(dim + optimizer_state_dim) * 4``; for float16 / bfloat16, whose optimizer state is
    float32, ``dim * 2 + optimizer_state_dim * 4``, dim rounded up to even when there is state).

    Args:
        caching: when the table does not fit the device budget, use the device as a cache of a
            backing store (CACHE) instead of splitting rows between tiers by hash (DEFAULT).
        global_hbm_for_values: device budget of the table over all ranks (split evenly);
            None with ``local_hbm_for_values`` None: unlimited (HBM_DIRECT); 0: no device
            rows at all (HOST_ONLY, :class:`StorageMode`).
        local_hbm_for_values: device budget on each rank; overrides the global one.
        init_capacity: rows allocated at the start (default: ``max_capacity``).
        max_capacity: most rows (hash slots) the table allocates; when a key's bucket is
            full the score policy evicts. Default: room for the config's ``num_embeddings``
            distinct ids without evicting, ``slots_for_keys(num_embeddings, bucket_size)``
            (:func:`dynemb.rows.hash_table_checks.slots_for_keys`: about 1.7-2.1x
            ``num_embeddings`` with buckets of 128), since keys fill buckets unevenly.
        max_load_factor: grow (doubling, up to ``max_capacity``) once the table would be
            fuller than this.
        bucket_size: hash-table bucket size, a power of two <= ``MAX_BUCKET_SIZE`` (128).
        score_strategy: eviction order, a :class:`ScorePolicy` (LRU is the timestamp policy).
            With ``CUSTOMIZED`` the module's ``set_scores({table: score})`` gives the score
            that training batches write for their keys (required before the first one).
        initializer: start value of new rows in training; None (the default): the table's
            ``EmbeddingConfig`` decides, as in TorchRec (``weight_init_min`` /
            ``weight_init_max``, default ``-+sqrt(1 / num_embeddings)``, or a supported
            ``init_fn``: :func:`resolve_initializer`).
        eval_initializer: value returned for unseen keys in eval mode (nothing is stored).
        admission: a :class:`FrequencyAdmission`, or None to admit every key.
        embedding_dtype: dtype of the stored rows (default: the config's ``data_type``).
        backing_store: factory of the CACHE mode's store (default: host memory,
            :class:`dynemb.stores.backing_store.HostBackingStore`).
        seed: seed of the initializers (with the table's name, it fixes every initial row).
        sharding: how a sharded table picks each key's rank (:class:`ShardingScheme`).
        stochastic_rounding: float16 / bfloat16 tables round each updated embedding value up
            or down at random with the probabilities that make the rounding unbiased (as
            fbgemm does), so updates smaller than the dtype's spacing still move the rows on
            average. The random bits depend only on (seed, table, key, step, column): every
            storage mode and rank count gives the same rows. False: round to nearest.
            float32 tables ignore it.
        stash: what of the device rows to move to host memory between each training
            forward and its backward (a :class:`StashMode`; see :mod:`dynemb.stashing`).
            ``NONE`` unless set, or ``ALL`` when the table's ``EmbeddingConfig`` has
            TorchRec's ``stash_weights=True``.
        ttl_steps: erase the rows not looked up in this many of the table's steps (training
            batches), on every tier (:mod:`dynemb.tables.expiry`; the ``LRU``, ``LFU_LRU``
            and ``STEP`` policies: ``STEP`` counts from insertion). None: rows never expire.
        expire_every: steps between two sweeps of ``ttl_steps`` (a sweep reads every row's
            score); default: a tenth of ``ttl_steps``, at least 1.

    Example::

        >>> options = DynamicEmbTableOptions(caching=True, global_hbm_for_values=64 << 20,
        ...                                  score_strategy=ScorePolicy.LFU)
        >>> options.caching, options.global_hbm_for_values, options.score_strategy
        (True, 67108864, <ScorePolicy.LFU: 'lfu'>)
    """

    caching: bool = False
    global_hbm_for_values: Optional[int] = None
    local_hbm_for_values: Optional[int] = None
    init_capacity: Optional[int] = None
    max_capacity: Optional[int] = None
    max_load_factor: float = 0.75
    bucket_size: int = MAX_BUCKET_SIZE
    score_strategy: ScorePolicy = ScorePolicy.LRU
    initializer: Optional[Initializer] = None
    eval_initializer: Initializer = field(
        default_factory=lambda: Initializer(InitializerKind.CONSTANT, value=0.0))
    admission: Optional[FrequencyAdmission] = None
    embedding_dtype: Optional[torch.dtype] = None
    backing_store: Optional[BackingStoreFactory] = None
    seed: int = 0
    sharding: ShardingScheme = ShardingScheme.HASH
    stochastic_rounding: bool = True
    stash: StashMode = StashMode.NONE
    ttl_steps: Optional[int] = None
    expire_every: Optional[int] = None

    @property
    def sweep_steps(self) -> int:
        """Steps between two ``ttl_steps`` sweeps (``expire_every`` or its default)."""
        if self.expire_every is not None:
            return self.expire_every
        return max(1, (self.ttl_steps or 0) // 10)

    def __post_init__(self):
        for name in ("caching", "stochastic_rounding"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("global_hbm_for_values", "local_hbm_for_values"):  # 0: HOST_ONLY
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name, minimum=0)
        for name in ("init_capacity", "max_capacity"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name)
        f = self.max_load_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f <= 1.0:
            raise ValueError(f"max_load_factor must be in (0, 1], got {f!r}")
        check_bucket_size(self.bucket_size)
        if not isinstance(self.score_strategy, ScorePolicy):
            raise TypeError(f"score_strategy must be a ScorePolicy, got {self.score_strategy!r}")
        if self.initializer is not None and not isinstance(self.initializer, Initializer):
            raise TypeError(f"initializer must be an Initializer or None (from the config), "
                            f"got {self.initializer!r}")
        if not isinstance(self.eval_initializer, Initializer):
            raise TypeError(f"eval_initializer must be an Initializer, got "
                            f"{self.eval_initializer!r}")
        if self.admission is not None and not isinstance(self.admission, FrequencyAdmission):
            raise TypeError(f"admission must be a FrequencyAdmission or None, got "
                            f"{self.admission!r}")
        if self.embedding_dtype is not None and self.embedding_dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"embedding_dtype must be one of {SUPPORTED_DTYPES}, got "
                             f"{self.embedding_dtype}")
        if self.backing_store is not None and not callable(self.backing_store):
            raise TypeError("backing_store must be a factory (width, dtype, device) -> store")
        check_int(self.seed, "seed", minimum=0)
        if not isinstance(self.sharding, ShardingScheme):
            raise TypeError(f"sharding must be a ShardingScheme, got {self.sharding!r}")
        if not isinstance(self.stash, StashMode):
            names = ", ".join(m.name for m in StashMode)
            raise TypeError(f"stash must be a StashMode ({names}), got {self.stash!r}")
        for name in ("ttl_steps", "expire_every"):  # 0 steps would erase every row
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name, minimum=1)
        if self.expire_every is not None and self.ttl_steps is None:
            raise ValueError("expire_every sets how often ttl_steps sweeps: set ttl_steps too")
        if self.ttl_steps is not None and self.score_strategy not in TIMED_POLICIES:
            timed = ", ".join(p.name for p in TIMED_POLICIES)
            raise ValueError(f"ttl_steps needs a score_strategy whose scores hold a step "
                             f"({timed}), got {self.score_strategy.name}; expire such tables "
                             f"with a predicate over their scores (module.expire(where=...))")
        if (self.init_capacity is not None and self.max_capacity is not None
                and self.init_capacity > self.max_capacity):
            raise ValueError(f"init_capacity ({self.init_capacity}) exceeds max_capacity "
                             f"({self.max_capacity})")


@dataclass(frozen=True)
class TableLayout:
    """What the options resolve to for one table on one rank (all counts in rows)."""

    mode: StorageMode
    dtype: torch.dtype
    bucket_size: int
    init_capacity: int          # device rows at the start (HBM_DIRECT) or fixed (CACHE/DEFAULT);
                                # HOST_ONLY: its host rows, max_capacity
    max_capacity: int           # most rows the table holds, all tiers together
    device_capacity: int        # most rows on the device
    row_bytes: int
    target_rows: int            # distinct ids it is sized for: num_embeddings or max_capacity

    @property
    def host_tier_rows(self) -> int:
        """Rows of the DEFAULT mode's host tier: what the device cannot hold of
        ``max_capacity``, in whole buckets (at least one); 0 in the other modes."""
        if self.mode is not StorageMode.DEFAULT:
            return 0
        return _round_up(self.max_capacity - self.device_capacity, self.bucket_size)


def choose_storage_mode(options: DynamicEmbTableOptions, *, name: str, num_embeddings: int,
                        width: int, config_dtype: torch.dtype, world_size: int = 1,
                        state_dim: int = 0) -> TableLayout:
    """Resolve a table's options into a :class:`TableLayout`; errors name the field at fault.

    ``width`` is the embedding dim plus the optimizer state dim, ``state_dim`` the latter
    (float32 whatever the dtype: ``row_bytes`` is :attr:`RowLayout.row_bytes`).
    ``max_capacity`` defaults to the slots that hold ``num_embeddings`` distinct ids without
    evicting (:func:`~dynemb.rows.hash_table_checks.slots_for_keys`). The table goes to HBM_DIRECT
    when ``max_capacity`` rows fit the per-rank budget; otherwise to CACHE (``caching``) or
    DEFAULT with as many device rows as the budget holds, rounded down to whole buckets; a
    budget of 0 bytes gives HOST_ONLY (all ``max_capacity`` rows in host memory, allocated up
    front, none on the device).

    Example::

        >>> choose_storage_mode(DynamicEmbTableOptions(), name="t", num_embeddings=1000,
        ...                     width=64 + 128, state_dim=128,
        ...                     config_dtype=torch.float16).row_bytes  # Adam, fp16, dim 64
        640
    """
    dtype = options.embedding_dtype or config_dtype
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"table {name!r}: data_type {dtype} is not supported; use one of "
                         f"{SUPPORTED_DTYPES} (or set embedding_dtype)")
    check_int(num_embeddings, f"table {name!r}: num_embeddings")
    bucket = options.bucket_size
    target_rows = options.max_capacity or num_embeddings
    max_capacity = (_round_up(options.max_capacity, bucket) if options.max_capacity
                    else slots_for_keys(num_embeddings, bucket))
    init_capacity = _round_up(options.init_capacity or max_capacity, bucket)
    _check_max_capacity(options, name, max_capacity, bucket, num_embeddings)
    if not 0 <= state_dim < width:
        raise ValueError(f"table {name!r}: state_dim must be in [0, width={width}), got "
                         f"{state_dim}")
    row_bytes = RowLayout(width - state_dim, state_dim, dtype).row_bytes
    budget = options.local_hbm_for_values
    if budget is None and options.global_hbm_for_values is not None:
        budget = options.global_hbm_for_values // world_size
    if budget is None or max_capacity * row_bytes <= budget:
        return TableLayout(StorageMode.HBM_DIRECT, dtype, bucket, init_capacity, max_capacity,
                           max_capacity, row_bytes, target_rows)
    device_rows = budget // row_bytes // bucket * bucket
    field_name = ("local_hbm_for_values" if options.local_hbm_for_values is not None
                  else "global_hbm_for_values")
    if budget == 0:
        return _host_only_layout(options, name, dtype, bucket, max_capacity, row_bytes,
                                 target_rows)
    if device_rows < bucket:
        raise ValueError(
            f"table {name!r}: {field_name} gives {budget} bytes per rank, below one bucket "
            f"({bucket} rows x {row_bytes} bytes = {bucket * row_bytes} bytes); a budget of "
            f"0 keeps every row in host memory (HOST_ONLY)")
    mode = StorageMode.CACHE if options.caching else StorageMode.DEFAULT
    if mode is StorageMode.CACHE and options.score_strategy is ScorePolicy.NO_EVICTION:
        raise ValueError(
            f"table {name!r}: caching=True needs an evicting score_strategy, got "
            f"score_strategy=NO_EVICTION: the table ({max_capacity} rows x {row_bytes} bytes) "
            f"does not fit {field_name} ({budget} bytes per rank), so the device caches "
            f"{device_rows} rows and must evict some to load others. Use LRU, LFU or STEP, "
            f"raise {field_name} so the whole table fits, or caching=False (rows split "
            f"between device and host memory, nothing evicted)")
    return TableLayout(mode, dtype, bucket, device_rows, max_capacity, device_rows, row_bytes,
                       target_rows)


def _host_only_layout(options: DynamicEmbTableOptions, name: str, dtype: torch.dtype,
                      bucket: int, max_capacity: int, row_bytes: int,
                      target_rows: int) -> TableLayout:
    """HOST_ONLY: ``max_capacity`` host rows from the start, no device rows."""
    if options.stash is not StashMode.NONE:
        raise ValueError(f"table {name!r}: stash={options.stash.name} moves device rows to the "
                         f"host, and a device budget of 0 (HOST_ONLY) leaves the table none; "
                         f"use stash=NONE or a device budget")
    return TableLayout(StorageMode.HOST_ONLY, dtype, bucket, max_capacity, max_capacity, 0,
                       row_bytes, target_rows)


def resolve_initializer(options: DynamicEmbTableOptions, config) -> DynamicEmbTableOptions:
    """``options`` with its ``initializer`` settled for ``config``'s table: an explicit one
    stays; None takes the config's, as TorchRec would start the table
    (:func:`dynemb.rows.initializers.initializer_from_config`; an ``init_fn`` that cannot be drawn
    per id raises ``ValueError``). Call it with the global (unsharded) config: TorchRec's
    default range depends on ``num_embeddings``.

    Example::

        >>> config = EmbeddingConfig(name="t", embedding_dim=8, num_embeddings=100,
        ...                          weight_init_min=-1.0, weight_init_max=1.0)
        >>> resolve_initializer(DynamicEmbTableOptions(), config).initializer.high
        1.0
        >>> explicit = DynamicEmbTableOptions(initializer=Initializer(value=0.5,
        ...                                   kind=InitializerKind.CONSTANT))
        >>> resolve_initializer(explicit, config) is explicit
        True
    """
    if options.initializer is not None:
        return options
    return dataclasses.replace(options, initializer=initializer_from_config(config))


def _check_max_capacity(options, name: str, max_capacity: int, bucket: int,
                        num_embeddings: int) -> None:
    limit = max_table_capacity(bucket)
    if max_capacity <= limit:
        return
    source = (f" (room for num_embeddings={num_embeddings} ids in buckets of {bucket}, as "
              f"max_capacity is not set)" if options.max_capacity is None else "")
    # larger buckets hold more slots, and need less headroom for the same ids
    with_largest = (max_capacity if options.max_capacity is not None
                    else slots_for_keys(num_embeddings, MAX_BUCKET_SIZE))
    buckets = (f", or a larger bucket_size (up to {MAX_BUCKET_SIZE})"
               if bucket < MAX_BUCKET_SIZE and with_largest <= max_table_capacity(MAX_BUCKET_SIZE)
               else "")
    raise ValueError(
        f"table {name!r}: max_capacity {max_capacity} rows{source} is beyond the {limit} rows "
        f"one hash table can hold with bucket_size {bucket}. num_embeddings and max_capacity "
        f"count the rows the table keeps (beyond them the score policy evicts), not the id "
        f"range: any int64 id works. Set a smaller max_capacity or num_embeddings{buckets}; "
        f"to allocate less up front, set init_capacity (the table starts there and grows up "
        f"to max_capacity) or a memory budget (local_hbm_for_values / global_hbm_for_values)")


def _round_up(n: int, multiple: int) -> int:
    return max(multiple, math.ceil(n / multiple) * multiple)
