"""Pure-Python model of a table group (``dynemb.tables.groups``): the reference of
tests/test_group_reference.py, sharing nothing with the group engine.

A group is modelled as what it promises to be: tables that each claim their own keys, at
their own clock, in their own buckets, exactly as alone. Each table is a
:class:`ModelEmbeddingTable`: the hash tables of its storage mode (:class:`ModelTable`, whose
claim states the score and eviction rules), its rows (embedding and optimizer state, float32)
and its counters:

- HBM_DIRECT and HOST_ONLY: one hash table of ``capacity`` slots (HBM_DIRECT: maybe growing
  to it);
- CACHE: a cache of ``device_rows`` slots over a store: an evicted key's row and score go to
  the store (written back), a key inserted into the cache takes its row and score from the
  store when the store has it (loaded; the score as ``ScoredHashTable.restore_scores``
  documents), else its initial row; the store keeps its copy (a cached row wins over it);
- DEFAULT: a device tier of ``device_rows`` slots and a host tier of the rest, each key in the
  tier its hash routes it to (:func:`key_reference.routes_to_first`); a tier evicts by score
  and the evicted row is dropped.

Every training claim ticks the clock of each table (each tier), whether or not its feature
has ids; the claim is made at the prefetch (inline, or ahead of the forward), a DEFAULT
table's in the forward. A batch's keys stay pinned from its claim until the backward of a
table whose output reaches the loss; a table whose output does not keeps them pinned until
the next training forward has claimed its own keys (:meth:`ModelGroup.forward`); a batch
prefetched and dropped ends its pins (:meth:`ModelGroup.release`).

Rows start from :func:`key_reference.initial_rows` (computed here from the documented
rules, not read from the table), and are updated by SGD, AdaGrad, Adam or row-wise AdaGrad
from each unique key's summed gradient, in float32 (:class:`ModelOptimizer`).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from key_reference import routes_to_first
from reference_model import Claim, ModelTable

#: the counters the model keeps (``DynamicTable.stats`` names)
COUNTED = ("lookups", "unique_keys", "hits", "misses", "inserts", "evictions", "write_backs",
           "loads")
MODES = ("hbm_direct", "cache", "host_only", "default")


class ModelOptimizer:
    """The optimizers' documented rules (fbgemm's, ``kernels/optim_common.py`` states them), in
    float32 on a row ``[embedding | state]``: ``kind`` is an ``OptimizerType`` value; state
    starts at 0 (``initial_accumulator_value`` 0)."""

    def __init__(self, kind: str, eps: float = 1e-8, beta1: float = 0.9, beta2: float = 0.999,
                 weight_decay: float = 0.0, max_gradient: Optional[float] = None):
        assert kind in ("sgd", "adagrad", "adam", "rowwise_adagrad")
        self.kind = kind
        self.eps, self.beta1, self.beta2, self.weight_decay = (
            np.float32(x) for x in (eps, beta1, beta2, weight_decay))
        self._betas = (beta1, beta2)
        self.max_gradient = max_gradient

    def state_dim(self, dim: int) -> int:
        return {"sgd": 0, "adagrad": dim, "adam": 2 * dim, "rowwise_adagrad": 1}[self.kind]

    def apply(self, row: np.ndarray, g: np.ndarray, dim: int, lr: float, step: int) -> None:
        """One step of ``row`` (in place) with the summed gradient ``g``; ``step``: the
        table's steps so far, this one included (Adam's bias correction)."""
        lr, eps, wd, one = np.float32(lr), self.eps, self.weight_decay, np.float32(1)
        w = row[:dim]
        if self.kind == "sgd":
            row[:dim] = w - lr * g
        elif self.kind == "adagrad":
            acc = row[dim:] + g * g
            row[:dim] = w - lr * g / (np.sqrt(acc) + eps)
            row[dim:] = acc
        elif self.kind == "adam":
            b1, b2 = self.beta1, self.beta2
            bias1, bias2 = (np.float32(1.0 - b ** step) for b in self._betas)
            m = b1 * row[dim:2 * dim] + (one - b1) * g
            v = b2 * row[2 * dim:] + (one - b2) * g * g
            row[:dim] = w - lr * (m / bias1 / (np.sqrt(v / bias2) + eps) + wd * w)
            row[dim:2 * dim], row[2 * dim:] = m, v
        else:  # row-wise AdaGrad: L2 weight decay joins the squared gradient
            x = g + wd * w
            acc = row[dim] + np.float32((x * x).sum(dtype=np.float32) / np.float32(dim))
            multiplier = lr / (np.sqrt(acc) + eps)
            row[:dim] = (one - multiplier * wd) * w - multiplier * g
            row[dim] = acc


class ModelEmbeddingTable:
    """One table of a group (see the module docstring). ``initial_row(key)``: the row the
    table's initializer gives ``key`` [dim] (``eval_row(key)``: its eval initializer);
    ``optimizer``: a :class:`ModelOptimizer`, or the kind of one with its defaults. An
    HBM_DIRECT table may start at ``init_capacity`` and grow up to ``capacity`` at the load
    factor ``grow_at`` (:meth:`ModelTable.grow_for`)."""

    def __init__(self, mode: str, *, capacity: int, device_rows: int, bucket_size: int,
                 policy: str, dim: int, optimizer, initial_row: Callable[[int], Sequence[float]],
                 eval_row: Optional[Callable[[int], Sequence[float]]] = None,
                 init_capacity: Optional[int] = None, grow_at: Optional[float] = None):
        assert mode in MODES
        assert grow_at is None or mode == "hbm_direct"
        self._eval_row = eval_row
        self.mode = mode
        self.dim = dim
        self.optimizer = optimizer if isinstance(optimizer, ModelOptimizer) else \
            ModelOptimizer(optimizer)
        self.width = dim + self.optimizer.state_dim(dim)
        self._initial_row = initial_row
        b = bucket_size
        if mode == "default":
            host_rows = -(-(capacity - device_rows) // b) * b
            self.tiers = {"device": ModelTable(device_rows // b, b, policy),
                          "host": ModelTable(host_rows // b, b, policy)}
        elif mode == "cache":
            self.tiers = {"device": ModelTable(device_rows // b, b, policy)}
        else:
            start = capacity if init_capacity is None else init_capacity
            self.tiers = {"device": ModelTable(start // b, b, policy, grow_at=grow_at,
                                               max_capacity=capacity)}
        self.rows: Dict[int, np.ndarray] = {}  # every key the tiers hold
        self.store: Dict[int, tuple] = {}  # CACHE: key -> (row, score)
        self.counters = dict.fromkeys(COUNTED, 0)
        self.steps = 0

    # -- where keys live ----------------------------------------------------------------------
    def capacity_of(self, tier: str) -> int:
        t = self.tiers[tier]
        return t.num_buckets * t.bucket_size

    def tier_of(self, key: int) -> str:
        if self.mode != "default":
            return "device"
        first = self.capacity_of("device")
        return "device" if routes_to_first(key, first, first + self.capacity_of("host")) \
            else "host"

    def split(self, keys: Sequence[int]) -> Dict[str, List[int]]:
        """``keys`` by the tier each goes to, in order (every tier named, maybe empty)."""
        out: Dict[str, List[int]] = {tier: [] for tier in self.tiers}
        for k in keys:
            out[self.tier_of(k)].append(k)
        return out

    def refused(self, keys: Sequence[int]) -> set:
        """The new keys of ``keys`` in buckets that could not take them all (the keys a test
        leaves out of a batch so that it trains)."""
        out = set()
        for tier, part in self.split(keys).items():
            table = self.tiers[tier]
            for b in table.overflowing(part):
                out.update(table.missing_by_bucket(part)[b])
        return out

    # -- a training step ----------------------------------------------------------------------
    def count_lookups(self, keys: Sequence[int]) -> None:
        self.counters["lookups"] += len(keys)
        self.counters["unique_keys"] += len(set(keys))

    def claim(self, keys: Sequence[int], given: int = 0,
              count_lookups: bool = True) -> Dict[str, Claim]:
        """The claim of a training batch's ``keys`` in each tier (each tier's clock ticks),
        counted (its lookups too, with ``count_lookups``); :meth:`settle` finishes it."""
        claims = {tier: self.tiers[tier].claim(part, given)
                  for tier, part in self.split(keys).items()}
        if count_lookups:
            self.count_lookups(keys)
        hits = sum(len(c.hits) for c in claims.values())
        self.counters["hits"] += hits
        self.counters["misses"] += len(set(keys)) - hits
        return claims

    def settle(self, claims: Dict[str, Claim], held: Dict[str, set]) -> None:
        """Finish :meth:`claim` given the keys each tier holds after it (``held``, to adopt
        the table's choice among equal scores): evicted rows dropped (CACHE: written back),
        new rows loaded from the store (CACHE) or initialized; counted."""
        c = self.counters
        for tier, claim in claims.items():
            table = self.tiers[tier]
            table.settle(claim, held[tier])
            for k, score in claim.evicted.items():
                row = self.rows.pop(k)
                if self.mode == "cache":
                    self.store[k] = (row, score)
                    c["write_backs"] += 1
            c["evictions"] += len(claim.evicted)
            for k in claim.inserted:
                if self.mode == "cache" and k in self.store:
                    row, score = self.store[k]
                    self.rows[k] = row.copy()
                    entry = table.entries[k]
                    entry.score = table.restored_score(entry.score, score)
                    c["loads"] += 1
                else:
                    row = np.zeros(self.width, dtype=np.float32)
                    row[:self.dim] = np.asarray(self._initial_row(k), dtype=np.float64)
                    self.rows[k] = row
            c["inserts"] += len(claim.inserted)

    def lookup(self, keys: Sequence[int]) -> np.ndarray:
        """An eval (or ``no_grad``) lookup of ``keys``: their rows [len(keys), dim], a stored
        key's row (a CACHE table's missing from the cache: the store's, not loaded), else
        its eval initializer's; nothing claimed, rescored or pinned; the lookups, unique
        keys, hits (keys the tiers hold) and misses counted."""
        current = self.current_rows()
        unique = set(keys)
        hits = sum(k in self.rows for k in unique)
        c = self.counters
        c["lookups"] += len(keys)
        c["unique_keys"] += len(unique)
        c["hits"] += hits
        c["misses"] += len(unique) - hits
        rows = [current[k][:self.dim] if k in current else
                np.asarray(self._eval_row(k), dtype=np.float64).astype(np.float32)
                for k in keys]
        return np.stack(rows) if rows else np.zeros((0, self.dim), dtype=np.float32)

    def flush(self) -> int:
        """A CACHE table's ``flush``: every cached row and its score written to the store (and
        kept); returns how many."""
        assert self.mode == "cache"
        for k, e in self.tiers["device"].entries.items():
            self.store[k] = (self.rows[k].copy(), e.score)
        return len(self.tiers["device"].entries)

    def unpin(self, keys: Sequence[int]) -> None:
        for tier, part in self.split(set(keys)).items():
            self.tiers[tier].unpin(part)

    def update(self, keys: Sequence[int], grads: np.ndarray, lr: float,
               scales: Optional[np.ndarray] = None) -> None:
        """The fused update of the rows of ``keys`` from the gradient of each occurrence
        (``grads`` [len(keys), dim] float32), clamped (``max_gradient``), times its scale
        (``scales`` [len(keys)]: a pooled id's weight, or its MEAN bag's 1 / length) and
        summed per unique key."""
        opt = self.optimizer
        summed: Dict[int, np.ndarray] = {}
        for i, (k, g) in enumerate(zip(keys, np.asarray(grads, dtype=np.float32))):
            if opt.max_gradient is not None:
                g = np.clip(g, -np.float32(opt.max_gradient), np.float32(opt.max_gradient))
            if scales is not None:
                g = g * np.float32(scales[i])
            summed[k] = summed[k] + g if k in summed else g.copy()
        self.steps += 1
        for k, g in summed.items():
            opt.apply(self.rows[k], g, self.dim, lr, self.steps)

        # -- what can be compared -----------------------------------------------------------------
    def held(self) -> Dict[str, set]:
        return {tier: set(t.entries) for tier, t in self.tiers.items()}

    def current_rows(self) -> Dict[int, np.ndarray]:
        """The row each stored key reads: a cached row over the store's copy."""
        out = {k: row for k, (row, _) in self.store.items()}
        out.update(self.rows)
        return out

    def sizes(self) -> Dict[str, int]:
        """``rows_device`` and ``rows_backing`` as ``stats`` reports them."""
        size = len(self.tiers["device"].entries)
        return {"hbm_direct": dict(rows_device=size, rows_backing=0),
                "host_only": dict(rows_device=0, rows_backing=size),
                "cache": dict(rows_device=size, rows_backing=len(self.store)),
                "default": dict(rows_device=size,
                                rows_backing=len(self.tiers.get("host", self.tiers["device"])
                                                 .entries))}[self.mode]


