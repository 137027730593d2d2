"""Worker of tests/test_sharded_writes.py: on each spawned rank, a row-wise sharded module
whose ranks write rows of their own keys (``write_rows``, a collective), then read them back
and look them up; then writes every rank must refuse."""
from __future__ import annotations

from typing import Any, Dict, List

import torch
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

DIM = 4
TABLES = {"t0": "a", "t1": "b", "t2": "c"}


def expected_row(keys: torch.Tensor) -> torch.Tensor:
    """The row every test writes for a key: a function of the key alone."""
    return keys[:, None].double().remainder(997).float() * 0.25 + torch.arange(DIM) * 0.5


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig,
                            OptimizerType, ScorePolicy)
        optimizer = OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD, learning_rate=0.1)
        configs = [EmbeddingConfig(name=t, embedding_dim=DIM, num_embeddings=400,
                                   feature_names=[f]) for t, f in TABLES.items()]
        options = {
            "t0": DynamicEmbTableOptions(max_capacity=256, bucket_size=16),
            "t1": DynamicEmbTableOptions(caching=True, bucket_size=16,
                                         local_hbm_for_values=16 * (DIM + 1) * 4),
            "t2": DynamicEmbTableOptions(max_capacity=16, bucket_size=16,
                                         score_strategy=ScorePolicy.NO_EVICTION)}
        self.dyn = DynamicEmbCollection(configs, device="meta", table_options=options,
                                        optimizer=optimizer)

    def forward(self, kjt):
        return self.dyn(kjt)


def _shard(world_size: int):
    import torch.distributed as dist
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    from dynemb.sharding import DynamicEmbCollectionSharder
    return DistributedModelParallel(
        _Model(), env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
        device=torch.device("cpu"), sharders=[DynamicEmbCollectionSharder()])


def _kjt(ids: Dict[str, torch.Tensor]) -> KeyedJaggedTensor:
    features = list(TABLES.values())
    values = torch.cat([ids.get(f, torch.empty(0, dtype=torch.int64)) for f in features])
    batch = max(v.numel() for v in ids.values())  # one id per sample, the rest empty
    lengths = torch.cat([(torch.arange(batch) < (ids[f].numel() if f in ids else 0)).long()
                         for f in features])
    return KeyedJaggedTensor.from_lengths_sync(features, values, lengths)


def _state(dmp) -> Dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in dmp.state_dict().items() if isinstance(v, torch.Tensor)}


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _refusal(dmp, sharded, call) -> Dict[str, Any]:
    """Run ``call``: the error it raised on this rank, and whether the tables are unchanged."""
    before = _state(dmp)
    try:
        call(sharded)
        error = None
    except Exception as err:  # every rank must raise: the test checks the types
        error = f"{type(err).__name__}: {err}"
    return {"error": error, "unchanged": _same(before, _state(dmp))}


def run_writes(rank: int, world_size: int, scenarios: List[Any]) -> List[Dict[str, Any]]:
    from dynemb.sharding.routing import owner_ranks
    torch.manual_seed(0)
    dmp = _shard(world_size)
    sharded = dmp.module.dyn
    for step in range(3):  # some trained rows first (CACHE: most of them in its store)
        gen = torch.Generator().manual_seed(step * 10 + rank)
        ids = {f: torch.randint(0, 60, (12,), generator=gen) for f in ("a", "b")}
        out = dmp(_kjt(ids))
        sum((jt.values() ** 2).sum() for jt in out.values()).backward()
    # each rank writes its own keys (some already held, some new, some owned elsewhere)
    mine = torch.cat([torch.arange(rank * 30, rank * 30 + 30), torch.tensor([10_000 + rank])])
    rows = expected_row(mine)
    state = (mine.float() * 0.01)[:, None]
    for table in ("t0", "t1"):
        sharded.write_rows(table, mine, rows, optimizer_state=state)
    every = torch.cat([torch.arange(0, 30 * world_size), 10_000 + torch.arange(world_size)])
    scheme = sharded.local.table_options["t0"].sharding
    owned = owner_ranks(every, world_size, scheme) == rank
    result: Dict[str, Any] = {"reads": {}}
    for table in ("t0", "t1"):
        got, found = sharded.read_rows(table, every, with_state=True)
        result["reads"][table] = {
            "found_is_owned": torch.equal(found, owned),
            "rows": torch.equal(got[found][:, :DIM], expected_row(every[found])),
            "state": torch.equal(got[found][:, DIM:], (every[found].float() * 0.01)[:, None]),
            "inserted_overwritten": (sharded.stats()[table]["write_inserts"],
                                     sharded.stats()[table]["write_overwrites"])}
    # the sharded forward (eval) reads them, whoever owns them
    dmp.eval()
    ask = torch.flip(every, [0])
    with torch.no_grad():
        out = dmp(_kjt({"a": ask, "b": ask}))
    result["forward"] = all(torch.equal(out[f].values(), expected_row(ask)) for f in "ab")
    dmp.train()
    # refused on every rank, nothing written anywhere
    bad_dim = torch.ones(1, DIM + rank)  # rank 1's rows have another dim
    result["bad_rows"] = _refusal(dmp, sharded, lambda s: s.write_rows(
        "t0", torch.tensor([500 + rank]), bad_dim))
    result["twice"] = _refusal(dmp, sharded, lambda s: s.write_rows(  # key 7 from each rank
        "t0", torch.tensor([7, 600 + rank]), expected_row(torch.tensor([7, 600 + rank]))))
    full = torch.arange(80) if rank == 0 else torch.empty(0, dtype=torch.int64)
    result["full"] = _refusal(dmp, sharded, lambda s: s.write_rows(  # 16 rows per rank
        "t2", full, expected_row(full)))
    result["state_on_one_rank"] = _refusal(dmp, sharded, lambda s: s.write_rows(
        "t0", torch.tensor([700 + rank]), expected_row(torch.tensor([700 + rank])),
        optimizer_state=torch.zeros(1, 1) if rank == 0 else None))
    return [result]
