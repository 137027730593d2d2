"""Writes ``checkpoint_fixtures/``: one checkpoint of each documented format, as the code at
commit 84785c9 writes them, with what they must give back
(``tests/test_checkpoint_fixtures.py`` loads them with today's code). A two-table
:class:`~dynemb.DynamicEmbCollection` (dims 4, Adam; ``b`` scored LFU) trains three steps,
then is saved as:

- ``state_dict.pt``: ``torch.save(module.state_dict())`` (the tables' layout format 2,
  :mod:`dynemb.checkpoint.table_state`);
- ``dcp/``: ``torch.distributed.checkpoint.save`` of ``{"model": module.state_dict(),
  "optim": module.fused_optimizer.state_dict()}``, by one process (the lr set to 0.03 first);
- ``dump_full/``: ``dynemb.checkpoint.dump`` (checkpoint files, format version 2,
  :mod:`dynemb.checkpoint.files`);

then it trains a fourth step and is dumped again as a delta of the first dump,
``dump_delta/``. ``expected.pt`` holds, at the save (``"saved"``) and after the fourth step
(``"after"``), every table's rows with their optimizer state (``read_rows(...,
with_state=True)`` of :data:`PROBE` keys, some never seen), the stats and the steps; and the
outputs of the fourth step (``"next_outputs"``).

Run it with the code whose formats it records first on the path, from a copy of that
commit::

    mkdir /tmp/dynemb-84785c9 && git archive 84785c9 | tar -x -C /tmp/dynemb-84785c9
    PYTHONPATH=/tmp/dynemb-84785c9 .venv/bin/python tests/data/make_checkpoint_fixtures.py \\
        tests/data/checkpoint_fixtures
"""
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torchrec import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig,
                    OptimizerType, ScorePolicy)
from dynemb.checkpoint import dump

TABLES = ("a", "b")
FEATURES = ("f_a", "f_b")
#: the keys read back: every trained key and some never seen
PROBE = torch.arange(-3, 45, dtype=torch.int64)
STEPS_BEFORE_SAVE = 3
SAVED_LR = 0.03


def make(backend=None, device=None) -> DynamicEmbCollection:
    """The collection the fixtures were written from (on ``backend`` / ``device``: a fresh
    one to load them into)."""
    configs = [EmbeddingConfig(name=name, embedding_dim=4, num_embeddings=64,
                               feature_names=[feature])
               for name, feature in zip(TABLES, FEATURES)]
    options = {"a": DynamicEmbTableOptions(),
               "b": DynamicEmbTableOptions(score_strategy=ScorePolicy.LFU)}
    return DynamicEmbCollection(configs, table_options=options,
                                optimizer=OptimizerConfig(OptimizerType.ADAM, learning_rate=0.05),
                                backend=backend,
                                device=torch.device("cpu") if device is None else device)


def batch(step: int, device=None) -> KeyedJaggedTensor:
    """Three samples of two ids per feature, partly new at each step."""
    ids_a = (torch.arange(6) * 7 + step * 3) % 40
    ids_b = (torch.arange(6) * 5 + step * 2) % 30
    return KeyedJaggedTensor.from_lengths_sync(
        list(FEATURES), torch.cat([ids_a, ids_b]).to(device), torch.full((6,), 2, device=device))


def train_step(module: DynamicEmbCollection, step: int) -> dict:
    """One training step; its outputs by feature, as copies."""
    out = module(batch(step, module.device))
    loss = sum((jt.values() ** 2).sum() + 0.1 * jt.values().sum() for jt in out.values())
    loss.backward()
    return {name: jt.values().detach().cpu().clone() for name, jt in out.items()}


def snapshot(module: DynamicEmbCollection) -> dict:
    """What a load must give back: each table's rows with optimizer state and which probe
    keys it holds, the stats and the steps."""
    rows = {}
    for name in TABLES:
        values, found = module.read_rows(name, PROBE.to(module.device), with_state=True)
        rows[name] = (values.cpu(), found.cpu())
    return {"rows": rows, "stats": module.stats(), "steps": dict(module.steps)}


def main(root: str) -> None:
    root = Path(root)
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    torch.manual_seed(0)
    module = make()
    for step in range(STEPS_BEFORE_SAVE):
        train_step(module, step)
    module.fused_optimizer.param_groups[0]["lr"] = SAVED_LR
    torch.save(module.state_dict(), root / "state_dict.pt")
    with warnings.catch_warnings():  # one process: DCP says it assumes so
        warnings.simplefilter("ignore")
        dcp.save({"model": module.state_dict(), "optim": module.fused_optimizer.state_dict()},
                 checkpoint_id=str(root / "dcp"))
    full = dump(module, root / "dump_full")
    expected = {"saved": snapshot(module), "lr": SAVED_LR}
    expected["next_outputs"] = train_step(module, STEPS_BEFORE_SAVE)
    dump(module, root / "dump_delta", since=full)
    expected["after"] = snapshot(module)
    torch.save(expected, root / "expected.pt")


if __name__ == "__main__":
    main(sys.argv[1])
