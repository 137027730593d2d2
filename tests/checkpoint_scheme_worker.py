"""What each rank runs in tests/test_checkpoint_scheme.py: a checkpoint of a model sharded
under one ``ShardingScheme`` loaded into the same model sharded under the other.

The model: two dynamic tables (t0 HBM_DIRECT, t1 CACHE whose cache holds 16 rows per rank,
so most rows sit in its backing store), Adam, under ``DistributedModelParallel``. One spawned
world runs every case (:func:`run`): per direction (HASH -> MOD, MOD -> HASH) a model is
trained and saved once (its ``state_dict`` in memory, and ``dcp.save``), then loaded into a
fresh model of the other scheme with ``load_state_dict`` and with ``dcp.load``; a checkpoint
written before the scheme was recorded (signatures without it) is loaded too, and the
model's checkpoint files (``dynemb.checkpoint.dump``) are loaded into the other scheme's
model (refused: a rank's files load as they are). Each load reports which keys sit on a
rank that does not own them (``key_reference.owner``, written from the documented rule),
every key's row and optimizer state, and the eval outputs.
"""
from __future__ import annotations

from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb.checkpoint import dump, load
from tests.checkpoint_models import sharded_row_wise
from tests.key_reference import owner

FEATURES = ["f0", "f1"]
TABLES = ["t0", "t1"]
IDS = torch.arange(60) * 7 - 11
GLOBAL_BATCH = 8
DIM = 4
STEPS = 4


class Model(torch.nn.Module):
    def __init__(self, scheme: str):
        super().__init__()
        from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig,
                            OptimizerType, ShardingScheme)
        opt = OptimizerConfig(OptimizerType.ADAM, learning_rate=0.05)
        width = DIM + opt.state_dim(DIM)
        common = dict(bucket_size=8, max_capacity=256, seed=5,
                      sharding=ShardingScheme(scheme))
        options = {"t0": DynamicEmbTableOptions(**common),
                   "t1": DynamicEmbTableOptions(caching=True,
                                                global_hbm_for_values=32 * width * 4,
                                                **common)}
        self.dyn = DynamicEmbCollection(
            [EmbeddingConfig(name=t, embedding_dim=DIM, num_embeddings=len(IDS),
                             feature_names=[f]) for t, f in zip(TABLES, FEATURES)],
            device="meta", table_options=options, optimizer=opt)

    def forward(self, kjt: KeyedJaggedTensor) -> Dict[str, torch.Tensor]:
        out = self.dyn(kjt)
        return {f: out[f].values() for f in FEATURES}


def shard(scheme: str, world_size: int):
    return sharded_row_wise(Model(scheme), TABLES, world_size)


def local_kjt(seed: int, rank: int, world_size: int) -> KeyedJaggedTensor:
    """Rank ``rank``'s slice of global batch ``seed`` (ids drawn from ``IDS``)."""
    g = torch.Generator().manual_seed(seed)
    per = GLOBAL_BATCH // world_size
    lengths, values = [], []
    for _ in FEATURES:
        ls = torch.randint(1, 3, (GLOBAL_BATCH,), generator=g)
        vs = IDS[torch.randint(0, len(IDS), (int(ls.sum()),), generator=g)]
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), ls.cumsum(0)])
        lengths.append(ls[rank * per:(rank + 1) * per])
        values.append(vs[offsets[rank * per]:offsets[(rank + 1) * per]])
    return KeyedJaggedTensor.from_lengths_sync(FEATURES, torch.cat(values), torch.cat(lengths))


def train(dmp, rank: int, world_size: int) -> None:
    dmp.train()
    for step in range(STEPS):
        out = dmp(local_kjt(step, rank, world_size))
        loss = sum(((e - 0.1 * (i + 1)) ** 2).sum() for i, e in enumerate(out.values()))
        loss.backward()


def look(dmp, rank: int, world_size: int, scheme: str) -> Dict[str, Any]:
    """Where each key sits, every key's row and optimizer state (from its owner), the
    counters, and the eval outputs of a batch drawing on all ids."""
    stats = dmp.module.dyn.stats()
    strays, rows = {}, {}
    for name in TABLES:
        got, found = dmp.module.dyn.read_rows(name, IDS, with_state=True)
        mine = torch.tensor([owner(int(k), world_size, scheme) == rank for k in IDS])
        strays[name] = int((found & ~mine).sum())
        held = (got * (found & mine)[:, None]).contiguous()
        count = (found & mine).to(torch.int64)
        dist.all_reduce(held)
        dist.all_reduce(count)
        rows[name] = (held.numpy(), count.numpy())
    stray_total = torch.tensor([sum(strays.values())])
    dist.all_reduce(stray_total)
    dmp.eval()
    with torch.no_grad():
        out = dmp(local_kjt(100, rank, world_size))
    dmp.train()
    return {"strays": int(stray_total), "rows": rows,
            "eval": {f: v.numpy() for f, v in out.items()},
            "stats": stats}


def _load(scheme: str, world_size: int, rank: int, how: str, source) -> Dict[str, Any]:
    from dynemb.checkpoint import DynamicEmbLoadPlanner
    dmp = shard(scheme, world_size)
    try:
        if how == "load_state_dict":
            dmp.load_state_dict(source)
        else:  # "dcp": with dynemb's planner; "dcp_default": DCP's own, in place
            state = dmp.state_dict()
            planner = {"planner": DynamicEmbLoadPlanner()} if how == "dcp" else {}
            dcp.load(state, checkpoint_id=source, **planner)
            dmp.load_state_dict(state)
    except Exception as err:  # noqa: BLE001  the test reads the message
        return {"error": f"{type(err).__name__}: {err}"}
    return look(dmp, rank, world_size, scheme)


def _load_files(scheme: str, world_size: int, rank: int, path: str) -> Dict[str, Any]:
    """``dynemb.checkpoint.load`` of another scheme's files: the error, and how many keys
    the fresh model holds afterwards."""
    dmp = shard(scheme, world_size)
    try:
        load(dmp, path)
        error = None
    except Exception as err:  # noqa: BLE001  the test reads the message
        error = f"{type(err).__name__}: {err}"
    held = sum(int(dmp.module.dyn.read_rows(t, IDS)[1].sum()) for t in TABLES)
    return {"error": error, "held": held}


def run(rank: int, world_size: int, root: str) -> Dict[Any, Any]:
    """Every case on one world: ``{(saved scheme, loaded scheme, how): look(...)}``, with
    ``("trained", scheme)`` the trained model's own look (and ``how="files"``:
    :func:`_load_files`)."""
    out: Dict[Any, Any] = {}
    for saved, loaded in (("hash", "mod"), ("mod", "hash")):
        dmp = shard(saved, world_size)
        train(dmp, rank, world_size)
        state = {k: v.clone() for k, v in dmp.state_dict().items()}
        dcp.save(state, checkpoint_id=f"{root}/{saved}")
        dump(dmp, f"{root}/files_{saved}")
        out[("trained", saved)] = look(dmp, rank, world_size, saved)
        out[(saved, loaded, "files")] = _load_files(loaded, world_size, rank,
                                                    f"{root}/files_{saved}")
        out[(saved, loaded, "load_state_dict")] = _load(loaded, world_size, rank,
                                                        "load_state_dict", state)
        for how in ("dcp", "dcp_default"):
            out[(saved, loaded, how)] = _load(loaded, world_size, rank, how, f"{root}/{saved}")
    return out
