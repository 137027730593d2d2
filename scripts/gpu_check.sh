#!/usr/bin/env bash
# Every GPU check of dynemb in one command, on a machine with an NVIDIA GPU and no network:
# installs the wheels of gpu_kit/ (made by scripts/gpu_kit.sh), then runs the stages below,
# each under its own time limit, going on past a failing one. See docs/gpu.md.
#
#   bash scripts/gpu_check.sh                  # every stage
#   bash scripts/gpu_check.sh ptx tests        # some stages (install always runs first)
#   GPU_CHECK_SIMULATE=1 bash scripts/gpu_check.sh   # dry run without a GPU (numba's simulator)
#
# Stages, in the order they run when none is named (the extra sanitizers last, so a short
# budget drops them first): env ptx tests memcheck racecheck sync bench step tables ems
# synccheck initcheck. Named stages run in the order named.
# Writes into $OUT (default ./gpu_out): summary.txt (stage, PASS/FAIL/SKIP, seconds, note;
# the tail of each failed stage's log), env.txt, pytest.xml and logs.tar.gz (every log and
# JSON), refreshed after each stage so an interrupted run still leaves its results.
# Environment: PYTHON (default python3), GPU_KIT_DIR (gpu_kit), GPU_CHECK_BUDGET_S (1500:
# stages that would not end in time are skipped), GPU_CHECK_SIMULATE, GPU_CHECK_TEST_WORKERS
# (8: pytest-xdist processes of the tests stage, where the kit brought it).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
REPO=$(pwd)

PY=${PYTHON:-python3}
KIT=${GPU_KIT_DIR:-gpu_kit}
OUT=${OUT:-./gpu_out}
BUDGET=${GPU_CHECK_BUDGET_S:-1500}
SIMULATE=${GPU_CHECK_SIMULATE:-0}
SITE=${TMPDIR:-/tmp}/dynemb_gpu_site
WORK=${TMPDIR:-/tmp}/dynemb_gpu_work
ALL_STAGES=(env ptx tests memcheck racecheck sync bench step tables ems synccheck initcheck)
# The tests with a CUDA variant: the `backend` fixture's cuda ids, tests named after cuda,
# and those that take both entries of conftest.BACKENDS; the PTX test is the ptx stage's.
TEST_SELECTION='(cuda or backends_agree or sync_free_path) and not compiles_to_ptx'

mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd)
rm -rf "${WORK:?}"/*
SUMMARY=$WORK/summary.txt
START=$(date +%s)
unset NUMBA_ENABLE_CUDASIM
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# numba-cuda finds libnvvm through CUDA_HOME when no nvidia-nvvm wheel is installed
if [[ -z ${CUDA_HOME:-} && -d /usr/local/cuda ]]; then export CUDA_HOME=/usr/local/cuda; fi

log() { echo "[gpu_check $(($(date +%s) - START))s] $*"; }

# Copies the results into $OUT: at most a few files, since what comes back from a lent
# machine is limited in count.
publish() {
    cp -f "$SUMMARY" "$OUT/summary.txt" 2>/dev/null
    [[ -f $WORK/env.txt ]] && cp -f "$WORK/env.txt" "$OUT/env.txt"
    [[ -f $WORK/pytest.xml ]] && cp -f "$WORK/pytest.xml" "$OUT/pytest.xml"
    tar -czf "$OUT/logs.tar.gz" -C "$WORK" . 2>/dev/null
}

# stage NAME LIMIT_S COMMAND...: runs COMMAND with its output in $WORK/NAME.log, records
# PASS/FAIL/SKIP and the duration, never stops the script.
stage() {
    local name=$1 limit=$2; shift 2
    local left=$((BUDGET - ($(date +%s) - START) - 15))
    if (( left < 30 )); then
        record "$name" SKIP 0 "no time left in GPU_CHECK_BUDGET_S=$BUDGET"
        return
    fi
    (( limit > left )) && limit=$left
    log "$name (limit ${limit}s)"
    local t0 rc
    t0=$(date +%s)
    # a function runs in a child bash (they are exported) so that timeout can end it
    timeout -k 10 "$limit" bash -c '"$@"' stage "$@" > "$WORK/$name.log" 2>&1
    rc=$?
    local took=$(($(date +%s) - t0)) note="exit $rc"
    (( rc == 124 || rc == 137 )) && note="timed out after ${limit}s"
    [[ -f $WORK/$name.note ]] && note="$note; $(cat "$WORK/$name.note")"
    if (( rc == 0 )); then record "$name" PASS "$took" "$note"; else record "$name" FAIL "$took" "$note"; fi
}

record() {
    printf '%-10s %-4s %5ss  %s\n' "$1" "$2" "$3" "$4" | tee -a "$SUMMARY"
    if [[ $2 == FAIL && -f $WORK/$1.log ]]; then
        { echo "--- last lines of $1.log"; tail -n 15 "$WORK/$1.log"; echo "---"; } >> "$WORK/tails.txt"
    fi
    publish
}

skip() { record "$1" SKIP 0 "$2"; }

has_dist() {
    "$PY" - "$1" <<'EOF'
import importlib.metadata as m, sys
try:
    m.version(sys.argv[1])
except m.PackageNotFoundError:
    sys.exit(1)
EOF
}

dist_version() {
    "$PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$1"
}

# -- install --------------------------------------------------------------------------------
# The kit's wheels go into $SITE, put first on PYTHONPATH; the machine's own packages stay
# as they are. torchrec and fbgemm-gpu-cpu are always taken from the kit; the other wheels
# only fill gaps, so a package the machine has is never shadowed.
install_kit() {
    local wheels=() w dist
    [[ -d $KIT ]] || { echo "no $KIT/: run scripts/gpu_kit.sh where there is network and carry it"; return 1; }
    rm -rf "$SITE"; mkdir -p "$SITE"
    for w in "$KIT"/*.whl; do
        dist=$(basename "$w" | cut -d- -f1)
        case $dist in
            torchrec) wheels+=("$w") ;;
            fbgemm_gpu_cpu)
                if has_dist fbgemm-gpu; then echo "keeping the machine's fbgemm-gpu (CUDA build)"
                else wheels+=("$w"); fi ;;
            numba_cuda|numpy) ;;  # chosen by choose_numba_stack
            *) if has_dist "${dist//_/-}"; then echo "keeping the machine's ${dist//_/-} $(dist_version "${dist//_/-}")"
               else wheels+=("$w"); fi ;;
        esac
    done
    echo "installing into $SITE: ${wheels[*]##*/}"
    "$PY" -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target "$SITE" "${wheels[@]}" || return 1
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    choose_numba_stack
    install_dynemb || return 1
    local numba_path
    numba_path=$(cat "$WORK/numba_path" 2>/dev/null)
    PYTHONPATH="$numba_path${numba_path:+:}$PYTHONPATH" "$PY" -c "import torchrec, dynemb, dynemb.kernels
print('torchrec', torchrec.__version__, torchrec.__file__)
print('dynemb', dynemb.__file__, dynemb.kernels.__file__)"
}

