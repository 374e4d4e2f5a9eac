#!/usr/bin/env bash
# Run tests/sglang against the real wheel of each RELEASE, over the environment of PYTHON (the
# main run's: SGLang 0.5.23, its import set and its server's packages), one pytest run per release,
# with SGLANG_BCG_REQUIRE_SGLANG=1 (a release that does not import fails instead of skipping).
#
# Nothing in PYTHON's environment changes. Each release's wheel goes into a folder of its own
# (`pip install --no-deps --target`), and the pins of its transformers group where they differ from
# that environment's (`.ci/install-sglang.sh --group`: for 0.5.13-0.5.21 transformers 5.12.1,
# tokenizers, openai, xgrammar 0.2.1) into one folder per group; both go first on PYTHONPATH, so
# the release's sglang and pins shadow 0.5.23's. Runs are independent, so JOBS of them (default 2,
# the cores of CI's machine) run at once; each prints its output as one block when it ends.
#
# Usage: [JOBS=N] bash .ci/releases.sh [--dir DIR] [--one-while FILE] PYTHON RELEASE...
#   --dir DIR: the folders go in DIR (kept; ones already there are reused) instead of a temporary
#   folder; --one-while FILE: one run at a time while FILE exists (.ci/run: while its main run
#   uses the other core), JOBS once it is gone.
set -euo pipefail
WORK="" ONE_WHILE=""
while [[ "${1:-}" == --* ]]; do
    case "$1" in
        --dir) WORK="$(realpath -m "$2")"; shift 2 ;;
        --one-while) ONE_WHILE="$(realpath -m "$2")"; shift 2 ;;
        *) echo "releases.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
PY="$1"; shift
cd "$(dirname "$0")/.."
JOBS="${JOBS:-2}"
if [ -z "$WORK" ]; then
    WORK="$(mktemp -d -t bcg-releases.XXXXXX)"
    trap 'rm -rf "$WORK"' EXIT
fi
mkdir -p "$WORK"
echo 'torch==2.13.0' > "$WORK/constraints"
pip_target() {  # DIR SPEC...: SPEC... --no-deps into DIR (whole or not at all), nothing else touched
    local dir="$1"; shift
    rm -rf "$dir.part"
    "$PY" -m pip install -q --disable-pip-version-check --no-warn-conflicts -c "$WORK/constraints" \
        --no-deps --target "$dir.part" "$@" > "$dir.pip.log" 2>&1 \
        || { grep -v "is ignored: it is neither" "$dir.pip.log"; echo "releases.sh: pip install --target $dir $* failed"; return 1; }
    mv "$dir.part" "$dir"
}

# 1. The folders: one per group (its pins that PYTHON's environment lacks), one per release.
start=$(date +%s)
declare -A PATHS
for release in "$@"; do
    mapfile -t pins < <(bash .ci/install-sglang.sh --group "$release")
    differ=()
    for pin in "${pins[@]}"; do
        "$PY" -c "import importlib.metadata as md, sys; n, v = sys.argv[1].split('=='); sys.exit(md.version(n) != v)" "$pin" \
            2>/dev/null || differ+=("$pin")
    done
    group=""
    if (( ${#differ[@]} )); then
        group="$WORK/group-$(printf '%s\n' "${differ[@]}" | md5sum | cut -c1-12)"
        [ -d "$group" ] || pip_target "$group" "${differ[@]}"
    fi
    [ -d "$WORK/sglang-$release" ] || pip_target "$WORK/sglang-$release" "sglang==$release"
    PATHS[$release]="$WORK/sglang-$release${group:+:$group}"
done
echo "=== releases.sh: wheels and group pins laid out in $(( $(date +%s) - start )) s"

# 2. One pytest run per release, JOBS at a time (one while ONE_WHILE exists).
run_one() {  # RELEASE: its tests/sglang, output in $WORK/RELEASE.log, status in $WORK/RELEASE.rc
    local release="$1" t0 rc=0
    t0=$(date +%s)
    {
        export SGLANG_BCG_REQUIRE_SGLANG=1 PYTHONPATH="${PATHS[$release]}:$PWD${PYTHONPATH:+:$PYTHONPATH}"
        echo "=== SGLang $release: pytest tests/sglang (PYTHONPATH=$PYTHONPATH)"
        "$PY" -c "import importlib.metadata as md, sys; v = md.version('sglang'); sys.exit(0 if v == '$release' else f'sglang {v} found, expected $release')" \
            && "$PY" -m pytest -q -p no:cacheprovider --basetemp "$WORK/tmp-$release" tests/sglang || rc=$?
        if (( rc == 0 )); then echo "=== SGLang $release: ok ($(( $(date +%s) - t0 )) s)"
        else echo "=== SGLang $release: FAILED ($rc, $(( $(date +%s) - t0 )) s)"; fi
    } > "$WORK/$release.log" 2>&1
    echo "$rc" > "$WORK/$release.rc"
    cat "$WORK/$release.log"
}
pending=("$@")
while (( ${#pending[@]} )); do
    limit=$JOBS
    if [ -n "$ONE_WHILE" ] && [ -e "$ONE_WHILE" ]; then limit=1; fi
    if (( $(jobs -rp | wc -l) < limit )); then
        run_one "${pending[0]}" &
        pending=("${pending[@]:1}")
    else
        sleep 1
    fi
done
wait || true
failed=()
for release in "$@"; do
    [ "$(cat "$WORK/$release.rc" 2>/dev/null || echo 1)" = 0 ] || failed+=("$release")
done
if (( ${#failed[@]} )); then
    echo "releases.sh: tests/sglang failed on SGLang ${failed[*]}"
    exit 1
fi
echo "releases.sh: tests/sglang passed on SGLang $* ($(( $(date +%s) - start )) s)"
