"""Writes ``old_module_c525657.pt.gz``: two dynamic modules pickled whole (``torch.save``) by the
code at commit c525657, before the package was laid out by layer, with the outputs that code
gives for the steps after the save (``tests/test_module_pickle.py`` loads it with today's code
and takes the same steps).

Run with the old code first on the path, from a checkout of it::

    git worktree add /tmp/old c525657
    PYTHONPATH=/tmp/old python tests/data/make_old_module_pickle.py tests/data/old_module_c525657.pt.gz
"""
import gzip
import io
import sys

import torch
from torchrec import EmbeddingBagConfig, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbBagCollection, DynamicEmbCollection, DynamicEmbTableOptions,
                    OptimizerConfig, OptimizerType, ScorePolicy, StashMode)

ADAM = OptimizerConfig(OptimizerType.ADAM, learning_rate=0.05)
OPTIONS = {
    "lfu": DynamicEmbTableOptions(score_strategy=ScorePolicy.LFU, max_capacity=128),
    "cache": DynamicEmbTableOptions(caching=True, bucket_size=16, max_capacity=256,
                                    local_hbm_for_values=32 * (8 + 16) * 4),
    "stash": DynamicEmbTableOptions(stash=StashMode.ALL, max_capacity=128),
    "g0": DynamicEmbTableOptions(max_capacity=128),  # g0 and g1 train as one group
    "g1": DynamicEmbTableOptions(max_capacity=128),
}
FEATURES = [f"f_{name}" for name in OPTIONS]


def modules():
    torch.manual_seed(0)
    ec = DynamicEmbCollection(
        [EmbeddingConfig(name=n, embedding_dim=8, num_embeddings=64, feature_names=[f])
         for n, f in zip(OPTIONS, FEATURES)], table_options=OPTIONS, optimizer=ADAM)
    ebc = DynamicEmbBagCollection(
        [EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=64, feature_names=[f])
         for n, f in zip(OPTIONS, FEATURES)], table_options=OPTIONS, optimizer=ADAM)
    return {"sequence": ec, "pooled": ebc}


def batch(step):
    ids = (torch.arange(6 * len(FEATURES), dtype=torch.int64) * 7 + step * 5) % 97
    return KeyedJaggedTensor.from_lengths_sync(FEATURES, ids, torch.full((3 * len(FEATURES),), 2))


def outputs(out):
    if isinstance(out, dict):
        return {name: jt.values() for name, jt in out.items()}
    return {"pooled": out.values()}


def train_step(module, step):
    out = outputs(module(batch(step)))
    sum((v ** 2).sum() for v in out.values()).backward()
    return {name: v.detach().clone() for name, v in out.items()}


def main(path):
    saved = {}
    for kind, module in modules().items():
        for step in range(4):
            train_step(module, step)
        buffer = io.BytesIO()
        torch.save(module, buffer)
        after = [train_step(module, step) for step in range(4, 7)]
        saved[kind] = {"pickle": buffer.getvalue(), "after": after}
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    with gzip.open(path, "wb") as f:  # mostly zeros (a store's empty slots)
        f.write(buffer.getvalue())


if __name__ == "__main__":
    main(sys.argv[1])
