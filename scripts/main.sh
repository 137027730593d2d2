#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the main job: the hash-table benchmark against a
# Python dict and torch sort+searchsorted. Extra arguments go to the benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m benchmarks.bench_hash_table "$@"
