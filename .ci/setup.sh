#!/usr/bin/env bash
# Install everything the test suite needs into PYTHON's environment (default: python):
# CPU torch 2.13.0 from local disk, the real SGLang 0.5.23 (.ci/install-sglang.sh), what SGLang's
# server needs on top of that import set (tests/server), and this package with its [test] extra.
# A constraint pins torch on every pip call, so nothing pulls a CUDA build.
set -euo pipefail
PY="${1:-python}"
cd "$(dirname "$0")/.."
CONSTRAINTS="$(mktemp -t bcg-constraints.XXXXXX)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo 'torch==2.13.0' > "$CONSTRAINTS"
"$PY" -m pip install -q --disable-pip-version-check 'torch==2.13.0'
bash .ci/install-sglang.sh "$PY"
# The real server on CPU (tests/server: sglang.Engine and launch_server of 0.5.23), beyond the
# import set above. Each is imported at module level on that path; (M): the pin of SGLang
# 0.5.23's own METADATA; the others: the releases the test ran with.
"$PY" -m pip install -q --disable-pip-version-check --no-warn-conflicts -c "$CONSTRAINTS" \
    `# sglang.srt.entrypoints.engine (sglang.Engine): its event loop and its HTTP pieces` \
    'uvloop==0.23.0' 'fastapi==0.165.0' 'uvicorn==0.55.0' \
    `# managers/scheduler.py, detokenizer_manager.py: name their processes (sglang::scheduler)` \
    'setproctitle==1.3.8' \
    `# entrypoints/http_server.py (launch_server): the Form routes of FastAPI, the function-call` \
    `# parser (xgrammar (M), imported even with --grammar-backend none), serving_chat (jsonschema),` \
    `# the audio routes (soundfile (M))` \
    'python-multipart==0.0.34' 'xgrammar==0.2.7' 'jsonschema==4.26.0' 'soundfile==0.13.1'
"$PY" -m pip install -q --disable-pip-version-check --no-warn-conflicts -c "$CONSTRAINTS" -e '.[test]'
