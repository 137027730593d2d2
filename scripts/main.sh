#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the main job: trains a next-item recommender whose
# item and user embeddings live in dynamic tables sharded row-wise over 2 CPU ranks (spawned by
# the example, gloo) under TorchRec's TrainPipelineSparseDist (examples/train_sharded.py), on a
# synthetic stream. Extra arguments go to the example (--quick, --steps N, --seed S,
# --out-dir D, --nproc N, --pipeline prefetch).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/train_sharded.py "$@"
