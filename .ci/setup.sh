#!/usr/bin/env bash
# Install everything the test suite needs into PYTHON's environment (default: python):
# CPU torch 2.13.0 from local disk, the real SGLang 0.5.23 (.ci/install-sglang.sh), and this
# package with its [test] extra. A constraint pins torch so nothing pulls a CUDA build.
set -euo pipefail
PY="${1:-python}"
cd "$(dirname "$0")/.."
CONSTRAINTS="$(mktemp -t bcg-constraints.XXXXXX)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo 'torch==2.13.0' > "$CONSTRAINTS"
"$PY" -m pip install -q --disable-pip-version-check 'torch==2.13.0'
bash .ci/install-sglang.sh "$PY"
"$PY" -m pip install -q --disable-pip-version-check --no-warn-conflicts -c "$CONSTRAINTS" -e '.[test]'
