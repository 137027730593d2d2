"""What each rank runs in the sharded checkpoint-file test (tests/test_checkpoint_files_sharded.py):
the DistributedModelParallel model of the DCP tests (tests/checkpoint_dcp_worker.py), dumped
in full and then as a delta by every rank, loaded into a freshly sharded model."""
from __future__ import annotations

from checkpoint_dcp_worker import global_batches, optimizer, shard, table_rows, train


def dump_and_load(rank, world_size, path):
    from dynemb.checkpoint import dump, load
    dmp = shard(world_size)
    opt = optimizer(dmp, world_size)
    batches = global_batches(6)
    train(dmp, opt, batches[:3], rank, world_size)
    full = dump(dmp, f"{path}/full")
    train(dmp, opt, batches[3:], rank, world_size, 3)
    delta = dump(dmp, f"{path}/delta", since=full)
    fresh = shard(world_size)
    loaded = load(fresh, [f"{path}/full", f"{path}/delta"])
    return {"rank_dir": (full.rank, full.world_size), "delta_previous": delta.previous,
            "full_id": full.id, "loaded_id": loaded.id, "delta_id": delta.id,
            "rows": table_rows(dmp), "loaded_rows": table_rows(fresh),
            "stats": dmp.module.dyn.stats(), "loaded_stats": fresh.module.dyn.stats()}
