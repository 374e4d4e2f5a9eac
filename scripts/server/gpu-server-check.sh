#!/usr/bin/env bash
# On the GPU machine, from the checkout root: unpack a server bundle, set it up, run the real-server
# test (tests/gpu/test_sglang_server_gpu.py); logs and JSON under $OUT (default out).
# Usage: bash scripts/server/gpu-server-check.sh [BUNDLE.tgz] [pytest-args...]
#   a two-part bundle: call 1 `tar xzf B.tgz -C /tmp` (carrying B.tgz), call 2 this with B-large.tgz
#   env: SGLANG_BCG_SERVER_SHAPE (tiny | llama3-8b), SGLANG_BCG_SERVER_VARIANTS (stock,default,on,off,released),
#        SGLANG_BCG_SERVER_TESTS (default tests/gpu/test_sglang_server_gpu.py; the live switch:
#        tests/gpu/test_sglang_switch_gpu.py)
set -uo pipefail
BUNDLE="${1:-.sglbundle-srv.tgz}"; shift || true
OUT="${OUT:-out}"; mkdir -p "$OUT"; OUT="$(cd "$OUT" && pwd)"
if [[ "$BUNDLE" == *-large.tgz ]]; then
    # the second part of a two-part bundle: the first was unpacked by the call before
    [[ -f /tmp/.sglbundle/RELEASE ]] || { echo "unpack the first part first: tar xzf ${BUNDLE%-large.tgz}.tgz -C /tmp"; exit 1; }
    tar xzf "$BUNDLE" -C /tmp || exit 1
else
    rm -rf /tmp/.sglbundle && tar xzf "$BUNDLE" -C /tmp || exit 1
fi
if [[ "$(cat /tmp/.sglbundle/PARTS 2>/dev/null || echo 1)" == 2 && -z "$(ls -A /tmp/.sglbundle/wheels-large 2>/dev/null)" ]]; then
    echo "a two-part bundle: carry ${BUNDLE%.tgz}-large.tgz in the next call and run this with it"; exit 1
fi
# shellcheck disable=SC1091
source /tmp/.sglbundle/server/setup.sh "$PWD" > "$OUT/server-setup.log" 2>&1 || { tail -30 "$OUT/server-setup.log"; exit 1; }
tail -3 "$OUT/server-setup.log"
export SGLANG_BCG_GPU_RESULTS_DIR="$OUT"
python3 -m pytest -p no:cacheprovider -p no:benchmark -q -s -o addopts="" -rfE ${SGLANG_BCG_SERVER_TESTS:-tests/gpu/test_sglang_server_gpu.py} "$@" 2>&1 | tee "$OUT/server-tests-${SGLANG_BCG_SERVER_SHAPE:-tiny}.log"
status=${PIPESTATUS[0]}
echo "pytest exit: $status"
exit "$status"
