"""Drop-in, sharded: under ``DistributedModelParallel`` (2 spawned CPU ranks, gloo) the
dynamic collections answer a KJT as TorchRec's unsharded modules do for each rank's samples,
from the same initial rows, before and after a training step: a feature read by two tables
(outputs ``f2@t1`` and ``f2@t2``), a feature of no table, and weights given to an unweighted
bag collection (which every rank drops before its ids travel)."""
from typing import Dict, List

import pytest
import torch

from examples.spawn import run_on_ranks

NUM_IDS = 40
LR = 0.5
BATCH = 3
FEATURES = ["f3", "f2", "f1"]  # f3: no table; not in config order


def _seq_tables():
    from torchrec import EmbeddingConfig
    return [EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=NUM_IDS,
                            feature_names=["f1", "f2"]),
            EmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=NUM_IDS,
                            feature_names=["f2"])]


def _bag_tables():
    from torchrec import EmbeddingBagConfig
    from torchrec.modules.embedding_configs import PoolingType
    return [EmbeddingBagConfig(name="b1", embedding_dim=4, num_embeddings=NUM_IDS,
                               feature_names=["f1", "f2"], pooling=PoolingType.SUM),
            EmbeddingBagConfig(name="b2", embedding_dim=3, num_embeddings=NUM_IDS,
                               feature_names=["f2"], pooling=PoolingType.MEAN)]


def _options():
    from dynemb import DynamicEmbTableOptions, Initializer, InitializerKind
    return DynamicEmbTableOptions(
        initializer=Initializer(InitializerKind.UNIFORM, low=-0.1, high=0.1), seed=5)


def _batch(rank: int, step: int):
    """Rank ``rank``'s KJT of ``step``: ids from a small range (ranks share some), weights."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    g = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 3, (len(FEATURES) * BATCH,), generator=g)
    values = torch.randint(0, NUM_IDS, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.numel(), generator=g) + 0.5
    return KeyedJaggedTensor.from_lengths_sync(FEATURES, values, lengths, weights)


def _seq_loss(out):
    return sum((jt.values() * (i + 1)).pow(2).sum() for i, jt in enumerate(out.values()))


def _bag_loss(out):
    values = out.values()
    return (values * torch.arange(1, values.shape[1] + 1)).pow(2).sum()


class _Model(torch.nn.Module):
    def __init__(self, seq, bags):
        super().__init__()
        self.seq, self.bags = seq, bags

    def forward(self, kjt):
        seq = self.seq(kjt)
        bags = self.bags(kjt)
        seq = seq.wait() if hasattr(seq, "wait") else seq
        bags = bags.wait() if hasattr(bags, "wait") else bags
        return seq, bags


def _references():
    """TorchRec's unsharded modules with the rows dynemb gives each id."""
    from torchrec import EmbeddingBagCollection, EmbeddingCollection

    from dynemb.rows.initializers import table_identity
    seq, bags = EmbeddingCollection(_seq_tables()), EmbeddingBagCollection(_bag_tables())
    init, ids = _options(), torch.arange(NUM_IDS)
    with torch.no_grad():
        for tables, configs in ((seq.embeddings, _seq_tables()),
                                (bags.embedding_bags, _bag_tables())):
            for c in configs:
                tables[c.name].weight.copy_(init.initializer.rows(
                    ids, c.embedding_dim, seed=init.seed, table_id=table_identity(c.name)))
    return _Model(seq, bags)


def _sharded(world_size: int):
    import torch.distributed as dist
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from dynemb import (DynamicEmbBagCollection, DynamicEmbCollection, OptimizerConfig,
                        OptimizerType)
    from dynemb.sharding import DynamicEmbBagCollectionSharder, DynamicEmbCollectionSharder
    sgd = OptimizerConfig(OptimizerType.SGD, learning_rate=LR)
    meta = torch.device("meta")
    model = _Model(
        DynamicEmbCollection(_seq_tables(), device=meta, table_options=_options(),
                             optimizer=sgd),
        DynamicEmbBagCollection(_bag_tables(), device=meta, table_options=_options(),
                                optimizer=sgd))
    sharders = [DynamicEmbCollectionSharder(), DynamicEmbBagCollectionSharder()]
    plan = {name: construct_module_sharding_plan(
        getattr(model, name), {t.name: row_wise(compute_kernel="customized_kernel")
                               for t in tables},
        sharder=sharder, local_size=world_size, world_size=world_size, device_type="cpu")
        for name, tables, sharder in (("seq", _seq_tables(), sharders[0]),
                                      ("bags", _bag_tables(), sharders[1]))}
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(
        dist.GroupMember.WORLD), device=torch.device("cpu"), plan=ShardingPlan(plan),
        sharders=sharders)


def _answers(seq, bags) -> Dict:
    return {"seq": {n: (jt.values().detach(), jt.lengths()) for n, jt in seq.items()},
            "bag_keys": bags.keys(), "bag_dims": bags.length_per_key(),
            "bags": bags.values().detach()}


def _train_reference(reference, world_size: int, step: int) -> None:
    """One SGD step of the reference on every rank's batch of ``step``: the mean of the
    ranks' gradients, as TorchRec's all-to-alls divide them by the world size in backward
    (``torchrec.distributed.comm_ops`` gradient division, on by default)."""
    loss = 0
    for rank in range(world_size):
        seq, bags = reference(_batch(rank, step))
        loss = loss + _seq_loss(seq) + _bag_loss(bags)
    (loss / world_size).backward()
    with torch.no_grad():
        for param in reference.parameters():
            if param.grad is not None:
                param -= LR * param.grad
                param.grad = None


def run_dropin(rank: int, world_size: int) -> List[Dict]:
    """Per step, this rank's answers from the sharded modules and from the reference."""
    dmp, reference = _sharded(world_size), _references()
    answers = []
    for step in range(2):
        seq, bags = dmp(_batch(rank, step))
        answers.append((_answers(seq, bags), _answers(*reference(_batch(rank, step)))))
        (_seq_loss(seq) + _bag_loss(bags)).backward()
        _train_reference(reference, world_size, step)
    return answers


@pytest.fixture(scope="module")
def world2():
    return run_on_ranks(2, run_dropin, timeout=600)


def test_sharded_modules_answer_like_torchrecs_modules_for_each_ranks_samples(world2):
    for rank_answers in world2:
        for step, (got, expected) in enumerate(rank_answers):
            assert list(got["seq"]) == list(expected["seq"]) == ["f1", "f2@t1", "f2@t2"]
            for name, (values, lengths) in expected["seq"].items():
                torch.testing.assert_close(got["seq"][name][0], values,
                                           msg=f"step {step} {name}")
                assert torch.equal(got["seq"][name][1], lengths)
            assert got["bag_keys"] == expected["bag_keys"] == ["f1", "f2@b1", "f2@b2"]
            assert got["bag_dims"] == expected["bag_dims"]
            torch.testing.assert_close(got["bags"], expected["bags"], msg=f"step {step}")
