#!/usr/bin/env bash
# Downloads into gpu_kit/ (ignored by git) the wheels a lent GPU machine lacks, built for
# ITS Python (3.12) and torch (2.11); that machine reaches no registry, so they travel with
# the working tree (`carry: ["gpu_kit"]`) and scripts/gpu_check.sh installs them there.
# Run it here, where the registries are reachable. Idempotent: wheels already present are
# kept, wheels of other versions are removed. Fails if the kit would not travel (> 60 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."

KIT=${GPU_KIT_DIR:-gpu_kit}
MAX_MIB=60
PY=${PYTHON:-}
if [[ -z $PY ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi

# name==version, one wheel each. torchrec and fbgemm release together with torch: fbgemm
# 1.6 is the release for torch 2.11 (its own compatibility table in fbgemm_gpu/__init__.py
# of 1.7 and later), torchrec 1.6.1 the torchrec of that release. The CPU build of fbgemm
# only lets `import torchrec` work: its ops run on CPU tensors alone.
CORE=(
    torchrec==1.6.1
    fbgemm-gpu-cpu==1.6.0
)
# What `import dynemb` pulls in through torchrec, plus torchrec's declared pins. The machine
# had most of them when last listed; gpu_check.sh installs one only where it is missing.
DEPS=(
    tensordict==0.15.3
    pyvers==0.2.3
    torchmetrics==1.0.3
    pyre-extensions==0.0.32
    typing-inspect==0.9.0
    mypy-extensions==1.2.0
    tqdm==4.70.1
)
# Runs the `tests` stage in parallel processes: most of its time is compiling kernels, one
# core at a time in one process.
TEST_TOOLS=(
    pytest-xdist==3.8.0
    execnet==2.1.2
)
# The numba-cuda this project pins (the machine has its own, of unknown version), and a
# numpy it imports with: numba-cuda 0.30.4's CUDA target uses np.row_stack, gone in numpy
# 2.5, which the machine had when last listed. gpu_check.sh takes them only if they run a
# kernel there and the machine's own do not.
PINNED=(
    numba-cuda==0.30.4
    numpy==2.4.6
)
ALL=("${CORE[@]}" "${DEPS[@]}" "${TEST_TOOLS[@]}" "${PINNED[@]}")

PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64
           manylinux_2_17_x86_64 manylinux2014_x86_64)

# The file-name stem of a requirement's wheel: lower case, '-' and '.' in the name as '_'.
stem() {
    local name=${1%%==*} version=${1##*==}
    name=$(tr 'A-Z.-' 'a-z__' <<< "$name")
    echo "${name}-${version}"
}

have() {
    compgen -G "$KIT/$(stem "$1")-*.whl" > /dev/null
}

fetch() {
    local args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
                --abi cp312 --abi abi3 --abi none -d "$KIT" --quiet)
    local p
    for p in "${PLATFORMS[@]}"; do args+=(--platform "$p"); done
    "$PY" -m pip download "${args[@]}" "$1"
}

# Wheels in the kit that no requirement names (an older pin): two versions of one package
# would stop the install there.
prune() {
    local keep=() f base r wanted
    for r in "${ALL[@]}"; do keep+=("$(stem "$r")"); done
    for f in "$KIT"/*.whl; do
        [[ -e $f ]] || continue
        base=$(basename "$f" | cut -d- -f1-2 | tr 'A-Z' 'a-z')
        wanted=0
        for r in "${keep[@]}"; do [[ $base == "$r" ]] && wanted=1; done
        if (( ! wanted )); then echo "removing $(basename "$f") (not in the kit)"; rm -f "$f"; fi
    done
}

mkdir -p "$KIT"
prune
for req in "${ALL[@]}"; do
    if have "$req"; then
        echo "have  $req"
    else
        echo "fetch $req"
        fetch "$req"
        have "$req" || { echo "no wheel named $(stem "$req")-*.whl after downloading $req" >&2; exit 1; }
    fi
done

(cd "$KIT" && ls -l *.whl | awk '{printf "%10d  %s\n", $5, $9}' && sha256sum *.whl) > "$KIT/MANIFEST.txt"
bytes=$(du -cb "$KIT" | tail -1 | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "kit: $KIT, $(ls "$KIT"/*.whl | wc -l) wheels, $mib MiB"
if (( bytes > MAX_MIB * 1048576 )); then
    echo "the kit is over $MAX_MIB MiB: it would not travel with the working tree (64 MiB)" >&2
    exit 1
fi
