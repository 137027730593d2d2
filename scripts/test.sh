#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the whole test suite and the docstring examples of
# dynemb/ (doctests; their names come from the root conftest.py), one pytest-xdist process per
# core, each test file in one process (its module fixtures run once). Extra arguments go to
# pytest (`-n 0`: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests dynemb --doctest-modules -n auto --dist loadfile "$@"