# numba-cuda and numpy: the first of these that runs a kernel on the GPU (without one, that
# compiles one to PTX), the project's pin first. Its PYTHONPATH prefix goes to
# $WORK/numba_path.
choose_numba_stack() {
    local machine nc np pinned label prefix
    nc=$(ls "$KIT"/numba_cuda-*.whl 2>/dev/null | head -1)
    np=$(ls "$KIT"/numpy-*.whl 2>/dev/null | head -1)
    machine=$(dist_version numba-cuda)
    rm -rf "$SITE.numba_cuda" "$SITE.numpy"
    if [[ -n $nc && -z $machine ]]; then
        # numba.cuda reaches numba_cuda through a redirector that only an install in a site
        # directory sets up: with none on the machine, the pin goes into its environment
        "$PY" -m pip install --quiet --no-index --no-deps "$nc" && machine=$(dist_version numba-cuda)
        nc=""
    fi
    [[ -n $nc ]] && "$PY" -m pip install --quiet --no-index --no-deps --no-compile --target "$SITE.numba_cuda" "$nc"
    [[ -n $np ]] && "$PY" -m pip install --quiet --no-index --no-deps --no-compile --target "$SITE.numpy" "$np"
    pinned=$(basename "${nc:-x-none}" | cut -d- -f2)
    local candidates=()
    [[ -n $nc ]] && candidates+=("numba-cuda $pinned (kit), numpy $(dist_version numpy) (machine)|$SITE.numba_cuda")
    [[ -n $nc && -n $np ]] && candidates+=("numba-cuda $pinned and numpy (kit)|$SITE.numba_cuda:$SITE.numpy")
    candidates+=("numba-cuda ${machine:-none} and numpy $(dist_version numpy) (machine)|")
    [[ -n $np ]] && candidates+=("numba-cuda ${machine:-none} (machine), numpy (kit)|$SITE.numpy")
    local said
    for candidate in "${candidates[@]}"; do
        label=${candidate%%|*}; prefix=${candidate#*|}
        if said=$(PYTHONPATH="$prefix${prefix:+:}$PYTHONPATH" env -u NUMBA_ENABLE_CUDASIM \
                  "$PY" "$REPO/scripts/gpu_check_probe.py" numba-cuda 2>&1); then
            echo "numba stack: $label: $(tail -n 1 <<< "$said")"
            echo "$prefix" > "$WORK/numba_path"
            return
        fi
        echo "numba stack: $label fails here: $(tail -n 1 <<< "$said")"
    done
    echo "numba stack: nothing runs a kernel; keeping the machine's"; : > "$WORK/numba_path"
    return 1
}

# dynemb.kernels is the top-level kernels/ folder mapped by setuptools: an editable install
# makes that mapping (setuptools is on the machine, no download needed).
install_dynemb() {
    if "$PY" -m pip install --quiet --no-index --no-deps --no-build-isolation -e "$REPO"; then
        echo "dynemb: editable install of $REPO"
    else
        echo "dynemb: the editable install failed" >&2
        return 1
    fi
}

# -- the stages -----------------------------------------------------------------------------
run_env() {
    {
        echo "date: $(date -u +%FT%TZ)"; echo "repo: $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
        echo "== nvidia-smi"; nvidia-smi 2>&1 || echo "(no nvidia-smi)"
        echo "== python packages"; "$PY" "$REPO/scripts/gpu_check_probe.py" versions
        echo "== compute-sanitizer"; compute-sanitizer --version 2>&1 | tail -2 || true
        echo "== ncu"; ncu --version 2>&1 | tail -1 || true
        echo "== install"; cat "$WORK/install.log" 2>/dev/null
        echo "== numba -s (CUDA part)"; "$PY" -m numba -s 2>&1 | sed -n '/__CUDA Information__/,/__SVML/p' | head -60
    } > "$WORK/env.txt" 2>&1
    cat "$WORK/env.txt"
}

run_ptx() {
    local cc
    cc=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())" 2>/dev/null || echo 9.0)
    env -u NUMBA_ENABLE_CUDASIM "$PY" -m dynemb.kernels.ptx_check --cc "$cc"
}

