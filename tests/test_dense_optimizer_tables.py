"""One dense optimizer over ``model.parameters()`` (TorchRec's BERT4Rec example): it trains
TorchRec's tables with its class and param group, and configures a dynamic module's fused
optimizer alike. A model of a dynamic module and dense layers, trained in one process by one
torch optimizer with an LR scheduler, against the same model on TorchRec's module with the
same initial rows: losses and rows equal step by step (Adam and AdamW, whose dense update
also moves the rows a batch does not read, on batches that read every row). What the fused
optimizer cannot follow is refused naming the option, with the tables unchanged."""
import warnings

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbBagCollection, DynamicEmbCollection, OptimizerConfig,
                    OptimizerType)
from tests.test_marked_optimizer import (NUM_IDS, OPTIONS, bag_tables, initial_rows,
                                         seq_tables)

#: (class, kwargs, OptimizerConfig the tables get, whether batches must read every row)
CASES = {
    "sgd": (torch.optim.SGD, {"lr": 0.5},
            OptimizerConfig(OptimizerType.SGD, learning_rate=0.5), False),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.3, "initial_accumulator_value": 0.1,
                                      "eps": 1e-6},
                OptimizerConfig(OptimizerType.ADAGRAD, learning_rate=0.3, eps=1e-6,
                                initial_accumulator_value=0.1), False),
    "adam": (torch.optim.Adam, {"lr": 0.05, "betas": (0.8, 0.99), "eps": 1e-6},
             OptimizerConfig(OptimizerType.ADAM, learning_rate=0.05, beta1=0.8, beta2=0.99,
                             eps=1e-6), True),
    "adamw": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1},
              OptimizerConfig(OptimizerType.ADAM, learning_rate=0.05, weight_decay=0.1),
              True),
}


class Model(torch.nn.Module):
    """Embeddings, then a dense layer over each output."""

    def __init__(self, embeddings, width):
        super().__init__()
        self.embeddings = embeddings
        self.dense = torch.nn.Linear(width, 1)

    def forward(self, kjt):
        out = self.embeddings(kjt)
        if isinstance(out, dict):  # sequence embeddings: one JaggedTensor per output
            return sum(((self.dense(jt.values()) - 0.1 * (i + 1)) ** 2).sum()
                       for i, jt in enumerate(out.values()))
        return ((self.dense(out.values()) - 0.2) ** 2).sum()


def models(pooled: bool, backend=("cpu", "cpu")):
    name, device = backend
    if pooled:
        dyn = DynamicEmbBagCollection(bag_tables(), table_options=OPTIONS, device=device,
                                      backend=name)
        ref, width = EmbeddingBagCollection(bag_tables()), 11
        ref_weights = ref.embedding_bags
    else:
        dyn = DynamicEmbCollection(seq_tables(), table_options=OPTIONS, device=device,
                                   backend=name)
        ref, width = EmbeddingCollection(seq_tables()), 4
        ref_weights = ref.embeddings
    with torch.no_grad():
        for table, rows in initial_rows(dyn).items():
            ref_weights[table].weight.copy_(rows.cpu())
    torch.manual_seed(3)
    model, reference = Model(dyn, width), Model(ref, width)
    reference.dense.load_state_dict(model.dense.state_dict())
    return model, reference


