"""Draw docs/architecture.png: dynemb's layers (docs/architecture.md's table), bottom to top,
each with its modules and how many imports it makes into each layer below, counted on the
source (the same reading tests/test_architecture.py checks).

    python scripts/architecture_picture.py [--out docs/architecture.png]
"""
from __future__ import annotations

import argparse
import collections
import sys
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.test_architecture import LAYERS, dynemb_imports, layer_of, sources  # noqa: E402


def layer_imports():
    """``{(from layer, to layer): number of imports}`` and each layer's modules."""
    counts = collections.Counter()
    members = collections.defaultdict(set)
    for module, _, tree in sources():
        mine = layer_of(module)
        short = module.split(".")[1] if "." in module else module
        members[mine].add(short)
        for _, imported in dynemb_imports(tree, module):
            counts[(mine, layer_of(imported))] += 1
    members[0].add("kernels")
    return counts, members


def draw(out: Path) -> None:
    counts, members = layer_imports()
    height, gap, width = 1.25, 0.35, 10.0
    fig, ax = plt.subplots(figsize=(11, len(LAYERS) * (height + gap) * 0.85))
    for index, (name, _) in enumerate(LAYERS):
        y = index * (height + gap)
        ax.add_patch(FancyBboxPatch((0.8, y), width, height, boxstyle="round,pad=0.02",
                                    facecolor=plt.cm.Blues(0.15 + 0.08 * index),
                                    edgecolor="#335"))
        ax.text(1.0, y + height - 0.22, name, fontsize=12, fontweight="bold", va="top")
        modules = ", ".join(sorted(members[index]))
        ax.text(1.0, y + height - 0.55, textwrap.fill(modules, 105), fontsize=7.5, va="top",
                family="monospace")
        below = [(LAYERS[j][0], n) for (i, j), n in sorted(counts.items())
                 if i == index and j < index]
        if below:
            ax.text(width + 0.7, y + 0.1, "imports: " + ", ".join(
                f"{target} {n}" for target, n in below), fontsize=7, ha="right",
                color="#224", style="italic")
    top = len(LAYERS) * (height + gap) - gap
    ax.add_patch(FancyArrowPatch((0.35, top), (0.35, 0.0), arrowstyle="-|>",
                                 mutation_scale=25, linewidth=2.5, color="#335"))
    ax.text(0.15, top / 2, "imports run down only", rotation=90, va="center", ha="center",
            fontsize=10)
    ax.set_xlim(0, width + 1.0)
    ax.set_ylim(-0.2, top + 0.2)
    ax.axis("off")
    ax.set_title("dynemb: layers, bottom to top", fontsize=14)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "architecture.png")
    draw(parser.parse_args().out)


if __name__ == "__main__":
    main()