run_tests() {
    # only the files with a CUDA path: a module that fails to import against the kit's
    # older torchrec / fbgemm is then one reported error, not the end of the run
    local files args=(-q -p no:cacheprovider -k "$TEST_SELECTION" --continue-on-collection-errors
                      --junitxml "$WORK/pytest.xml" -o junit_family=xunit1)
    mapfile -t files < <(grep -lE 'cuda|BACKENDS|make_table|to_dev|\bbackend\b' tests/test_*.py)
    "$PY" -c "import pytest_timeout" 2>/dev/null && args+=(--timeout 240)
    # parallel processes (the kit's pytest-xdist): the stage is mostly compiling kernels
    "$PY" -c "import xdist" 2>/dev/null && args+=(-n "${GPU_CHECK_TEST_WORKERS:-8}")
    if [[ $SIMULATE == 1 ]]; then
        NUMBA_ENABLE_CUDASIM=1 "$PY" -m pytest "${args[@]}" "${files[@]}"
    else
        DYNEMB_REAL_CUDA=1 "$PY" -m pytest "${args[@]}" "${files[@]}"
    fi
    local rc=$?
    "$PY" "$REPO/scripts/gpu_check_probe.py" junit "$WORK/pytest.xml" > "$WORK/tests.note" 2>&1
    cat "$WORK/tests.note"
    return $rc
}

run_sanitizer() {
    local tool=$1
    local env=()
    # every tensor its own allocation, so an access past one lands outside any allocation
    [[ $tool == memcheck || $tool == initcheck ]] && env=(PYTORCH_NO_CUDA_MEMORY_CACHING=1)
    # --report-api-errors no: numba probes the driver's entry points, and each probe that
    # finds none is a failed API call that the sanitizer would count as an error
    env "${env[@]}" compute-sanitizer --tool "$tool" --error-exitcode 86 --print-limit 30 \
        --report-api-errors no \
        --target-processes all "$PY" -m scripts.gpu_sanitize --json "$WORK/sanitize_$tool.json"
}

run_sync() {
    if [[ $SIMULATE == 1 ]]; then
        "$PY" -m scripts.gpu_sync_check --device cpu --backend cuda --batch 4 --length 2 --dim 4 \
            --warmup 1 --steps 1 --timed-steps 1 --json "$WORK/sync.json"
    else
        "$PY" -m scripts.gpu_sync_check --json "$WORK/sync.json"
    fi
}

run_bench() {
    if [[ $SIMULATE == 1 ]]; then
        "$PY" -m scripts.gpu_bench --device cpu --backend cuda --capacity-log2 9 --batch-log2 6 \
            --repeats 1 --json "$WORK/bench_hash_table.json"
        return
    fi
    local rc=0
    "$PY" -m scripts.gpu_bench --json "$WORK/bench_hash_table.json" || rc=1
    # the collection step at bench_collection's default workload, timing only
    for opt in sgd adam; do
        "$PY" -m scripts.gpu_sync_check --batch 4096 --length 20 --dim 128 --optimizer "$opt" \
            --warmup 6 --steps 0 --timed-steps 36 --profiled-steps 3 \
            --json "$WORK/bench_step_$opt.json" || rc=1
    done
    # the same SGD step with numba's own launch of every kernel (dynemb.bridges.numba_launch off)
    DYNEMB_DIRECT_LAUNCH=0 "$PY" -m scripts.gpu_sync_check --batch 4096 --length 20 --dim 128 \
        --optimizer sgd --warmup 6 --steps 0 --timed-steps 36 --profiled-steps 3 \
        --json "$WORK/bench_step_sgd_numba_launch.json" || rc=1
    return $rc
}

# the training step against nn.Embedding(sparse=True) on five workloads
# (benchmarks/bench_gpu.py), then find_or_insert at 2^26 slots, load 0.5, 2^20 keys a call
run_step() {
    if [[ $SIMULATE == 1 ]]; then
        "$PY" -m benchmarks.bench_gpu --device cpu --backend cuda --scale 0.002 --rounds 1 \
            --warmup 1 --steps 1 --profiled-steps 1 --batches 1 --workloads T1_82k_sgd T26_sgd \
            --json "$WORK/gpu_step.json"
        return
    fi
    local rc=0
    "$PY" -m benchmarks.bench_gpu --json "$WORK/gpu_step.json" --plot "$WORK/gpu_step.png" || rc=1
    "$PY" -m benchmarks.step_census --device cuda --scale 1 \
        --workloads T1_82k_sgd T26_sgd T256_sgd --json "$WORK/step_census.json" || rc=1
    "$PY" -m scripts.gpu_bench --capacity-log2 26 --batch-log2 20 \
        --json "$WORK/bench_hash_table_2e26.json" || rc=1
    return $rc
}

