#!/usr/bin/env bash
# Runs every GPU test and the benchmark on a CUDA machine; results under $OUT (or ./out).
# Usage: bash scripts/gpu-check.sh [pytest-args...]   (env BENCH_ARGS adds bench flags)
set -uo pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export SGLANG_BCG_GPU_RESULTS_DIR="$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -p no:cacheprovider -q -o addopts="" tests/gpu "$@" 2>&1 | tee "$OUT/gpu-tests.log"
  echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu-tests.log"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  # shellcheck disable=SC2086
  python3 -m sglang_bcg_plugin bench --no-progress --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
fi
