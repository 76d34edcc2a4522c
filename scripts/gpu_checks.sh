#!/usr/bin/env bash
# The checks that need a CUDA device, as one script for a lent GPU machine (torch installed there, this
# package not): run from the repository root; logs go to $OUT (default artifacts/gpu). Sized for one
# 10-minute device call on one H100/H200: at most 200 s of tests, 60 + 280 s of benchmark (expected:
# about 2-3 minutes of tests and 2-3 of benchmark).
#   1. every test marked `cuda` (tests/test_cuda.py, tests/test_cuda_streaming.py and the cuda tests of
#      the other files);
#   2. the rest of the suite, which must pass on a GPU machine too (tests/conftest.py hides the GPU):
#      off by default (REST_TESTS_S=240 runs it; it does not fit the same call);
#   3. benchmarks/bench_offload.py: its CPU section (--quick), then its CUDA section: the streaming
#      offload against the floor measured in the same run, Accelerate 1.15 (the machine's own
#      `accelerate`, in an interpreter of its own), diffusers' group offloading (installed from
#      $WHEELS when the machine lacks it), no offload, and the training step.
# Each step has its own time limit, so one that hangs still leaves the others' logs.
# diffusers is not on the machine's image: carry its wheels, made here beforehand with
#   .venv/bin/pip download --no-deps -d artifacts/wheels diffusers==0.42.1 importlib_metadata
# and `carry: ["artifacts/wheels"]`.
set -u
OUT="${OUT:-artifacts/gpu}"
WHEELS="${WHEELS:-artifacts/wheels}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
# The package itself, editable and without its dependencies (torch and the rest are there already);
# `notebook_accel.widgets` lives in widgets/, so a plain PYTHONPATH would miss it.
(cd / && "$py" -c "import notebook_accel.widgets") 2>/dev/null \
    || "$py" -m pip install -q --no-deps --no-build-isolation -e . \
    || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# diffusers (group offloading, a column of the benchmark) from carried wheels, when it is missing.
if ! "$py" -c "import diffusers" 2>/dev/null && ls "$WHEELS"/diffusers-*.whl >/dev/null 2>&1; then
    "$py" -m pip install -q --no-index --find-links "$WHEELS" diffusers \
        || "$py" -m pip install -q --no-index --find-links "$WHEELS" --break-system-packages diffusers
fi
# Accelerate 1.15 runs in an interpreter of its own (benchmarks/_worker.py): $ACCELERATE_PYTHON, else
# this python when its `accelerate` is 1.15 (our processes never import it: install_as_accelerate()).
if [ -z "${ACCELERATE_PYTHON:-}" ] && "$py" -c "import accelerate, sys; sys.exit(not accelerate.__version__.startswith('1.15'))" 2>/dev/null; then
    ACCELERATE_PYTHON="$(command -v "$py")"
fi
export ACCELERATE_PYTHON="${ACCELERATE_PYTHON:-}"
# The project's addopts name nbval's options; nbval need not be installed for these files.
pytest_args=(-o addopts= -p no:cacheprovider -q -rfEs --timeout=150)

{
    date -u
    nvidia-smi -L
    "$py" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.device_count())"
    "$py" -m pip list 2>/dev/null | grep -iE '^(torch|safetensors|psutil|ipywidgets|matplotlib|tqdm|pytest|pytest-timeout|pytest-xdist|transformers|accelerate|diffusers) '
    echo "ACCELERATE_PYTHON=${ACCELERATE_PYTHON:-none}"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== 1. tests marked cuda"
NOTEBOOK_ACCEL_TEST_CUDA=1 timeout "${CUDA_TESTS_S:-200}" "$py" -m pytest "${pytest_args[@]}" -m cuda --continue-on-collection-errors tests \
    >"$OUT/cuda_tests.log" 2>&1
echo "rc=$?"
tail -n 40 "$OUT/cuda_tests.log"

if [ "${REST_TESTS_S:-0}" -gt 0 ]; then
    echo "== 2. the rest of the suite (not marked cuda; tests/conftest.py hides the GPU from it)"
    workers=()  # pytest-xdist, where that machine has it (it is not one of this project's dependencies)
    "$py" -c "import xdist" 2>/dev/null && workers=(-n "${WORKERS:-12}")
    timeout "$REST_TESTS_S" "$py" -m pytest "${pytest_args[@]}" "${workers[@]}" -m "not cuda" \
        --continue-on-collection-errors tests >"$OUT/rest_tests.log" 2>&1
    echo "rc=$?"
    grep -E '^(FAILED|ERROR)|passed|failed' "$OUT/rest_tests.log" | tail -n 60
fi

[ "${BENCH_S:-280}" -gt 0 ] || exit 0
echo "== 3. bench_offload: the CPU section (--quick), then the CUDA figures (full size and repeats)"
{
    timeout 60 "$py" benchmarks/bench_offload.py --quick --no-cuda
    echo "rc=$?"
    timeout "${BENCH_S:-280}" "$py" benchmarks/bench_offload.py --cuda-only
    echo "rc=$?"
} >"$OUT/bench_offload.log" 2>&1
grep -vE 'Loading weights|Writing model shards|AccelerateShadowedWarning|install_as_accelerate\(\)  #' \
    "$OUT/bench_offload.log" | tail -n 70
