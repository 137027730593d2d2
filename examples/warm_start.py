"""Warm start: a trained TorchRec ``EmbeddingCollection`` becomes a ``DynamicEmbCollection``
that keeps its rows and trains on, where new ids keep arriving.

The task is a synthetic one whose answer is known: every item has a hidden vector, and the
loss of a batch is the squared distance between the items' embeddings and their vectors.

1. **TorchRec**: an ``EmbeddingCollection`` of ``--items`` rows trains on the items it knows
   (ids ``0 .. items - 1``, their rows in a fixed table, SGD), then saves its ``state_dict``
   (the trained checkpoint a TorchRec user has).
2. **dynemb, warm-started**: a ``DynamicEmbCollection`` of the same config is filled from
   that ``state_dict`` with ``dynemb.warm_start``: row ``i`` becomes the item's raw id
   (``ids={"item": raw_ids}``, the 64-bit ids the fixed table's row numbers stood for).
   It trains on a stream of raw ids in which new items (never in the fixed table) keep
   arriving: they get rows on first sight, as dynamic tables do.
3. **dynemb, cold**: the same module and stream without the warm start, for comparison.

The warm-started module starts where TorchRec stopped (its loss over the known items is
TorchRec's, exactly), the cold one from scratch; on the stream, only the new items' rows are
left to learn.

Run::

    python examples/warm_start.py            # a few seconds
    python examples/warm_start.py --quick    # a smoke run

Writes ``<out-dir>/warm_start.json`` (the losses, and the warm start's rows checked against
TorchRec's) and ``<out-dir>/warm_start.png`` (the three loss curves); ``main()`` returns the
metrics.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see docs/gpu.md

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Dict, List, Optional  # noqa: E402

import torch  # noqa: E402
from torchrec import EmbeddingCollection, EmbeddingConfig  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402
from tqdm import tqdm  # noqa: E402

import dynemb  # noqa: E402
from dynemb import (DynamicEmbCollection, DynamicEmbTableOptions, OptimizerConfig,  # noqa: E402
                    OptimizerType)

OUT_DIR = Path(__file__).resolve().parent / "output"
DIM = 16
LR = 0.2
RAW_ID_BASE = 10 ** 12  # raw ids: far beyond any fixed table's rows


def raw_id(index: torch.Tensor) -> torch.Tensor:
    """The 64-bit raw id of item ``index`` (what a fixed table's row number stood for)."""
    return RAW_ID_BASE + index * 7919


def config(items: int) -> EmbeddingConfig:
    return EmbeddingConfig(name="item", embedding_dim=DIM, num_embeddings=items,
                           feature_names=["item"], weight_init_min=-0.1, weight_init_max=0.1)


def batch_of(indices: torch.Tensor, raw: bool) -> KeyedJaggedTensor:
    ids = raw_id(indices) if raw else indices
    return KeyedJaggedTensor.from_lengths_sync(["item"], ids, torch.ones_like(ids))


def loss_of(module, indices: torch.Tensor, targets: torch.Tensor, raw: bool) -> torch.Tensor:
    rows = module(batch_of(indices, raw))["item"].values()
    return ((rows - targets[indices]) ** 2).sum(1).mean()


def train_torchrec(items: int, steps: int, batch: int, targets: torch.Tensor,
                   gen: torch.Generator) -> (EmbeddingCollection, List[float]):
    torch.manual_seed(0)
    ec = EmbeddingCollection(tables=[config(items)])
    optimizer = torch.optim.SGD(ec.parameters(), lr=LR * batch)  # per-row step as dynemb's
    losses = []
    for _ in tqdm(range(steps), desc="torchrec", leave=False):
        indices = torch.randint(0, items, (batch,), generator=gen)
        loss = loss_of(ec, indices, targets, raw=False)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return ec, losses


def train_dynemb(module: DynamicEmbCollection, steps: int, batch: int, items: int,
                 targets: torch.Tensor, new_share: float, seed: int, desc: str) -> List[float]:
    """Steps on raw ids: a ``new_share`` of each batch are items the fixed table never had."""
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in tqdm(range(steps), desc=desc, leave=False):
        known = torch.randint(0, items, (batch,), generator=gen)
        new = torch.randint(items, targets.shape[0], (batch,), generator=gen)
        indices = torch.where(torch.rand(batch, generator=gen) < new_share, new, known)
        loss = loss_of(module, indices, targets, raw=True)
        (loss * batch).backward()  # the fused SGD steps each row by lr x its gradient
        losses.append(loss.item())
    return losses


def dynamic_module() -> DynamicEmbCollection:
    return DynamicEmbCollection(
        [config(1)], optimizer=OptimizerConfig(OptimizerType.SGD, learning_rate=LR),
        table_options=DynamicEmbTableOptions(max_capacity=1 << 14))


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    items, steps = (200, 60) if args.quick else (args.items, args.steps)
    gen = torch.Generator().manual_seed(args.seed)
    targets = torch.randn(items * 2, DIM, generator=gen) * 0.3  # known items, then new ones
    ec, torchrec_losses = train_torchrec(items, steps, args.batch, targets, gen)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = out_dir / "torchrec_ec.pt"
    torch.save(ec.state_dict(), checkpoint)

    warm = dynamic_module()
    written = dynemb.warm_start(warm, torch.load(checkpoint),
                                ids={"item": raw_id(torch.arange(items))})
    rows, found = warm.read_rows("item", raw_id(torch.arange(items)))
    same_rows = bool(found.all()) and torch.equal(rows, ec.embeddings["item"].weight.detach())
    known = torch.arange(items)
    with torch.no_grad():  # every known item, before dynemb trains: TorchRec's rows, or none
        known_torchrec = loss_of(ec, known, targets, raw=False).item()
        known_warm = loss_of(warm.eval(), known, targets, raw=True).item()
        known_cold = loss_of(dynamic_module().eval(), known, targets, raw=True).item()
    warm.train()
    warm_losses = train_dynemb(warm, steps, args.batch, items, targets, args.new_share,
                               args.seed + 1, "dynemb, warm")
    cold_losses = train_dynemb(dynamic_module(), steps, args.batch, items, targets,
                               args.new_share, args.seed + 1, "dynemb, cold")
    metrics = {"items": items, "steps": steps, "rows_written": written["item"],
               "warm_rows_equal_torchrec": same_rows, "known_loss_torchrec": known_torchrec,
               "known_loss_warm": known_warm, "known_loss_cold": known_cold,
               "torchrec_losses": torchrec_losses, "warm_losses": warm_losses,
               "cold_losses": cold_losses, "stats": warm.stats()["item"]}
    (out_dir / "warm_start.json").write_text(json.dumps(metrics, indent=1, default=str))
    plot(metrics, out_dir / "warm_start.png")
    print(f"rows written: {written['item']}, equal to TorchRec's: {same_rows}")
    print(f"loss over the known items: TorchRec {known_torchrec:.4f}, warm-started "
          f"{known_warm:.4f}, cold {known_cold:.4f}")
    print(f"stream loss: TorchRec last {torchrec_losses[-1]:.4f}, warm first {warm_losses[0]:.4f}, "
          f"cold first {cold_losses[0]:.4f}; after {steps} steps warm {warm_losses[-1]:.4f}, "
          f"cold {cold_losses[-1]:.4f}")
    return metrics


def plot(metrics: Dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = metrics["steps"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(steps), metrics["torchrec_losses"], label="TorchRec EmbeddingCollection")
    after = range(steps, 2 * steps)
    ax.plot(after, metrics["warm_losses"], label="DynamicEmbCollection, warm-started")
    ax.plot(after, metrics["cold_losses"], label="DynamicEmbCollection, cold", linestyle="--")
    ax.axvline(steps, color="grey", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=2000, help="rows of the TorchRec table")
    parser.add_argument("--steps", type=int, default=300, help="steps of each phase")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-share", type=float, default=0.2,
                        help="share of each dynemb batch that are items new to the table")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--out-dir", default=str(OUT_DIR))
    args = parser.parse_args(argv)
    for name in ("items", "steps", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be positive")
    if not 0 <= args.new_share <= 1:
        parser.error("--new-share must lie in [0, 1]")
    return args


if __name__ == "__main__":
    main()
