#!/usr/bin/env bash
# Runs the GPU tests and the benchmark on a CUDA machine; results under $OUT (or ./out).
# Usage: bash scripts/gpu-check.sh [pytest-args...]
#   GPU_TESTS   what pytest runs (default tests/gpu)      BENCH_ARGS  extra bench flags
#   SKIP_TESTS=1 / SKIP_BENCH=1                            skip either part
#   SGLBUNDLE   the offline SGLang bundle (default .sglbundle): reused when present, built
#               with scripts/build-sglbundle.sh "${SGLANG_RELEASE:-0.5.23}" when missing
#               (needs PyPI), unless SGLang is
#               already importable; without any, tests/gpu/test_sglang_gpu.py skips.
set -uo pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export SGLANG_BCG_GPU_RESULTS_DIR="$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
SGLBUNDLE="${SGLBUNDLE:-.sglbundle}"
if python3 -c "import sglang" >/dev/null 2>&1; then
  echo "sglang: installed $(python3 -c 'import importlib.metadata as m; print(m.version("sglang"))')" | tee -a "$OUT/gpu.txt"
else
  if [ ! -f "$SGLBUNDLE/install.sh" ]; then
    bash scripts/build-sglbundle.sh "${SGLANG_RELEASE:-0.5.23}" "$SGLBUNDLE" || echo "sglang: bundle build failed (no PyPI?); SGLang GPU tests skip"
  fi
  if [ -f "$SGLBUNDLE/install.sh" ]; then
    # shellcheck disable=SC1091
    source "$SGLBUNDLE/install.sh" >/dev/null 2>>"$OUT/sglbundle.log" && echo "sglang: bundle $SGLBUNDLE" | tee -a "$OUT/gpu.txt"
  fi
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  if [ -z "${GPU_TESTS:-}" ]; then
    # The GC-during-capture tests first, in their own process: a failure there leaves the CUDA
    # context unusable and would fail every later test of the same process.
    python3 -m pytest -p no:cacheprovider -q -o addopts="" -rf tests/gpu/test_gc_capture_gpu.py "$@" 2>&1 | tee "$OUT/gpu-tests-gc.log"
    echo "pytest exit (gc): ${PIPESTATUS[0]}" | tee -a "$OUT/gpu-tests-gc.log"
    set -- --ignore=tests/gpu/test_gc_capture_gpu.py "$@"
  fi
  # shellcheck disable=SC2086
  python3 -m pytest -p no:cacheprovider -q -o addopts="" -rf ${GPU_TESTS:-tests/gpu} "$@" 2>&1 | tee "$OUT/gpu-tests.log"
  echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu-tests.log"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  # shellcheck disable=SC2086
  python3 -m sglang_bcg_plugin bench --no-progress --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
fi
