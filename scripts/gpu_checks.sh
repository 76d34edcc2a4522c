#!/usr/bin/env bash
# The checks that need a CUDA device, as one script for a lent GPU machine (torch installed there, this
# package not): run from the repository root; logs go to $OUT (default artifacts/gpu).
#   1. every test marked `cuda`;
#   2. the rest of the suite, which must pass on a GPU machine too (tests/conftest.py hides the GPU);
#   3. benchmarks/bench_offload.py's CUDA section, side by side with Accelerate when it is installed.
# Each step has its own time limit, so one that hangs still leaves the others' logs.
set -u
OUT="${OUT:-artifacts/gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
# The package itself, editable and without its dependencies (torch and the rest are there already);
# `notebook_accel.widgets` lives in widgets/, so a plain PYTHONPATH would miss it.
(cd / && "$py" -c "import notebook_accel.widgets") 2>/dev/null \
    || "$py" -m pip install -q --no-deps --no-build-isolation -e . \
    || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The project's addopts name nbval's options; nbval need not be installed for these files.
pytest_args=(-o addopts= -p no:cacheprovider -q -rfEs --timeout=150)

{
    date -u
    nvidia-smi -L
    "$py" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.device_count())"
    "$py" -m pip list 2>/dev/null | grep -iE '^(torch|safetensors|psutil|ipywidgets|matplotlib|tqdm|pytest|pytest-timeout|pytest-xdist|transformers|accelerate) '
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== 1. tests marked cuda"
NOTEBOOK_ACCEL_TEST_CUDA=1 timeout "${CUDA_TESTS_S:-200}" "$py" -m pytest "${pytest_args[@]}" -m cuda --continue-on-collection-errors tests \
    >"$OUT/cuda_tests.log" 2>&1
echo "rc=$?"
tail -n 40 "$OUT/cuda_tests.log"

echo "== 2. the rest of the suite (not marked cuda; tests/conftest.py hides the GPU from it)"
workers=()  # pytest-xdist, where that machine has it (it is not one of this project's dependencies)
"$py" -c "import xdist" 2>/dev/null && workers=(-n "${WORKERS:-12}")
timeout "${REST_TESTS_S:-240}" "$py" -m pytest "${pytest_args[@]}" "${workers[@]}" -m "not cuda" \
    --continue-on-collection-errors tests >"$OUT/rest_tests.log" 2>&1
echo "rc=$?"
grep -E '^(FAILED|ERROR)|passed|failed' "$OUT/rest_tests.log" | tail -n 60

[ "${BENCH_S:-90}" -gt 0 ] || exit 0
echo "== 3. bench_offload (CUDA section; Accelerate beside it where installed)"
ACCELERATE_PYTHON="${ACCELERATE_PYTHON:-$(command -v "$py")}" timeout "${BENCH_S:-90}" \
    "$py" benchmarks/bench_offload.py --quick >"$OUT/bench_offload.log" 2>&1
echo "rc=$?"
tail -n 30 "$OUT/bench_offload.log"
