#!/usr/bin/env bash
# Creates .venv inside the checkout and installs dynemb with its CPU, disk-store and test
# dependencies.
# Idempotent: a second run with an unchanged pyproject.toml does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.dynemb-installed
want=$(sha256sum pyproject.toml setup.py scripts/setup.sh | sha256sum | cut -c1-16)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
    exit 0
fi
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet)
# Pinned first so nothing below pulls a CUDA build of torch on a CPU machine.
"${pip[@]}" torch==2.13.0
"${pip[@]}" -e ".[cpu,test,disk]"
# torchrec's metadata requires the CUDA fbgemm-gpu wheel; its real needs are installed above.
"${pip[@]}" --no-deps torchrec==1.8.0
echo "$want" > "$stamp"
