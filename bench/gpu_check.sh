#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one prepared run (a lent GPU machine's minutes are few).
#
#   bash bench/gpu_check.sh prepare   # here: fills .gpu/ (git-ignored) with what the run needs
#   bash bench/gpu_check.sh run       # there, from the repository root, with .gpu carried
#
# prepare: stories260K (for tests/test_gpu.py), SmolLM2's first four layers in bfloat16 (the
# real weights bench/compress_gpu.py decodes), and wheels of the packages the engine imports
# that a CUDA image may lack (orjson, llguidance; Python 3.12, manylinux x86-64).
# run: the GPU tests, then bench.compress_gpu, bench.kernels and bench.coldstart --device cuda
# (weights read onto the GPU through pinned buffers), each with a time limit, each
# one's whole output under $OUT (or .gpu/out); environment: SKIP1B=1 leaves out the 1.1B-shape
# decode step of bench.compress_gpu (~55 s of encoding on the host with numpy's packer, where
# the C++ extension is not built yet), TESTK selects tests (-k),
# NO_KERNELS=1 leaves out bench.kernels, NO_COLDSTART=1 bench.coldstart. The limits add up to
# 590 s (a device call may run 600 s); the parts took ~4-5 min together on an H200.
set -u
cd "$(dirname "$0")/.." || exit 1
case "${1:-}" in
prepare)
    py=.venv/bin/python
    mkdir -p .gpu/whl
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
    chmod -R u+w .gpu 2>/dev/null; rm -rf .gpu/stories260K
    cp -r --no-preserve=mode ../shared/models/stories260K .gpu/ || exit 1
    "$py" -m bench.compress_gpu --save-layers .gpu/smollm2_layers0-3.safetensors || exit 1
    for pkg in orjson llguidance; do
        version=$("$py" -m pip show "$pkg" | awk '/^Version/{print $2}')
        "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp -d .gpu/whl "$pkg==$version" \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 || exit 1
    done
    du -sh .gpu
    ;;
run)
    out=${OUT:-.gpu/out}
    mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD || exit 1
    export PYTHONUNBUFFERED=1 EDGEINFER_STORIES=$PWD/.gpu/stories260K
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    part() {
        local name=$1 limit=$2 start
        shift 2
        echo "=== $name"
        start=$(date +%s)
        timeout "$limit" "$@" > "$out/$name.log" 2>&1
        echo "rc=$? $(($(date +%s) - start)) s"
        tail -n 24 "$out/$name.log"
    }
    part test_gpu 150 python3 -m pytest -v -p no:cacheprovider --durations=0 \
        -o faulthandler_timeout=60 tests/test_gpu.py ${TESTK:+-k "$TESTK"}
    part compress_gpu 200 python3 -m bench.compress_gpu \
        --weights .gpu/smollm2_layers0-3.safetensors ${SKIP1B:+--skip-1b}
    [ -n "${NO_KERNELS:-}" ] || part kernels 120 python3 -m bench.kernels
    [ -n "${NO_COLDSTART:-}" ] || part coldstart_gpu 120 python3 -m bench.coldstart \
        --device cuda --synthetic-gb 2 --reps 3
    ;;
*)
    echo "usage: bash bench/gpu_check.sh prepare|run" >&2
    exit 2
    ;;
esac
