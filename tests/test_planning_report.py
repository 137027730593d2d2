"""The footprint report and the measured-allocation table (dynemb.planning.report)."""
import re

import torch
from torchrec.distributed.types import PipelineType

from dynemb import DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig
from dynemb.planning import (dynamic_embedding_enumerator, footprint_report,
                             format_allocated, measure_allocated)
from tests.planning_models import (BATCH, MixedModel, mixed_constraints, sharders,
                                   table_config, topology)


def test_footprint_report_lines_and_total():
    model = MixedModel()
    constraints = mixed_constraints(model)
    pipeline = PipelineType.TRAIN_PREFETCH_SPARSE_DIST
    text = footprint_report(model, 2, BATCH, pipeline, constraints=constraints)
    for name, mode in (("items", "CACHE"), ("users", "HBM_DIRECT")):
        for rank in (0, 1):
            assert re.search(rf"^{name}\s+{rank}\s+{mode}\s", text, re.M), text
        assert re.search(rf"^{name}\s+all\s", text, re.M)
    assert re.search(r"^\(all tables\)\s+0\s", text, re.M)
    total = re.search(r"^total: device ([\d,]+) bytes .* host ([\d,]+) bytes", text, re.M)
    device, host = (int(g.replace(",", "")) for g in total.groups())

    enumerator = dynamic_embedding_enumerator(topology(), BATCH, constraints, pipeline)
    options = [o for o in enumerator.enumerate(model, sharders()) if o.name != "cats"]
    assert device == sum(s.storage.hbm for o in options for s in o.shards)
    assert host == sum(s.storage.ddr for o in options for s in o.shards)
    # the per-rank line of a table carries the numbers of its shard
    items = [o for o in options if o.name == "items"][0]
    line = re.search(r"^items\s+0\s+CACHE.*$", text, re.M).group(0)
    host_mib = f"{items.shards[0].storage.ddr / 2**20:,.2f}"
    assert line.split()[-1] == host_mib


class _Holder(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner


def test_format_allocated_one_line_per_table():
    collection = DynamicEmbCollection(
        [table_config("a", rows=256, dim=4), table_config("b", rows=128, dim=8, features=("g",))],
        "cpu", table_options=DynamicEmbTableOptions(), optimizer=OptimizerConfig())
    allocated = measure_allocated(_Holder(collection))  # keys: "<module path>.<table>"
    assert set(allocated) == {"inner.a", "inner.b"}
    assert allocated["inner.b"].values_bytes == 128 * 8 * 4
    assert measure_allocated(collection) == {"a": allocated["inner.a"],
                                             "b": allocated["inner.b"]}
    lines = format_allocated(allocated).splitlines()
    assert len(lines) == 4 and lines[0].split()[:3] == ["table", "values", "optim"]
    assert lines[3].split()[:2] == ["inner.b", f"{128 * 8 * 4:,}"]
