"""Tables and the mixed model the planning tests share: two dynamic tables (a CACHE one read
by two features, an HBM_DIRECT one with admission), an ordinary EmbeddingCollection and a
Linear, planned on 2 ranks."""
import torch
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.modules.embedding_configs import DataType, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, FrequencyAdmission,
                    OptimizerConfig, OptimizerType)
from dynemb.planning import dynemb_constraints
from dynemb.sharding.sharder import DynamicEmbCollectionSharder

BATCH = 64


def table_config(name="t", rows=12_000, dim=16, features=("f",), data_type=DataType.FP32):
    return EmbeddingConfig(name=name, embedding_dim=dim, num_embeddings=rows,
                           feature_names=list(features), data_type=data_type)


class MixedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        adam = OptimizerConfig(OptimizerType.ADAM)
        self.dyn = DynamicEmbCollection(
            [table_config("items", rows=4_000_000, dim=64, features=("history", "target")),
             table_config("users", rows=1_000_000, dim=32, features=("user",))], device="meta",
            table_options={
                "items": DynamicEmbTableOptions(caching=True, global_hbm_for_values=256 << 20),
                "users": DynamicEmbTableOptions(
                    admission=FrequencyAdmission(threshold=2, counter_capacity=1 << 20))},
            optimizer=adam)
        self.ec = EmbeddingCollection(
            [table_config("cats", rows=100_000, dim=64, features=("cat",))],
            device=torch.device("meta"))
        self.dense = torch.nn.Linear(64, 8)


def sharders():
    return [DynamicEmbCollectionSharder(), EmbeddingCollectionSharder()]


def topology():
    return Topology(world_size=2, compute_device="cuda")


def mixed_constraints(model):
    base = {"items": ParameterConstraints(pooling_factors=[20.0, 1.0])}
    return dynemb_constraints(model, base)
