"""What each rank runs in tests/test_checkpoint_reload_sharded.py, and the reading of saved and
loaded entries that tests/test_checkpoint_mode_change.py shares.

The model: one ``DynamicEmbCollection`` of two tables under ``DistributedModelParallel``
(row-wise, our sharder), Adam fused in the backward. With a per-rank device budget
(``local_hbm_for_values``, :data:`BUDGET_ROWS` rows) the tables fit on each of 2 ranks
(HBM_DIRECT) and not on 1 (CACHE).
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb.types import EMPTY_KEY, TOMBSTONE_KEY
from tests.checkpoint_models import sharded_row_wise, stored_scores

FEATURES = ["f0", "f1"]
TABLES = ["t0", "t1"]
NUM_IDS = 192
IDS = torch.arange(NUM_IDS) * 1009 - 77   # every id the batches draw
DIM = 4
GLOBAL_BATCH = 8
BUDGET_ROWS = 640  # per rank: above a 2-rank share's 464 slots, below the whole 1024


# -- entries of a saved image and of a loaded table ---------------------------------------------
def saved_entries(state: Mapping[str, torch.Tensor], prefix: str, table: str,
                  group: str = "rank0_of_1") -> Dict[int, Tuple[torch.Tensor, int]]:
    """``{key: (row with optimizer state, score)}`` of one saved image of ``table`` (under
    ``prefix``, saved by rank ``group``), read from the saved tensors: the host tier's
    entries (CACHE: its backing store, which may keep an older copy of a cached row), then
    the device tier's over them."""
    base = f"{prefix}dynamic_tables.{table}.{group}"
    out = {}
    for tier in ("host", "device"):
        if f"{base}.{tier}.keys" not in state:
            continue
        keys, scores, rows = (state[f"{base}.{tier}.{f}"] for f in ("keys", "scores", "rows"))
        for key, score, row in zip(keys.tolist(), scores.tolist(), rows):
            if key not in (EMPTY_KEY, TOMBSTONE_KEY):
                out[key] = (row.clone(), score)
    return out


def loaded_entries(collection, table: str, ids: torch.Tensor) -> Dict[int, Tuple[torch.Tensor,
                                                                                 int]]:
    """``{key: (row with optimizer state, score)}`` of what ``collection`` (this rank's
    ``DynamicEmbCollection``) holds of ``ids`` for ``table``: rows as a lookup reads them,
    scores where the mode keeps them (the cached one over the store's)."""
    rows, found = collection.read_rows(table, ids, with_state=True)
    scores = stored_scores(collection.tables[table], ids)
    return {int(k): (r, int(s)) for k, r, s, f in zip(ids, rows, scores, found) if f}


# -- the model --------------------------------------------------------------------------------
def configs() -> List[EmbeddingConfig]:
    return [EmbeddingConfig(name=t, embedding_dim=DIM, num_embeddings=NUM_IDS,
                            feature_names=[f]) for t, f in zip(TABLES, FEATURES)]


def dynamic_options(budget: bool):
    from dynemb import (DynamicEmbTableOptions, Initializer, InitializerKind, OptimizerConfig,
                        OptimizerType, ScorePolicy)
    opt = OptimizerConfig(OptimizerType.ADAM, learning_rate=0.05)
    width = DIM + opt.state_dim(DIM)
    options = DynamicEmbTableOptions(
        initializer=Initializer(InitializerKind.UNIFORM, low=-0.1, high=0.1), bucket_size=16,
        seed=5, caching=True, score_strategy=ScorePolicy.LFU,
        local_hbm_for_values=BUDGET_ROWS * width * 4 if budget else None)
    return opt, options


class Model(torch.nn.Module):
    def __init__(self, budget: bool):
        super().__init__()
        from dynemb import DynamicEmbCollection
        opt, options = dynamic_options(budget)
        self.dyn = DynamicEmbCollection(configs(), device="meta", table_options=options,
                                        optimizer=opt)

    def forward(self, kjt: KeyedJaggedTensor):
        out = self.dyn(kjt)
        return sum(((out[f].values() - 0.1 * (i + 1)) ** 2).sum()
                   for i, f in enumerate(FEATURES))


def shard(module: Model, world_size: int):
    torch.manual_seed(0)
    return sharded_row_wise(module, TABLES, world_size)


def trained(budget: bool, rank: int, world_size: int, steps: int, seed: int):
    dmp = shard(Model(budget), world_size)
    train_steps(dmp, rank, world_size, steps, seed)
    return dmp


def train_steps(dmp, rank: int, world_size: int, steps: int, seed: int) -> None:
    """``steps`` steps of global batches drawn from ``seed``, this rank's slice of each."""
    g = torch.Generator().manual_seed(seed)
    per = GLOBAL_BATCH // world_size
    for _ in range(steps):
        lengths = torch.randint(0, 4, (len(FEATURES), GLOBAL_BATCH), generator=g)
        values = [IDS[torch.randint(0, NUM_IDS, (int(ls.sum()),), generator=g)]
                  for ls in lengths]
        mine_l, mine_v = [], []
        for ls, vs in zip(lengths, values):
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), ls.cumsum(0)])
            mine_l.append(ls[rank * per:(rank + 1) * per])
            mine_v.append(vs[offsets[rank * per]:offsets[(rank + 1) * per]])
        dmp(KeyedJaggedTensor.from_lengths_sync(FEATURES, torch.cat(mine_v),
                                                torch.cat(mine_l))).backward()