class ModelGroup:
    """Tables that train as one group: each claims, evicts, scores and counts its own keys as
    alone; the group only says when pins end (see the module docstring). A training step is
    :meth:`claim` (at the prefetch; a DEFAULT table's at the forward), :meth:`settle`,
    :meth:`forward` and :meth:`backward`."""

    def __init__(self, tables: Dict[str, ModelEmbeddingTable]):
        self.tables = tables
        self._awaiting: Dict[str, List[int]] = {}  # pins waiting for a backward

    def refused(self, batch: Dict[str, List[int]]) -> Dict[str, set]:
        return {name: self.tables[name].refused(keys) for name, keys in batch.items()}

    def claim(self, batch: Dict[str, List[int]], given: Optional[Dict[str, int]] = None,
              count_lookups: bool = True) -> Dict[str, Dict[str, Claim]]:
        """The claim of the tables of ``batch`` (table -> its keys) each at its own next
        clock (``given``: CUSTOMIZED scores per table); ``count_lookups``: the lookups and
        unique keys are counted here (not where a prefetch counted them)."""
        given = given or {}
        return {name: self.tables[name].claim(keys, given.get(name, 0), count_lookups)
                for name, keys in batch.items()}

    def settle(self, claims: Dict[str, Dict[str, Claim]],
               held: Dict[str, Dict[str, set]]) -> None:
        """Finish ``claims`` (``held``: per table and tier, the keys held after them)."""
        for name, claim in claims.items():
            self.tables[name].settle(claim, held[name])

    def forward(self, batch: Dict[str, List[int]]) -> Dict[str, np.ndarray]:
        """A training forward of the claimed ``batch`` (every table named): the pins the
        previous forward left end (after this batch pinned its own keys); returns each
        table's rows of ``batch`` [len(keys), dim]."""
        self.end_awaiting()
        self._awaiting = {name: list(set(keys)) for name, keys in batch.items()}
        out = {}
        for name, keys in batch.items():
            t = self.tables[name]
            out[name] = np.stack([t.rows[k][:t.dim] for k in keys]) if keys else \
                np.zeros((0, t.dim), dtype=np.float32)
        return out

    def backward(self, batch: Dict[str, List[int]], grads: Dict[str, np.ndarray],
                 lr: float, scales: Optional[Dict[str, np.ndarray]] = None) -> None:
        """The backward of the tables in ``grads`` (each occurrence's gradient; ``scales``:
        its scale, see :meth:`ModelEmbeddingTable.update`): their rows updated, their pins
        ended; the other tables' pins wait for the next forward."""
        for name, g in grads.items():
            self.tables[name].update(batch[name], g, lr, (scales or {}).get(name))
            self.tables[name].unpin(self._awaiting.pop(name))

    def end_awaiting(self) -> None:
        """End the pins of the last forward's tables whose backward did not come."""
        for name, keys in self._awaiting.items():
            self.tables[name].unpin(keys)
        self._awaiting = {}

    def release(self, batch: Dict[str, List[int]]) -> None:
        """End the pins of a claimed batch that no forward took."""
        for name, keys in batch.items():
            self.tables[name].unpin(set(keys))
