#!/usr/bin/env bash
# Build the offline SGLang bundle (any release 0.5.13-0.5.23, default 0.5.23) that
# tests/gpu/test_sglang_gpu.py uses on a GPU machine
# without SGLang: SGLang's own Python code plus the small pure/cp312 wheels it imports, the
# installer and import check (scripts/sglbundle/), and two import stand-ins (torchvision;
# sgl_kernel with a real weak_ref_tensor). Needs network access to PyPI (run it where pip can
# download); the GPU machine then needs none: `source BUNDLE/install.sh`.
#
# Usage: bash scripts/build-sglbundle.sh [RELEASE] [BUNDLE_DIR]
#        (RELEASE default 0.5.23; BUNDLE_DIR default .sglbundle for 0.5.23, .sglbundle-RELEASE else)
#        env PACK=1: also write BUNDLE_DIR.tgz for a device call to carry; where that is over 60 MiB
#        (0.5.13-0.5.21: about 85 MiB), BUNDLE_DIR.tgz without wheels-large/ and BUNDLE_DIR-large.tgz
#        with it, carried by two calls of one warm machine, each unpacked with `tar xzf` in the
#        checkout root (the unpacked folder is git-ignored, so it stays between the two calls).
set -euo pipefail
R="${1:-0.5.23}"
if [[ "$R" == 0.5.23 ]]; then B="${2:-.sglbundle}"; else B="${2:-.sglbundle-$R}"; fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PY:-python3}"
# The import set of SGLang's runner_backend / server_args / plugins on a CUDA machine whose image
# already has torch, triton, transformers, numpy, requests, aiohttp, pillow. Releases up to 0.5.21
# pin transformers 5.12.1 (their import set also needs xgrammar 0.2.1 and openai 2.6.1): those
# come in the bundle and shadow the image's.
case "$R" in
    0.5.2[2-3]) GROUP=(openai==2.8.0) ;;
    0.5.1[3-9]|0.5.2[0-1])
        GROUP=(openai==2.6.1 transformers==5.12.1 tokenizers==0.22.2 xgrammar==0.2.1) ;;
    *) echo "build-sglbundle: SGLang $R is outside 0.5.13-0.5.23" >&2; exit 2 ;;
esac
WHEELS=(annotated-doc==0.0.7 annotated-types==0.8.0 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0
        dill==0.4.1 distro==1.9.0 fastapi==0.165.0 gguf==0.19.0 ipython==9.18.1 jiter==0.19.0
        loguru==0.7.3 msgspec==0.23.0 nvidia-ml-py==13.615.71 "${GROUP[@]}" opentelemetry-api==1.45.2
        orjson==3.13.0 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4
        pydantic-core==2.50.5 pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 traitlets==5.16.1
        typing-inspection==0.4.5 uvicorn==0.54.0)
FALLBACK=(cuda-bindings==13.0.3 cuda-pathfinder==1.9.1)
PIP=("$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all:
     --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64)
rm -rf "$B" && mkdir -p "$B/wheels/fallback" "$B/.src"
# SGLang's own wheel: only its Python sources are extracted below, and from 0.5.11 PyPI has it
# tagged for CPython 3.11 only.
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.11 --platform manylinux_2_34_x86_64 --dest "$B/.src" "sglang==$R"
"${PIP[@]}" --dest "$B/wheels" "${WHEELS[@]}"
"${PIP[@]}" --dest "$B/wheels/fallback" "${FALLBACK[@]}"
"$PY" - "$B" "$R" <<'PYEOF'
import glob, sys, zipfile
b, r = sys.argv[1], sys.argv[2]
(whl,) = glob.glob(f"{b}/.src/sglang-{r}-*.whl")
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        top = name.split("/")[0]
        # compiled extensions are built for CPython 3.11 only (the imports used here do not need them)
        if top in ("sglang", f"sglang-{r}.dist-info") and not name.endswith(("/", ".so")):
            z.extract(name, b)
PYEOF
rm -rf "$B/.src"
# Wheels over 32 MiB (xgrammar) apart, so a bundle can travel in pieces of at most 64 MiB.
mkdir -p "$B/wheels-large"
find "$B/wheels" -maxdepth 1 -name '*.whl' -size +32M -exec mv {} "$B/wheels-large/" \;
cp "$HERE/sglbundle/install.sh" "$HERE/sglbundle/check_imports.py" "$B/"
cp -R "$HERE/sglbundle/standins" "$B/standins"
# The torchvision import stand-in is the test suite's own (one copy in the repository).
cp "$HERE/../tests/sglang/torchvision_standin.py" "$B/standins/torchvision_standin.py"
echo "$R" > "$B/RELEASE"
echo "build-sglbundle: SGLang $R, $(du -sh "$B" | cut -f1) in $B; on the GPU machine: source $B/install.sh"
if [[ "${PACK:-0}" == 1 ]]; then
    T="$B.tgz" L="$B-large.tgz"
    rm -f "$T" "$L"
    tar czf "$T" "$B"
    if (( $(stat -c %s "$T") > 60 << 20 )); then
        tar czf "$T" --exclude="$B/wheels-large" "$B"
        tar czf "$L" "$B/wheels-large"
    fi
    for f in "$T" "$L"; do
        if [[ -f "$f" ]]; then echo "build-sglbundle: $(( $(stat -c %s "$f") >> 20 )) MiB -> $f"; fi
    done
fi
