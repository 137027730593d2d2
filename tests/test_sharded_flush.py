"""flush() of a sharded module: this rank's share of each CACHE table goes to its store
(a one-rank gloo world in this process)."""
import torch
from torchrec import EmbeddingConfig
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig,
                    OptimizerType, StorageMode)
from dynemb.sharding import DynamicEmbCollectionSharder
from tests.torchrec_twin import ensure_single_process_group

TABLES = [EmbeddingConfig(name="c", embedding_dim=4, num_embeddings=1024, feature_names=["a"]),
          EmbeddingConfig(name="h", embedding_dim=4, num_embeddings=64, feature_names=["b"])]
OPTIONS = {"c": DynamicEmbTableOptions(caching=True, bucket_size=4,
                                       local_hbm_for_values=16 * 4 * 4),
           "h": DynamicEmbTableOptions()}


class _Wrap(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dyn = DynamicEmbCollection(TABLES, device="meta", table_options=OPTIONS,
                                        optimizer=OptimizerConfig(OptimizerType.SGD))

    def forward(self, kjt):
        return self.dyn(kjt)


def test_a_sharded_module_flushes_its_local_share():
    # TorchRec's planner plans it (row-wise is all the dynemb sharder offers)
    env = ShardingEnv.from_process_group(ensure_single_process_group())
    dmp = DistributedModelParallel(_Wrap(), env=env, device=torch.device("cpu"),
                                   sharders=[DynamicEmbCollectionSharder()])
    sharded = dmp.module.dyn
    assert sharded.storage_modes() == {"c": StorageMode.CACHE, "h": StorageMode.HBM_DIRECT}
    for step in range(8):
        ids = torch.tensor([step * 3 + i for i in range(3)] + [1])
        out = dmp(KeyedJaggedTensor.from_lengths_sync(["a", "b"], ids, torch.tensor([3, 1])))
        sum(jt.values().sum() for jt in out.values()).backward()
    table = sharded.local.tables["c"]
    cached = table.tier.hash.size()
    assert table.stats()["write_backs"] > 0 and 0 < cached <= 16
    assert sharded.flush() == {"c": cached}
    keys = torch.arange(24)
    current, found = sharded.read_rows("c", keys, with_state=True)
    stored, in_store, _ = table.store.find(keys)
    assert bool(found.all()) and torch.equal(in_store, found)
    assert torch.equal(stored, current)
