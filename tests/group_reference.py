"""The model of a module's tables (tests/group_model.py) stepped beside the module, and what
is compared: the reference that the group tests check a table group against, in place of (or
beside) the same tables run one by one.

:class:`GroupReference` builds one :class:`~group_model.ModelEmbeddingTable` per table of a
``DynamicEmbCollection`` from its configuration (mode, capacities, bucket size, policy,
optimizer, initializer; or takes a model built by the test), follows each training step of
the module (:meth:`GroupReference.step`: the module's forward and backward ran, the model's
claim, forward and backward follow, the outputs compared; :meth:`GroupReference.prefetch`
for batches prefetched ahead) and compares the tables with the
model (:meth:`GroupReference.check`). It reads the tables through what they show: their
hash tables' exports, clocks and pin counts, ``stats``, ``read_rows``, a CACHE table's
``store.find`` and the module's ``steps``.

:meth:`GroupReference.lookup` follows an eval (or ``no_grad``) lookup; the outputs of a
pooled module (``DynamicEmbBagCollection``: SUM or MEAN bags, weighted or not) are pooled
from the model's rows. Not modelled (a test that needs them keeps its other checks):
admission, late backwards, float16 / bfloat16 rows.
"""
from __future__ import annotations

import collections
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from dynemb.options import StorageMode
from group_model import COUNTED, ModelEmbeddingTable, ModelGroup, ModelOptimizer
from key_reference import initial_rows

#: ``grad_of(output, rows)``: the gradient [n, dim] of an output's rows (the model's), or None
#: where the output does not reach the loss; outputs are named as the module names them
GradOf = Callable[[str, np.ndarray], Optional[np.ndarray]]


def model_of(module) -> ModelGroup:
    """The model of ``module``'s tables, read from their configuration (an HBM_DIRECT table
    whose ``init_capacity`` is below its ``max_capacity`` grows at ``max_load_factor``)."""
    config = module.optimizer_config
    assert config.initial_accumulator_value == 0
    optimizer = ModelOptimizer(config.type.value, eps=config.eps, beta1=config.beta1,
                               beta2=config.beta2, weight_decay=config.weight_decay,
                               max_gradient=config.max_gradient)
    tables = {}
    for name, table in module.tables.items():
        layout, options = table.layout, table.options
        assert table.admission is None, "admission is not modelled"
        grows = table.mode is StorageMode.HBM_DIRECT and layout.init_capacity < \
            layout.max_capacity
        tables[name] = ModelEmbeddingTable(
            table.mode.value, capacity=layout.max_capacity, device_rows=layout.device_capacity,
            init_capacity=layout.init_capacity if grows else None,
            grow_at=options.max_load_factor if grows else None,
            bucket_size=layout.bucket_size, policy=options.score_strategy.value, dim=table.dim,
            optimizer=optimizer, initial_row=initial_row_of(table),
            eval_row=initial_row_of(table, options.eval_initializer))
    return ModelGroup(tables)


def initial_row_of(table, init=None) -> Callable[[int], List[float]]:
    """The row ``table``'s initializer (or ``init``) gives a key, by the documented rules
    (the table's seed and id are configuration)."""
    init, dim = table.options.initializer if init is None else init, table.dim
    seed, table_id = table.options.seed, table.table_id
    return lambda key: initial_rows(init, [key], dim, seed=seed, table_id=table_id)[0]


def held_by(table) -> Dict[str, Dict[int, int]]:
    """{tier: {key: score}} of a table, as its hash tables export them."""
    out = {}
    for tier, hash_table in tiers_of(table).items():
        exported = hash_table.export()
        out[tier] = dict(zip(exported.keys.tolist(), exported.scores.tolist()))
    return out


def tiers_of(table):
    tiers = {"device": table.tier.hash}
    if table.mode is StorageMode.DEFAULT:
        tiers["host"] = table.host_tier.hash
    return tiers


def _in_output_order(parts: Dict[str, List[np.ndarray]], outputs) -> List[np.ndarray]:
    """The parts of each table, listed output after output (``outputs``' order)."""
    taken = {name: iter(p) for name, p in parts.items()}
    return [next(taken[name]) for _, _, name in outputs]


def stacked(rows, width: int) -> np.ndarray:
    return np.stack(rows) if rows else np.zeros((0, width), dtype=np.float32)


