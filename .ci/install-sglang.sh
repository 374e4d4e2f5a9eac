#!/usr/bin/env bash
# Install the real SGLang 0.5.23 into a CPU-only Python environment, enough to
# import the seams our plugin hooks (sglang.srt.plugins, server_args,
# model_executor.runner_backend, model_executor.runner).
#
# Usage: bash .ci/install-sglang.sh [PYTHON]      (PYTHON defaults to `python`)
#
# Preconditions: torch==2.13.0 (the CPU wheel) is already installed in PYTHON's
# environment. Every pip call below gets a constraints file pinning
# torch==2.13.0, so no dependency can pull in a CUDA torch.
#
# SGLang itself is installed with --no-deps (its full dependency set wants CUDA
# wheels); the import set below is what the imports above need. Pins marked (M)
# come from SGLang 0.5.23's own metadata. Do not run `pip check` on the result.
#
# torchvision is NOT installed: no PyPI build works with CPU torch 2.13. Tests
# install tests/sglang/torchvision_standin.py before importing SGLang.
set -euo pipefail

PY="${1:-python}"

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
pip_install --no-deps 'sglang==0.5.23'

# 2. The import set, one resolver run.
pip_install \
    `# sglang.srt.plugins / sglang.srt.server_args` \
    numpy orjson psutil pybase64 requests packaging pillow starlette msgspec \
    pydantic pyzmq tqdm IPython aiohttp 'triton==3.8.0' \
    `# sglang.srt.model_executor.runner_backend` \
    'transformers==5.19.0' 'tokenizers==0.23.2' 'sentencepiece==0.2.1' \
    'apache-tvm-ffi==0.1.11' dill \
    `# sglang.srt.model_executor.runner (ShapeKey, runners)` \
    'compressed-tensors==0.18.0' 'openai==2.8.0' gguf einops partial-json-parser

# 3. Smoke check: sglang is the expected version and torch was not replaced.
"$PY" - <<'PYEOF'
import importlib.metadata as md
import torch

assert md.version("sglang") == "0.5.23", md.version("sglang")
assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
print(f"install-sglang.sh: sglang {md.version('sglang')} with torch {torch.__version__}")
PYEOF
