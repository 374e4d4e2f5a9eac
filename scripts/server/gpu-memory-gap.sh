#!/usr/bin/env bash
# On the GPU machine, from the checkout root: unpack a server bundle, set it up, make the 8B-shaped
# model, and measure the memory SGLang leaves idle (scripts/server/memory_gap.py), one variant after
# another. Under $OUT (default out): memory-gap-VARIANT.json per variant, memory-gap.log (what
# memory_gap.py printed, with the summary table at its end) and memory-gap-raw.tgz (each server's
# log and memory samples, re-packed after every variant, so few files come back).
# Usage: bash scripts/server/gpu-memory-gap.sh [BUNDLE.tgz] [memory_gap.py args...]
#   env: SGLANG_BCG_GAP_VARIANTS (default stock,post-capture; also plugin-on),
#        SGLANG_BCG_GAP_SHAPE (make_model.py --shape, default llama3-8b)
#   a two-part bundle: call 1 `tar xzf B.tgz -C /tmp` (carrying B.tgz), call 2 this with B-large.tgz
set -uo pipefail
BUNDLE="${1:-.sglbundle-srv.tgz}"; shift || true
OUT="${OUT:-out}"; mkdir -p "$OUT"; OUT="$(cd "$OUT" && pwd)"
if [[ "$BUNDLE" == *-large.tgz ]]; then
    [[ -f /tmp/.sglbundle/RELEASE ]] || { echo "unpack the first part first: tar xzf ${BUNDLE%-large.tgz}.tgz -C /tmp"; exit 1; }
    tar xzf "$BUNDLE" -C /tmp || exit 1
else
    rm -rf /tmp/.sglbundle && tar xzf "$BUNDLE" -C /tmp || exit 1
fi
if [[ "$(cat /tmp/.sglbundle/PARTS 2>/dev/null || echo 1)" == 2 && -z "$(ls -A /tmp/.sglbundle/wheels-large 2>/dev/null)" ]]; then
    echo "a two-part bundle: carry ${BUNDLE%.tgz}-large.tgz in the next call and run this with it"; exit 1
fi
RAW=/tmp/memory-gap-raw; rm -rf "$RAW"; mkdir -p "$RAW"
# shellcheck disable=SC1091
source /tmp/.sglbundle/server/setup.sh "$PWD" > "$RAW/server-setup.log" 2>&1 || { tail -30 "$RAW/server-setup.log"; exit 1; }
tail -3 "$RAW/server-setup.log"
PYTHON="${PY:-python3}"
SHAPE="${SGLANG_BCG_GAP_SHAPE:-llama3-8b}"
MODEL="/tmp/memory-gap-model-$SHAPE"
"$PYTHON" scripts/server/make_model.py "$MODEL" --shape "$SHAPE" | tee "$OUT/memory-gap.log" || exit 1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee -a "$OUT/memory-gap.log"
status=0
IFS=, read -r -a variants <<< "${SGLANG_BCG_GAP_VARIANTS:-stock,post-capture}"
for v in "${variants[@]}"; do
    "$PYTHON" scripts/server/memory_gap.py --model "$MODEL" --plugin-path "$PLUGIN_SITE" --variants "$v" \
        --out-dir "$RAW" "$@" 2>&1 | tee -a "$OUT/memory-gap.log"
    (( PIPESTATUS[0] == 0 )) || status=1
    cp "$RAW/memory-gap-$v.json" "$OUT/" 2>/dev/null
    tar czf "$OUT/memory-gap-raw.tgz" -C "$RAW" .
done
echo "== summary ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1))" | tee -a "$OUT/memory-gap.log"
"$PYTHON" scripts/server/memory_gap.py --summarize "$OUT" | tee -a "$OUT/memory-gap.log"
echo "memory-gap exit: $status"
exit "$status"