# many tables: step time and kernels per step against the table count (scripts/gpu_tables.py)
run_tables() {
    if [[ $SIMULATE == 1 ]]; then
        "$PY" -m scripts.gpu_tables --device cpu --backend cuda --tables 1 4 --ids 256 \
            --batch 16 --warmup 1 --steps 1 --profiled-steps 1 --json "$WORK/tables_cuda.json"
    else
        "$PY" -m scripts.gpu_tables --json "$WORK/tables_cuda.json" --plot "$WORK/tables_cuda.png"
    fi
}

# memory stashing: stash / restore bandwidth under set_sync_debug_mode("error"), and the device
# peak and step time of a model with and without stashing (benchmarks/bench_ems.py)
run_ems() {
    if [[ $SIMULATE == 1 ]]; then
        "$PY" -m benchmarks.bench_ems --quick --out-dir "$WORK/ems"
    else
        "$PY" -m benchmarks.bench_ems --device cuda --sync-debug --out-dir "$WORK/ems"
    fi
}

run_named() {
    case $1 in
        env) stage env 120 run_env ;;
        ptx) stage ptx 300 run_ptx ;;
        tests) stage tests 600 run_tests ;;
        sync) stage sync 300 run_sync ;;
        bench) stage bench 420 run_bench ;;
        step) stage step 300 run_step ;;
        tables) stage tables 300 run_tables ;;
        ems) stage ems 300 run_ems ;;
        *)
            if [[ $SIMULATE == 1 ]]; then skip "$1" "simulate: no GPU to sanitize"
            elif ! command -v compute-sanitizer > /dev/null; then skip "$1" "no compute-sanitizer on the PATH"
            else stage "$1" 300 run_sanitizer "$1"
            fi ;;
    esac
}

main() {
    STAGES=("$@")
    (( ${#STAGES[@]} )) || STAGES=("${ALL_STAGES[@]}")
    for s in "${STAGES[@]}"; do
        [[ " ${ALL_STAGES[*]} " == *" $s "* ]] || { echo "unknown stage $s (stages: ${ALL_STAGES[*]})" >&2; exit 2; }
    done
    printf '%-10s %-4s %6s  %s\n' stage res time note > "$SUMMARY"
    [[ $SIMULATE == 1 ]] && export NUMBA_ENABLE_CUDASIM=1 && log "simulate: numba's CUDA simulator, no GPU"
    stage install 300 install_kit
    [[ -f $WORK/install.log ]] && cat "$WORK/install.log"
    # install_kit ran in a subshell of `timeout`: set its PYTHONPATH here too
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    numba_path=$(cat "$WORK/numba_path" 2>/dev/null)
    [[ -n $numba_path ]] && export PYTHONPATH="$numba_path:$PYTHONPATH"
    # stages named on the command line run in that order (the most wanted first, so a short
    # budget drops the others); with none named, every stage in the order of ALL_STAGES
    for s in "${STAGES[@]}"; do
        run_named "$s"
    done
    [[ -f $WORK/tails.txt ]] && cat "$WORK/tails.txt" >> "$SUMMARY"
    echo "total $(($(date +%s) - START))s" >> "$SUMMARY"
    publish
    echo; cat "$OUT/summary.txt"
    ! grep -qE '^[a-z]+ +FAIL' "$SUMMARY"
}

export -f install_kit choose_numba_stack install_dynemb has_dist dist_version run_env run_ptx \
    run_tests run_sanitizer run_sync run_bench run_step run_tables run_ems
export PY KIT SITE WORK REPO SIMULATE TEST_SELECTION
main "$@"