def batches(every_row: bool, steps: int = 3):
    """Batches of features f1 (t1) and f2 (t1 and t2); with ``every_row`` each reads every
    id of both tables (in another order and number each step)."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        if every_row:
            f1 = torch.cat([torch.randperm(NUM_IDS, generator=gen),
                            torch.randint(0, NUM_IDS, (3,), generator=gen)])
            f2 = torch.cat([torch.randperm(NUM_IDS, generator=gen),
                            torch.randint(0, NUM_IDS, (5,), generator=gen)])
        else:
            f1 = torch.randint(0, NUM_IDS // 2, (6,), generator=gen)
            f2 = torch.randint(0, NUM_IDS // 2, (5,), generator=gen)
        n1, n2 = len(f1), len(f2)
        lengths = [n1 // 2, n1 - n1 // 2, n2 // 2, n2 - n2 // 2]
        out.append(KeyedJaggedTensor.from_lengths_sync(["f1", "f2"], torch.cat([f1, f2]),
                                                       torch.tensor(lengths)))
    return out


def assert_rows_equal(dyn, reference):
    weights = (reference.embeddings if isinstance(reference, EmbeddingCollection)
               else reference.embedding_bags)
    ids = torch.arange(NUM_IDS)
    for name in dyn.tables:
        rows, found = dyn.read_rows(name, ids.to(dyn.device))
        found = found.cpu()
        expected = weights[name].weight.detach()
        assert found.any()
        torch.testing.assert_close(rows.cpu()[found], expected[found], rtol=1e-5, atol=1e-6)


def train_both(model, reference, optimizer_class, kwargs, every_row, steps=3):
    """One optimizer over every parameter of each model, a StepLR on each; the losses at
    every step and the rows after each must be equal. Returns the two optimizers."""
    optimizers = [optimizer_class(m.parameters(), **kwargs) for m in (model, reference)]
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
                  for o in optimizers]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # configured: no default-optimizer notice
        for kjt in batches(every_row, steps):
            losses = []
            for m, optimizer, scheduler in zip((model, reference), optimizers, schedulers):
                optimizer.zero_grad()
                loss = m(kjt.to(m.embeddings.device) if m is model else kjt)
                loss.backward()
                optimizer.step()
                scheduler.step()
                losses.append(loss.detach().cpu())
            # a few ulps apart per row (AdamW's decay is rounded in another order) add up
            # in a pooled sum of many rows
            torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-6)
            assert_rows_equal(model.embeddings, reference.embeddings)
            torch.testing.assert_close(model.dense.weight, reference.dense.weight,
                                       rtol=1e-5, atol=1e-6)
    return optimizers


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_dense_optimizer_trains_a_collection_as_torchrecs(case, backend):
    optimizer_class, kwargs, config, every_row = CASES[case]
    model, reference = models(pooled=False, backend=backend)
    train_both(model, reference, optimizer_class, kwargs, every_row)
    dyn = model.embeddings
    assert dyn.optimizer_config == config
    assert dyn.optimizer_source == "a dense optimizer"
    # the scheduler halved the group's rate at each of the 3 steps: the tables followed it
    assert dyn.fused_optimizer.lr == pytest.approx(kwargs["lr"] / 8)


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_dense_optimizer_trains_a_bag_collection_as_torchrecs(case, backend):
    optimizer_class, kwargs, config, every_row = CASES[case]
    model, reference = models(pooled=True, backend=backend)
    train_both(model, reference, optimizer_class, kwargs, every_row)
    assert model.embeddings.optimizer_config == config


def test_adam_moves_rows_a_batch_does_not_read_the_fused_adam_does_not():
    """Why the Adam twins read every row: the difference docs/migrating.md describes."""
    model, reference = models(pooled=False)
    with pytest.raises(AssertionError):
        train_both(model, reference, torch.optim.Adam, {"lr": 0.05}, every_row=False)


def test_a_dense_optimizer_holding_the_tables_leaves_them_to_the_fused_update():
    model, _ = models(pooled=False)
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    model(batches(True)[0]).backward()
    adam.step()
    # marked as trained in backward, as TorchRec's sharded weights: a TorchRec-style
    # dense optimizer built over in_backward_optimizer_filter leaves them out
    assert sorted(dict(in_backward_optimizer_filter(model.named_parameters()))) == [
        "dense.bias", "dense.weight"]
    assert all(p.grad is None for p in model.embeddings.parameters())
    assert adam.state[model.embeddings.table_weights.t1] == {}


REFUSED = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, "momentum=0.9"),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}, "momentum=0.9"),
    (torch.optim.SGD, {"lr": 0.1, "maximize": True}, "maximize=True"),
    (torch.optim.Adam, {"lr": 0.1, "amsgrad": True}, "amsgrad=True"),
    (torch.optim.Adam, {"lr": 0.1, "weight_decay": 0.01}, "weight_decay=0.01"),
    (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.1}, "lr_decay=0.1"),
    (torch.optim.RMSprop, {"lr": 0.1}, "RMSprop cannot train dynamic tables"),
]


@pytest.mark.parametrize("optimizer_class, kwargs, message", REFUSED,
                         ids=[f"{c.__name__}-{m.split('=')[0].split()[0]}"
                              for c, _, m in REFUSED])
def test_what_the_fused_optimizer_cannot_follow_is_refused_naming_it(optimizer_class, kwargs,
                                                                     message):
    model, _ = models(pooled=False)
    optimizer = optimizer_class(model.parameters(), **kwargs)  # noqa: F841 (held: found)
    with pytest.raises(ValueError, match=rf"{optimizer_class.__name__} \(param group 0\) holds "
                                         rf"the tables' parameters.*{message}"):
        model(batches(True)[0])
    dyn = model.embeddings
    assert dyn.optimizer_config == OptimizerConfig() and dyn.optimizer_source is None
    assert all(t.stats()["rows_device"] == 0 for t in dyn.tables.values())


def test_tables_held_by_two_param_groups_are_refused():
    model, _ = models(pooled=False)
    handles = model.embeddings.table_weights
    adam = torch.optim.Adam([{"params": [handles.t1], "lr": 0.1},  # noqa: F841
                      {"params": [handles.t2, *model.dense.parameters()], "lr": 0.2}])
    with pytest.raises(ValueError, match=r"held by Adam \(param group 0\) and Adam \(param "
                                         r"group 1\).*one optimizer"):
        model(batches(True)[0])
    assert all(t.stats()["rows_device"] == 0 for t in model.embeddings.tables.values())


def test_a_dense_optimizer_built_after_the_first_step_is_refused_at_its_step():
    model, _ = models(pooled=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(batches(True)[0]).backward()  # no optimizer anywhere: the default SGD
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    dense_before = model.dense.weight.detach().clone()
    model(batches(True)[1]).backward()
    with pytest.raises(ValueError, match=r"Adam holds the parameter of dynamic table 't1', "
                                         r"which it cannot train: the table already trains "
                                         r"with the default"):
        adam.step()
    assert torch.equal(model.dense.weight, dense_before)  # refused before any step
    assert model.embeddings.optimizer_config == OptimizerConfig()


def test_a_mark_wins_over_a_dense_optimizer_holding_the_tables():
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    model, _ = models(pooled=False)
    apply_optimizer_in_backward(torch.optim.Adagrad, model.embeddings.parameters(),
                                {"lr": 0.2})
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    model(batches(True)[0]).backward()
    adam.step()
    assert model.embeddings.optimizer_config == OptimizerConfig(
        OptimizerType.ADAGRAD, learning_rate=0.2, eps=1e-10)


def test_torchrecs_keyed_optimizer_wrapper_over_every_parameter_configures_the_tables():
    """TorchRec's DLRM example wraps its dense optimizer; the wrapper shares the inner
    optimizer's param groups, which configure the tables."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    model, _ = models(pooled=False)
    optimizer = CombinedOptimizer([KeyedOptimizerWrapper(  # noqa: F841 (held: found)
        dict(model.named_parameters()), lambda params: torch.optim.Adagrad(params, lr=0.2))])
    model(batches(False)[0]).backward()
    assert model.embeddings.optimizer_config == OptimizerConfig(
        OptimizerType.ADAGRAD, learning_rate=0.2, eps=1e-10)


def test_a_checkpoint_loads_into_a_fresh_model_whose_dense_optimizer_holds_the_tables():
    """Resuming: the model, its optimizer over every parameter, then the checkpoint; the
    load finds the tables built for that optimizer, and training goes on alike."""
    model, _ = models(pooled=False)
    adam = torch.optim.Adam(model.parameters(), lr=0.05)
    steps = batches(True)
    adam.zero_grad()
    model(steps[0]).backward()
    adam.step()
    resumed, _ = models(pooled=False)
    resumed_adam = torch.optim.Adam(resumed.parameters(), lr=0.05)
    resumed.load_state_dict(model.state_dict())
    resumed_adam.load_state_dict(adam.state_dict())
    for m, optimizer in ((model, adam), (resumed, resumed_adam)):
        optimizer.zero_grad()
        m(steps[1]).backward()
        optimizer.step()
    ids = torch.arange(NUM_IDS)
    for table in ("t1", "t2"):
        assert torch.equal(resumed.embeddings.read_rows(table, ids, with_state=True)[0],
                           model.embeddings.read_rows(table, ids, with_state=True)[0])
