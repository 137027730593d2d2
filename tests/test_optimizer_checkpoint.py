"""The learning rate survives a checkpoint: a model with a DynamicEmbCollection or a
DynamicEmbBagCollection and a dense layer, trained under an LR schedule, saved
(``model.state_dict()``, ``optimizer.state_dict()``, ``scheduler.state_dict()``, with
``torch.save`` or ``torch.distributed.checkpoint``) and loaded into a freshly built model,
trains at exactly the lr of the uninterrupted run at every step (the scheduler's closed form),
with the same losses and rows. The sharded form (DMP, CombinedOptimizer) is in
tests/test_optimizer_checkpoint_sharded.py."""
import dataclasses
import io

import pytest
import torch
from torchrec import EmbeddingBagConfig, EmbeddingConfig
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbBagCollection, DynamicEmbCollection, DynamicEmbTableOptions,
                    Initializer, InitializerKind, OptimizerConfig, OptimizerType)

DIM, NUM_IDS, BATCH = 4, 50, 6
BASE_LR, DENSE_LR = 0.1, 0.05
STEPS_BEFORE, STEPS_AFTER = 4, 4
FEATURES = ["f0", "f1"]

#: scheduler name -> (factory, the lr of 0-based step k in closed form)
SCHEDULES = {
    "step": (lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
             lambda k: BASE_LR * 0.5 ** (k // 2)),
    "lambda": (lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
               lambda k: BASE_LR / (1 + k)),
}


class Net(torch.nn.Module):
    def __init__(self, pooled: bool):
        super().__init__()
        options = DynamicEmbTableOptions(
            initializer=Initializer(InitializerKind.UNIFORM, low=-0.5, high=0.5), seed=2)
        opt = OptimizerConfig(OptimizerType.ROWWISE_ADAGRAD, learning_rate=BASE_LR)
        if pooled:
            self.sparse = DynamicEmbBagCollection(
                [EmbeddingBagConfig(name="t", embedding_dim=DIM, num_embeddings=NUM_IDS,
                                    feature_names=FEATURES)],
                table_options=options, optimizer=opt)
        else:
            self.sparse = DynamicEmbCollection(
                [EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=NUM_IDS,
                                 feature_names=FEATURES)],
                table_options=options, optimizer=opt)
        self.pooled = pooled
        self.dense = torch.nn.Linear(DIM, 1)
        with torch.no_grad():
            self.dense.weight.fill_(0.3)
            self.dense.bias.fill_(0.1)

    def forward(self, kjt):
        out = self.sparse(kjt)
        if self.pooled:
            values = out.values().reshape(-1, DIM)
        else:
            values = torch.cat([out[f].values() for f in FEATURES])
        return ((self.dense(values) - 1.0) ** 2).sum() + values.sum() * 0.1


def batches(steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 4, (len(FEATURES) * BATCH,), generator=g)
        ids = torch.randint(0, NUM_IDS, (int(lengths.sum()),), generator=g) * 131 - 7
        out.append(KeyedJaggedTensor.from_lengths_sync(FEATURES, ids, lengths))
    return out


@dataclasses.dataclass
class Run:
    net: Net
    optimizer: CombinedOptimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    saves_fused_alone: bool  # the fused optimizer is not in ``optimizer``: saved beside it


def build(pooled, optimizer_kind, schedule) -> Run:
    """The model, its optimizer and the scheduler: over the fused optimizer alone, the dense
    SGD at a constant lr beside it (``fused``), or over a CombinedOptimizer of both, which
    then saves its param groups, the dense lr among them (``combined``: TorchRec saves a dense
    optimizer's lr only with ``save_param_groups(True)``)."""
    torch.manual_seed(0)
    net = Net(pooled)
    dense = KeyedOptimizerWrapper(dict(net.dense.named_parameters()),
                                  lambda ps: torch.optim.SGD(ps, lr=DENSE_LR))
    fused = net.sparse.fused_optimizer
    if optimizer_kind == "combined":
        optimizer = CombinedOptimizer([("sparse", fused), ("dense", dense)])
        optimizer.save_param_groups(True)
        return Run(net, optimizer, SCHEDULES[schedule][0](optimizer), False)
    optimizer = CombinedOptimizer([("dense", dense)])
    return Run(net, optimizer, SCHEDULES[schedule][0](fused), True)


def train(run: Run, kjts):
    """The fused lr each backward used, and each step's loss."""
    lrs, losses = [], []
    for kjt in kjts:
        run.optimizer.zero_grad()
        loss = run.net(kjt)
        lrs.append(run.net.sparse.fused_optimizer.lr)
        loss.backward()
        run.optimizer.step()
        if run.saves_fused_alone:
            run.net.sparse.fused_optimizer.step()  # does nothing; the scheduler follows it
        run.scheduler.step()
        losses.append(loss.detach())
    return lrs, torch.stack(losses)


def state_of(run: Run):
    state = {"model": run.net.state_dict(), "optim": run.optimizer.state_dict(),
             "sched": run.scheduler.state_dict()}
    if run.saves_fused_alone:
        state["fused"] = run.net.sparse.fused_optimizer.state_dict()
    return state


def save_and_load(how, saved_from: Run, loading_into: Run, tmp_path):
    """``saved_from``'s state in a file, loaded into ``loading_into`` as a user would."""
    if how == "torch":
        buffer = io.BytesIO()
        torch.save(state_of(saved_from), buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=False)
    else:
        import torch.distributed.checkpoint as dcp

        from dynemb.checkpoint import DynamicEmbLoadPlanner
        dcp.save(state_of(saved_from), checkpoint_id=str(tmp_path / "ckpt"))
        state = state_of(loading_into)
        dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"), planner=DynamicEmbLoadPlanner())
    loading_into.net.load_state_dict(state["model"])
    loading_into.optimizer.load_state_dict(state["optim"])
    if loading_into.saves_fused_alone:
        loading_into.net.sparse.fused_optimizer.load_state_dict(state["fused"])
    loading_into.scheduler.load_state_dict(state["sched"])


@pytest.mark.parametrize("pooled", [False, True], ids=["sequence", "pooled"])
@pytest.mark.parametrize("optimizer_kind,schedule,how", [
    ("fused", "step", "torch"), ("combined", "lambda", "torch"), ("combined", "step", "dcp")])
def test_a_resumed_plain_loop_trains_at_the_lr_of_the_uninterrupted_run(
        pooled, optimizer_kind, schedule, how, tmp_path):
    kjts = batches(STEPS_BEFORE + STEPS_AFTER)
    original = build(pooled, optimizer_kind, schedule)
    train(original, kjts[:STEPS_BEFORE])
    resumed = build(pooled, optimizer_kind, schedule)  # the constructor's lr: BASE_LR
    save_and_load(how, original, resumed, tmp_path)
    lrs, losses = train(original, kjts[STEPS_BEFORE:])
    resumed_lrs, resumed_losses = train(resumed, kjts[STEPS_BEFORE:])

    after = range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)
    expected = [SCHEDULES[schedule][1](k) for k in after]
    assert lrs == pytest.approx(expected, rel=1e-12)
    assert resumed_lrs == lrs
    assert torch.equal(resumed_losses, losses)
    keys = torch.arange(NUM_IDS) * 131 - 7
    rows, found = original.net.sparse.read_rows("t", keys, with_state=True)
    resumed_rows, resumed_found = resumed.net.sparse.read_rows("t", keys, with_state=True)
    assert torch.equal(found, resumed_found) and torch.equal(rows, resumed_rows)


def test_a_dcp_checkpoint_without_the_fused_optimizers_state_is_refused_naming_it(tmp_path):
    """A checkpoint whose fused optimizer state lacks its param group (``{'state': {}}``,
    which none of today's saves writes) is refused by DynamicEmbLoadPlanner naming the
    missing key."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from dynemb.checkpoint import DynamicEmbLoadPlanner
    original = build(False, "fused", "step")
    train(original, batches(STEPS_BEFORE))
    old_style = state_of(original)
    old_style["fused"] = {"state": {}}
    dcp.save(old_style, checkpoint_id=str(tmp_path / "old"))

    resumed = build(False, "fused", "step")
    state = state_of(resumed)
    with pytest.raises(CheckpointException, match=r"fused\.state\.dynamic_tables\.param_group"):
        dcp.load(state, checkpoint_id=str(tmp_path / "old"), planner=DynamicEmbLoadPlanner())