def gathered_rows(dmp) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """Every id's row (with optimizer state) as its owner holds it, and how many ranks hold
    it, gathered to all ranks."""
    out = {}
    for name in TABLES:
        rows, found = dmp.module.dyn.read_rows(name, IDS, with_state=True)
        rows = rows * found[:, None]
        dist.all_reduce(rows)
        count = found.to(torch.int64)
        dist.all_reduce(count)
        out[name] = (rows, count)
    return out


def renamed(state: Mapping[str, Any], old: str, new: str) -> Dict[str, Any]:
    """``state`` with table ``old``'s entries under table ``new``'s name."""
    out = {}
    for key, value in state.items():
        for marker in (f"dynamic_tables.{old}.", f"embeddings.{old}."):
            key = key.replace(marker, marker.replace(f".{old}.", f".{new}."))
        out[key] = value
    return out


def tables_in(keys: List[str]) -> List[str]:
    """The tables ``keys`` belong to (``...dynamic_tables.<t>...``, ``...embeddings.<t>...``)."""
    names = set()
    for key in keys:
        parts = key.split(".")
        for marker in ("dynamic_tables", "embeddings"):
            if marker in parts:
                names.add(parts[parts.index(marker) + 1])
    return sorted(names)


def _load(dmp, state, strict: bool) -> Dict[str, Any]:
    try:
        result = dmp.load_state_dict(state, strict=strict)
    except RuntimeError as err:
        return {"error": str(err)}
    return {"missing": result.missing_keys, "unexpected": result.unexpected_keys}


# -- jobs -------------------------------------------------------------------------------------
def partial_load(rank: int, world_size: int) -> Dict[str, Any]:
    """A state dict whose t1 is saved as t9, loaded without and with ``strict`` into the
    sharded dynamic model, and (the reference) into TorchRec's ``EmbeddingCollection``."""
    source = trained(False, rank, world_size, steps=3, seed=1)
    saved = gathered_rows(source)
    state = renamed({k: v.clone() for k, v in source.state_dict().items()}, "t1", "t9")
    out: Dict[str, Any] = {"saved": saved}
    for strict in (False, True):
        target = trained(False, rank, world_size, steps=1, seed=2)
        before = gathered_rows(target)
        out[("dyn", strict)] = {**_load(target, state, strict), "before": before,
                                "after": gathered_rows(target)}
        # TorchRec's sharded EmbeddingCollection cannot load a state dict that lacks one of
        # its tables (its load pre-hook raises KeyError): its unsharded one is the reference
        ec = EmbeddingCollection(tables=configs())
        out[("ec", strict)] = _load(ec, renamed(ec.state_dict(), "t1", "t9"), strict)
    return out


def save_in_own_mode(rank: int, world_size: int, path: str) -> Dict[str, Any]:
    """Train under the per-rank budget and save with DCP; the entries each rank saved,
    gathered."""
    return _save(trained(True, rank, world_size, steps=4, seed=3), rank, world_size, path)


def _save(dmp, rank: int, world_size: int, path: str) -> Dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    state = dmp.state_dict()
    dcp.save({"model": state}, checkpoint_id=path)
    group = f"rank{rank}_of_{world_size}"
    mine = {t: saved_entries(state, "dyn.", t, group) for t in TABLES}
    every: List[Any] = [None] * world_size
    dist.all_gather_object(every, mine)
    merged = {t: {k: v for part in every for k, v in part[t].items()} for t in TABLES}
    stats = dmp.module.dyn.local.stats()["t0"]
    return {"modes": {t: m.value for t, m in dmp.module.dyn.storage_modes().items()},
            "entries": merged, "steps": dict(dmp.module.dyn.local.steps),
            "rows": (stats["rows_device"], stats["rows_backing"])}


def load_in_own_mode(rank: int, world_size: int, path: str,
                     save_to: Optional[str] = None) -> Dict[str, Any]:
    """A fresh model under the same budget on this world size, loaded from ``path`` with
    DCP and ``DynamicEmbLoadPlanner``; what each rank holds. With ``save_to``, one more step
    (CACHE: its rows now cached, the others in the store) saved there (``"saved"``)."""
    import torch.distributed.checkpoint as dcp

    from dynemb.checkpoint import DynamicEmbLoadPlanner
    dmp = trained(True, rank, world_size, steps=1, seed=4)
    state = {"model": dmp.state_dict()}
    dcp.load(state, checkpoint_id=path, planner=DynamicEmbLoadPlanner())
    dmp.load_state_dict(state["model"])
    local = dmp.module.dyn.local
    out = {"modes": {t: m.value for t, m in dmp.module.dyn.storage_modes().items()},
           "entries": {t: loaded_entries(local, t, IDS) for t in TABLES},
           "steps": dict(local.steps), "rows_backing": local.stats()["t0"]["rows_backing"]}
    if save_to is not None:
        train_steps(dmp, rank, world_size, steps=1, seed=5)
        out["saved"] = _save(dmp, rank, world_size, save_to)
    return out


def run(rank: int, world_size: int, jobs: List[Tuple[str, tuple]]) -> List[Any]:
    """Run ``jobs`` (``(function name, args)``) in order; errors come back as strings."""
    results = []
    for name, args in jobs:
        try:
            results.append(globals()[name](rank, world_size, *args))
        except Exception as err:  # the test shows it
            import traceback
            results.append({"error": f"{type(err).__name__}: {err}\n{traceback.format_exc()}"})
            dist.barrier()
    return results
