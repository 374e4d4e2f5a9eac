#!/usr/bin/env bash
# On the GPU machine, from the checkout root: unpack a server bundle, set it up, run the real-server
# test (tests/gpu/test_sglang_server_gpu.py); logs and JSON under $OUT (default out).
# Usage: bash scripts/server/gpu-server-check.sh [BUNDLE.tgz] [pytest-args...]
#   env: SGLANG_BCG_SERVER_SHAPE (tiny | llama3-8b), SGLANG_BCG_SERVER_VARIANTS (stock,default,on,off,released)
set -uo pipefail
BUNDLE="${1:-.sglbundle-srv.tgz}"; shift || true
OUT="${OUT:-out}"; mkdir -p "$OUT"; OUT="$(cd "$OUT" && pwd)"
rm -rf /tmp/.sglbundle && tar xzf "$BUNDLE" -C /tmp || exit 1
# shellcheck disable=SC1091
source /tmp/.sglbundle/server/setup.sh "$PWD" > "$OUT/server-setup.log" 2>&1 || { tail -30 "$OUT/server-setup.log"; exit 1; }
tail -3 "$OUT/server-setup.log"
export SGLANG_BCG_GPU_RESULTS_DIR="$OUT"
python3 -m pytest -p no:cacheprovider -p no:benchmark -q -s -o addopts="" -rfE tests/gpu/test_sglang_server_gpu.py "$@" 2>&1 | tee "$OUT/server-tests-${SGLANG_BCG_SERVER_SHAPE:-tiny}.log"
status=${PIPESTATUS[0]}
echo "pytest exit: $status"
exit "$status"