class GroupReference:
    """``module``'s tables as the model sees them (see the module docstring); ``model``: one
    the test built itself (default: :func:`model_of`). ``exact``: rows and outputs compare
    bit for bit (gradients whose sums are exact in any order), else to float32 rounding."""

    def __init__(self, module, model: Optional[ModelGroup] = None, exact: bool = False):
        self.module = module
        self.model = model if model is not None else model_of(module)
        self.exact = exact
        configs = module.table_configs()
        #: a pooled module's tables: their pooling, "SUM" or "MEAN" (none: a sequence module)
        self.pooling = {c.name: c.pooling.value for c in configs if hasattr(c, "pooling")}
        names = (module.embedding_names_by_table() if not self.pooling else
                 [c.feature_names for c in configs])
        #: (output name, feature, table) of every output, in the tables' order: a feature
        #: that several tables read has an output per table, "feature@table" (TorchRec's)
        self.outputs = [(name, f, config.name) for config, names in zip(configs, names)
                        for f, name in zip(config.feature_names, names)]
        self.seen: Dict[str, set] = {name: set() for name in self.model.tables}
        self._queue: collections.deque = collections.deque()  # prefetched batches

    def _batch(self, kjt):
        """({feature: its ids}, {table: the ids of its features, output after output}) of
        ``kjt``."""
        features = {f: kjt[f].values().tolist() for _, f, _ in self.outputs}
        batch: Dict[str, List[int]] = {name: [] for name in self.model.tables}
        for _, f, name in self.outputs:
            batch[name] += features[f]
        for name, keys in batch.items():
            self.seen[name].update(keys)
        return features, batch

    def _claims_in_forward(self, name: str) -> bool:
        return self.model.tables[name].mode == "default"

    def _settle(self, claims) -> None:
        held = {name: {tier: set(keys) for tier, keys in held_by(self.module.tables[name])
                       .items()} for name in claims}
        self.model.settle(claims, held)

    def prefetch(self, kjt, scores: Optional[Dict[str, int]] = None) -> None:
        """The module prefetched ``kjt`` for training ahead of its forward (``scores``: the
        CUSTOMIZED scores then): the tables claim now, but DEFAULT tables, which count the
        lookups now and claim in the forward. Call it after the module's step that followed
        the prefetch (no claim of these tables since)."""
        features, batch = self._batch(kjt)
        now = {n: keys for n, keys in batch.items() if not self._claims_in_forward(n)}
        for name, keys in batch.items():
            if name not in now:
                self.model.tables[name].count_lookups(keys)
        self._settle(self.model.claim(now, scores))
        self._queue.append((features, batch, scores))

    def clear_prefetched(self) -> None:
        """The module's ``clear_prefetched``: queued batches end their pins, and so do the
        last forward's tables whose backward did not come."""
        for _, batch, _ in self._queue:
            self.model.release({n: k for n, k in batch.items()
                                if not self._claims_in_forward(n)})
        self._queue.clear()
        self.model.end_awaiting()

    def step(self, kjt, out, grad_of: GradOf, scores: Optional[Dict[str, int]] = None,
             lr: Optional[float] = None) -> None:
        """The model's training step on ``kjt`` after the module's (its forward gave ``out``,
        by feature a ``JaggedTensor`` or its values, and its backward ran): the claim (of
        the batch :meth:`prefetch` queued, if any), the forward, whose rows must equal
        ``out``, and the backward with the gradients ``grad_of`` gives (at ``lr``, default
        the optimizer's learning rate). ``scores``: the CUSTOMIZED scores of the step (of
        its prefetch, for a queued batch)."""
        model = self.model
        if self._queue:
            features, batch, scores = self._queue.popleft()
            assert features == {f: kjt[f].values().tolist() for f in features}
            late = {n: keys for n, keys in batch.items() if self._claims_in_forward(n)}
            self._settle(model.claim(late, scores, count_lookups=False))
        else:
            features, batch = self._batch(kjt)
            self._settle(model.claim(batch, scores))
        bags = self._bags(kjt)
        parts = self._compare_outputs(features, model.forward(batch), out, bags)
        grads: Dict[str, List[np.ndarray]] = {name: [] for name in batch}
        scales: Dict[str, List[np.ndarray]] = {name: [] for name in batch}
        taking = set()
        for (output, f, name), mine in zip(self.outputs, _in_output_order(parts, self.outputs)):
            if name in self.pooling:  # the gradient of each bag, passed to each of its ids
                g = grad_of(output, self._pool(name, mine, *bags[f]))
                g, scale = (None, None) if g is None else self._id_grads(name, g, *bags[f])
                scales[name].append(np.ones(len(mine), np.float32) if g is None else scale)
            else:
                g = grad_of(output, mine)
            if g is not None:
                taking.add(name)
            grads[name].append(np.zeros_like(mine) if g is None else
                               np.asarray(g, dtype=np.float32))
        lr = self.module.optimizer_config.learning_rate if lr is None else lr
        model.backward(batch, {name: np.concatenate(grads[name]) for name in taking}, lr,
                       {name: np.concatenate(scales[name]) for name in taking
                        if name in self.pooling})

    # -- pooled modules -------------------------------------------------------------------------
    def _bags(self, kjt) -> Dict[str, tuple]:
        """{feature: (its bags' lengths, its ids' weights or None)} of a pooled module's
        ``kjt`` (empty for a sequence module)."""
        if not self.pooling:
            return {}
        out = {}
        for _, f, _ in self.outputs:
            jt = kjt[f]
            weights = jt.weights_or_none()
            out[f] = (jt.lengths().tolist(),
                      None if weights is None else weights.cpu().numpy().astype(np.float32))
        return out

    def _pool(self, table: str, rows: np.ndarray, lengths, weights) -> np.ndarray:
        """[bags, dim]: each bag's rows, weighted, summed (MEAN: over its length)."""
        out = np.zeros((len(lengths), rows.shape[1]), dtype=np.float32)
        at = 0
        for b, n in enumerate(lengths):
            for i in range(at, at + n):
                out[b] += rows[i] if weights is None else rows[i] * weights[i]
            if self.pooling[table] == "MEAN" and n:
                out[b] /= np.float32(n)
            at += n
        return out

    def _id_grads(self, table: str, bag_grads: np.ndarray, lengths, weights):
        """(each id's gradient before clipping, its scale): its bag's gradient (a MEAN bag's
        over its length, first, where gradients are clipped) and its weight (a MEAN bag's
        1 / length where they are not), as ``OptimizerConfig.max_gradient`` documents."""
        mean = self.pooling[table] == "MEAN"
        clipped = self.module.optimizer_config.max_gradient is not None
        grads, scales = [], []
        for b, n in enumerate(lengths):
            divisor = np.float32(max(n, 1))
            for _ in range(n):
                grads.append(bag_grads[b] / divisor if mean and clipped else bag_grads[b])
                scales.append(np.float32(1) / divisor if mean and not clipped else
                              np.float32(1))
        scales = np.asarray(scales, dtype=np.float32)
        if weights is not None:
            scales = weights * scales
        return stacked(grads, bag_grads.shape[1]), scales

    def flush(self) -> Dict[str, int]:
        """The module's ``flush``: each CACHE table's cached rows written to its store;
        returns how many per table, as the module does."""
        return {name: t.flush() for name, t in self.model.tables.items() if t.mode == "cache"}

    def eval(self) -> None:
        """The module left training (``module.eval()``): the pins of the last forward's
        tables whose backward did not come end."""
        self.model.end_awaiting()

    def lookup(self, kjt, out) -> None:
        """The model's eval (or ``no_grad``) lookup of ``kjt`` after the module's, whose
        outputs ``out`` must equal its rows."""
        features, batch = self._batch(kjt)
        rows = {name: self.model.tables[name].lookup(keys) for name, keys in batch.items()}
        self._compare_outputs(features, rows, out, self._bags(kjt))

    def _compare_outputs(self, features, rows, out, bags) -> Dict[str, List[np.ndarray]]:
        """Compare each output of ``out`` with its part of its table's ``rows`` (pooled as
        ``bags`` say, in a pooled module); returns those parts, by table, in output order."""
        parts: Dict[str, List[np.ndarray]] = {name: [] for name in rows}
        at = {name: 0 for name in rows}
        dense = out.to_dict() if self.pooling else out
        for output, f, name in self.outputs:
            n = len(features[f])
            mine = rows[name][at[name]:at[name] + n]
            at[name] += n
            got = dense[output] if isinstance(dense[output], torch.Tensor) else \
                dense[output].values()
            expected = self._pool(name, mine, *bags[f]) if name in self.pooling else mine
            self.compare(got.detach().cpu().numpy(), expected, f"output {output}")
            parts[name].append(mine)
        return parts

    def compare(self, got: np.ndarray, expected: np.ndarray, what: str) -> None:
        if self.exact:
            assert np.array_equal(got, expected), what
        else:
            np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-6, err_msg=what)

    def check(self, probe: Optional[List[int]] = None) -> None:
        """Every table against the model: each tier's keys and scores, clock and pinned keys;
        the counters and sizes ``stats`` reports; the rows (optimizer state included) of the
        keys ``probe`` (default: every key the steps looked up), a CACHE table's store; the
        module's step of each table."""
        module = self.module
        stats = module.stats()
        for name, ref in self.model.tables.items():
            table = module.tables[name]
            held, hash_tables = held_by(table), tiers_of(table)
            for tier, t in ref.tiers.items():
                assert hash_tables[tier].capacity == t.capacity, (name, tier)
                assert held[tier] == t.scores(), (name, tier)
                assert hash_tables[tier].clock == t.clock, (name, tier)
                pinned = sum(e.pins > 0 for e in t.entries.values())
                assert hash_tables[tier].pinned_count() == pinned, (name, tier)
            assert {k: stats[name][k] for k in COUNTED} == ref.counters, name
            for k, v in ref.sizes().items():
                assert stats[name][k] == v, (name, k)
            keys = sorted(self.seen[name]) if probe is None else list(probe)
            tensor = torch.tensor(keys, dtype=torch.int64, device=module.device)
            rows, found = module.read_rows(name, tensor, with_state=True)
            current = ref.current_rows()
            assert found.tolist() == [k in current for k in keys], name
            self.compare(rows[found].cpu().numpy(),
                         stacked([current[k] for k in keys if k in current], ref.width),
                         f"rows of {name}")
            if table.mode is StorageMode.CACHE:
                stored, in_store, scores = table.store.find(tensor)
                assert in_store.tolist() == [k in ref.store for k in keys], name
                self.compare(stored[in_store].cpu().numpy(),
                             stacked([ref.store[k][0] for k in keys if k in ref.store],
                                     ref.width), f"stored rows of {name}")
                assert scores[in_store].tolist() == [ref.store[k][1] for k in keys
                                                     if k in ref.store], name
            assert module.steps[name] == ref.steps, name
