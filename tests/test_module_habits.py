"""What users do to any nn.Module, done to a DynamicEmbCollection: ``.to()``, ``.half()``,
``.cuda()``, ``to_empty``... raise instead of being silently ignored (the tables are not
parameters); conversions that change nothing keep working; ``torch.compile`` of a model
holding one trains as the eager model."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrec import EmbeddingConfig

from dynemb import DynamicEmbCollection, DynamicEmbTableOptions
from test_collection import INIT, SGD, kjt, train_step

DIM = 4


def make(device=None):
    tables = [EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=256,
                              feature_names=["f"])]
    return DynamicEmbCollection(tables, device, optimizer=SGD,
                                table_options=DynamicEmbTableOptions(initializer=INIT))


class Parent(torch.nn.Module):
    def __init__(self, ec):
        super().__init__()
        self.ec = ec
        self.dense = torch.nn.Linear(DIM, 1)


DTYPE_CHANGES = {
    "to_float16": lambda m: m.to(torch.float16),
    "to_dtype_kwarg": lambda m: m.to(dtype=torch.bfloat16),
    "half": lambda m: m.half(),
    "bfloat16": lambda m: m.bfloat16(),
    "double": lambda m: m.double(),
    "type": lambda m: m.type(torch.float16),
}
DEVICE_CHANGES = {
    "to_meta": lambda m: m.to("meta"),
    "to_meta_device": lambda m: m.to(torch.device("meta")),
    "to_empty_meta": lambda m: m.to_empty(device="meta"),
}
NO_OPS = {
    "to_cpu": lambda m: m.to("cpu"),
    "to_cpu_float32": lambda m: m.to("cpu", torch.float32),
    "float": lambda m: m.float(),
    "cpu": lambda m: m.cpu(),
    "train_eval": lambda m: m.eval().train(),
    "requires_grad": lambda m: m.requires_grad_(True),
}


@pytest.mark.parametrize("convert", DTYPE_CHANGES.values(), ids=DTYPE_CHANGES.keys())
@pytest.mark.parametrize("wrap", [False, True], ids=["alone", "in_parent"])
def test_dtype_conversion_raises_and_names_embedding_dtype(convert, wrap):
    ec = make()
    train_step(ec, [1, 2, 3])
    before = ec.read_rows("t", torch.tensor([1, 2, 3]))[0].clone()
    with pytest.raises(RuntimeError, match=r"cannot be converted to torch\.\w+.*"
                                           r"DynamicEmbTableOptions\(embedding_dtype=\.\.\.\)"):
        convert(Parent(ec) if wrap else ec)
    torch.testing.assert_close(ec.read_rows("t", torch.tensor([1, 2, 3]))[0], before)
    train_step(ec, [1, 4])  # still usable


@pytest.mark.parametrize("convert", DEVICE_CHANGES.values(), ids=DEVICE_CHANGES.keys())
@pytest.mark.parametrize("wrap", [False, True], ids=["alone", "in_parent"])
def test_device_move_raises_and_names_both_devices(convert, wrap):
    ec = make()
    train_step(ec, [1, 2, 3])
    with pytest.raises(RuntimeError, match=r"is on cpu and cannot be moved to meta.*"
                                           r"build it on the target device.*"
                                           r"DistributedModelParallel"):
        convert(Parent(ec) if wrap else ec)
    assert ec.device == torch.device("cpu")
    train_step(ec, [1, 4])


def test_cuda_raises_with_the_supported_ways():
    ec = make()
    if torch.cuda.is_available():
        match = r"is on cpu and cannot be moved to cuda:0"
    else:  # the move itself fails; the message still says what to do
        match = r"on cpu cannot be moved or converted by this call"
    with pytest.raises(RuntimeError, match=match + r".*build it on the target device"):
        ec.cuda()


@pytest.mark.parametrize("convert", NO_OPS.values(), ids=NO_OPS.keys())
def test_conversions_that_change_nothing_still_work(convert):
    ec, ref = make(), make()
    parent = Parent(ec)
    assert convert(parent) is parent and convert(ec) is ec
    out = train_step(ec, [1, 2, 2])
    torch.testing.assert_close(out["f"].values(), train_step(ref, [1, 2, 2])["f"].values())
    assert ec.stats()["t"]["rows_device"] == 2


def test_meta_collection_converts_only_to_meta():
    ec = make("meta")
    assert ec.to("meta") is ec and ec.float() is ec
    with pytest.raises(RuntimeError, match="is on meta and cannot be moved to cpu"):
        ec.to("cpu")
    with pytest.raises(RuntimeError, match="cannot be converted to torch.float16"):
        ec.half()
    assert ec.device == torch.device("meta")  # to_empty materializes it (dropin tests)


# -- torch.compile -----------------------------------------------------------------------------
class PooledMLP(torch.nn.Module):
    """Sum-pools each sample's embeddings, then a small MLP: the dense part compiles, the
    collection runs eagerly between the graphs."""

    def __init__(self, ec):
        super().__init__()
        self.ec = ec
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 8), torch.nn.ReLU(),
                                       torch.nn.Linear(8, 1))

    def forward(self, batch, labels):
        jt = self.ec(batch)["f"]
        lengths = jt.lengths()
        sample = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        pooled = torch.zeros(lengths.numel(), DIM).index_add(0, sample, jt.values())
        logits = self.mlp(pooled).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)


def _train(model, batches):
    dense_opt = torch.optim.SGD(model.mlp.parameters(), lr=0.1)
    losses = []
    for ids, lengths, labels in batches:
        loss = model(kjt(ids, lengths=lengths), labels)
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def test_compiled_model_trains_like_the_eager_one():
    _in_a_fresh_interpreter("test_module_habits", "compiled_then_eager")


def _in_a_fresh_interpreter(module, function):
    """torch.compile used to fail on the first call of each numba kernel in a process, which
    earlier tests of the session have made: run the check where none has been called."""
    here = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parent), str(here)]))
    done = subprocess.run([sys.executable, "-c", f"import {module}; {module}.{function}()"],
                          cwd=here.parent, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


def compiled_then_eager():
    """The default backend (inductor): it compiles this model in seconds on CPU."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        lengths = torch.randint(1, 4, (6,), generator=g)
        batches.append((torch.randint(0, 40, (int(lengths.sum()),), generator=g),
                        lengths.tolist(), torch.randint(0, 2, (6,), generator=g).float()))
    torch.manual_seed(0)
    compiled = PooledMLP(make())
    torch.manual_seed(0)
    eager = PooledMLP(make())
    got = _train(torch.compile(compiled), batches)
    want = _train(eager, batches)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    ids = torch.arange(40)
    rows, found = compiled.ec.read_rows("t", ids)
    want_rows, want_found = eager.ec.read_rows("t", ids)
    assert torch.equal(found, want_found) and bool(found.any())
    torch.testing.assert_close(rows, want_rows, rtol=1e-5, atol=1e-6)
    assert compiled.ec.stats()["t"] == eager.ec.stats()["t"]
