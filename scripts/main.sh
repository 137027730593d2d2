#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the main job: trains a next-item recommender whose
# item and user embeddings live in dynamic tables (examples/train_next_item.py) on a synthetic
# stream, on CPU. Extra arguments go to the example (--quick, --steps N, --seed S, --out-dir D).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/train_next_item.py "$@"
