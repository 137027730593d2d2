"""What each rank runs in tests/test_metrics.py's sharded test: the model of
tests/checkpoint_dcp_worker.py (five dynamic tables in three storage modes, sharded row-wise),
trained for two intervals; each rank reports its own ``stats()`` totals at every interval
end (the reference, summed over ranks by the test) and what the metric computed there."""
from __future__ import annotations

import torch

from tests.checkpoint_dcp_worker import global_batches, optimizer, shard, train


def intervals(rank, world_size, cuts=(3, 7)):
    from dynemb.metrics import DynamicTableMetrics
    dmp = shard(world_size)
    opt = optimizer(dmp, world_size)
    metric = DynamicTableMetrics(dmp)
    batches = global_batches(cuts[-1])
    out, done = [], 0
    totals = [dmp.module.dyn.stats()]
    for cut in cuts:
        train(dmp, opt, batches[done:cut], rank, world_size, done)
        done = cut
        metric.update(dmp)
        computed = {k: float(v) for k, v in metric.compute().items()}  # every rank, reduced
        metric.reset()
        totals.append(dmp.module.dyn.stats())
        out.append(computed)
    return {"computed": out, "totals": totals,
            "local": {k: float(v) for k, v in _local(dmp).items()}}


def _local(dmp):
    """One more interval computed without synchronization: this rank's share alone."""
    from dynemb.metrics import DynamicTableMetrics
    metric = DynamicTableMetrics(dmp, sync_on_compute=False)
    metric.update(dmp)
    out = metric.compute()
    return {k: v for k, v in out.items() if k.endswith(("rows_device", "load_factor"))}


def run(rank, world_size):
    torch.manual_seed(0)
    return intervals(rank, world_size)
