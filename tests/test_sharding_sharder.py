"""What DynamicEmbCollectionSharder offers TorchRec's planner: row-wise shards with our compute
kernel, over parameters that allocate nothing."""
import torch
from torchrec import EmbeddingConfig
from torchrec.modules.embedding_configs import DataType

from dynemb import DynamicEmbCollection
from dynemb.sharding import DynamicEmbCollectionSharder


def test_sharder_offers_row_wise_shards_of_meta_parameters():
    tables = [EmbeddingConfig(name="t0", embedding_dim=4, num_embeddings=64,
                              feature_names=["a"]),
              EmbeddingConfig(name="t1", embedding_dim=8, num_embeddings=2**30,
                              feature_names=["b"], data_type=DataType.FP16)]
    sharder = DynamicEmbCollectionSharder()
    params = sharder.shardable_parameters(DynamicEmbCollection(tables, device="meta"))
    assert {name: (tuple(p.shape), p.device.type, p.dtype, p.requires_grad)
            for name, p in params.items()} == {
        "t0": ((64, 4), "meta", torch.float32, False),
        "t1": ((2**30, 8), "meta", torch.float16, False)}
    assert sharder.module_type is DynamicEmbCollection
    for device in ("cpu", "cuda"):
        assert sharder.sharding_types(device) == ["row_wise"]
        assert sharder.compute_kernels("row_wise", device) == ["customized_kernel"]
