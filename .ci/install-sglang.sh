#!/usr/bin/env bash
# Install a real SGLang release (default 0.5.23) into a CPU-only Python environment, enough
# to import the seams our plugin hooks (sglang.srt.plugins, server_args,
# model_executor.runner_backend, model_executor.runner; 0.5.13: the breakable runner).
#
# Usage: bash .ci/install-sglang.sh [PYTHON] [RELEASE]   (PYTHON defaults to `python`)
#        bash .ci/install-sglang.sh --group RELEASE   (prints RELEASE's group pins, one a line)
#
# Two import sets, grouped by the transformers pin in each release's METADATA: 0.5.22+ use
# transformers 5.19.0; 0.5.15-0.5.21 pin 5.12.1 (0.5.13-0.5.14 pin 5.8.1 and import with 5.12.1
# too, so one environment serves 0.5.13-0.5.21) and import xgrammar==0.2.1. Other releases of a
# group are then swapped in with `pip install --no-deps sglang==X` (.ci/releases.sh, which lays the
# 5.12.1 group's pins and each release's wheel in folders of their own over the 0.5.23 environment).
#
# Preconditions: torch==2.13.0 (the CPU wheel) is already installed in PYTHON's
# environment. Every pip call below gets a constraints file pinning
# torch==2.13.0, so no dependency can pull in a CUDA torch.
#
# SGLang itself is installed with --no-deps (its full dependency set wants CUDA
# wheels); the import set below is what the imports above need. Pins marked (M)
# come from each release's own metadata. Do not run `pip check` on the result.
#
# torchvision is NOT installed: no PyPI build works with CPU torch 2.13. Tests
# install tests/sglang/torchvision_standin.py before importing SGLang.
set -euo pipefail

if [ "${1:-}" = "--group" ]; then
    PRINT_GROUP=1; PY=""; RELEASE="${2:?--group RELEASE}"
else
    PRINT_GROUP=0; PY="${1:-python}"; RELEASE="${2:-0.5.23}"
fi
case "$RELEASE" in
    0.5.2[2-3])
        GROUP=('transformers==5.19.0' 'tokenizers==0.23.2' 'openai==2.8.0') ;;
    0.5.1[3-9]|0.5.2[0-1])
        GROUP=('transformers==5.12.1' 'tokenizers==0.22.2' 'openai==2.6.1' 'xgrammar==0.2.1') ;;
    *) echo "install-sglang.sh: SGLang $RELEASE is outside 0.5.13-0.5.23" >&2; exit 2 ;;
esac
if [ "$PRINT_GROUP" = 1 ]; then printf '%s\n' "${GROUP[@]}"; exit 0; fi

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.split("+")[0] == "2.13.0" else 1)' 2>/dev/null; then
    echo "install-sglang.sh: torch==2.13.0 must already be installed for $PY" >&2
    exit 1
fi

CONSTRAINTS="$(mktemp -t sglang-constraints.XXXXXX)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo 'torch==2.13.0' > "$CONSTRAINTS"

pip_install() {
    # --no-warn-conflicts: sglang is installed --no-deps on purpose, so pip's
    # post-install conflict report would list ~60 deliberately absent packages.
    "$PY" -m pip install -q --disable-pip-version-check --no-warn-conflicts \
        -c "$CONSTRAINTS" "$@"
}

# 1. SGLang itself, without its dependency tree.
pip_install --no-deps "sglang==$RELEASE"

# 2. The import set, one resolver run.
pip_install \
    `# sglang.srt.plugins / sglang.srt.server_args` \
    numpy orjson psutil pybase64 requests packaging pillow starlette msgspec \
    pydantic pyzmq tqdm IPython aiohttp 'triton==3.8.0' \
    `# sglang.srt.model_executor.runner_backend` \
    "${GROUP[@]}" 'sentencepiece==0.2.1' 'apache-tvm-ffi==0.1.11' dill \
    `# sglang.srt.model_executor.runner (ShapeKey, runners)` \
    'compressed-tensors==0.18.0' gguf einops partial-json-parser

# 3. Smoke check: sglang is the expected version and torch was not replaced.
"$PY" - "$RELEASE" <<'PYEOF'
import importlib.metadata as md
import sys
import torch

assert md.version("sglang") == sys.argv[1], md.version("sglang")
assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
print(f"install-sglang.sh: sglang {md.version('sglang')} with torch {torch.__version__}")
PYEOF
