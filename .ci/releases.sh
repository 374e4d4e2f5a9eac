#!/usr/bin/env bash
# Run tests/sglang against the real wheel of each RELEASE, swapping only the sglang wheel
# (`pip install --no-deps`) over the base environment of PYTHON, one pytest run per release,
# with SGLANG_BCG_REQUIRE_SGLANG=1 (a release that does not import fails instead of skipping).
#
# Usage: bash .ci/releases.sh PYTHON RELEASE...
set -euo pipefail
PY="$1"; shift
cd "$(dirname "$0")/.."
CONSTRAINTS="$(mktemp -t bcg-constraints.XXXXXX)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo 'torch==2.13.0' > "$CONSTRAINTS"
export SGLANG_BCG_REQUIRE_SGLANG=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
failed=()
for release in "$@"; do
    start=$(date +%s)
    "$PY" -m pip install -q --disable-pip-version-check --no-warn-conflicts -c "$CONSTRAINTS" \
        --no-deps "sglang==$release" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
    swapped=$(( $(date +%s) - start ))
    echo "=== SGLang $release (wheel swapped in ${swapped} s): pytest tests/sglang"
    "$PY" -c "import importlib.metadata as md, sys; v = md.version('sglang'); sys.exit(0 if v == '$release' else f'sglang {v} installed, expected $release')"
    if "$PY" -m pytest -q -p no:cacheprovider tests/sglang; then
        echo "=== SGLang $release: ok ($(( $(date +%s) - start )) s)"
    else
        echo "=== SGLang $release: FAILED"
        failed+=("$release")
    fi
done
if (( ${#failed[@]} )); then
    echo "releases.sh: tests/sglang failed on SGLang ${failed[*]}"
    exit 1
fi
echo "releases.sh: tests/sglang passed on SGLang $*"
