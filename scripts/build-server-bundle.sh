#!/usr/bin/env bash
# Build the offline bundle that runs a REAL SGLang server (sglang.Engine, launch_server) on a GPU
# machine without SGLang, sgl_kernel, flashinfer or a network (tests/gpu/test_sglang_server_gpu.py):
#   = scripts/build-sglbundle.sh RELEASE (SGLang's sources, its import wheels, the stand-ins)
#   + the small wheels the HTTP server, scheduler and detokenizer import on top of those
#   + scripts/server/ (setup.sh, server_check.py, make_model.py, the cutedsl_dual_gemm stand-in)
#   + with KERNELS=1, the release's real sglang-kernel wheel trimmed to sm90 (0.5.13-0.5.17: built
#     for torch 2.11.0, the GPU machine's); otherwise the pure-torch sgl_kernel stand-in serves.
# One .tgz under the 64 MiB a device call carries (checked); a larger bundle is written as OUT.tgz and
# OUT-large.tgz (the wheels over 32 MiB and the real kernels), carried by two calls of one warm machine.
#
# Usage: bash scripts/build-server-bundle.sh [RELEASE] [OUT.tgz]   (default 0.5.23, .sglbundle-srv[-RELEASE].tgz)
#        env: KERNELS=1, KEEP_MM=1 (keep sglang/multimodal_gen), PY
set -euo pipefail
R="${1:-0.5.23}"
if [[ "$R" == 0.5.23 ]]; then OUT="${2:-.sglbundle-srv.tgz}"; else OUT="${2:-.sglbundle-srv-$R.tgz}"; fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PY:-python3}"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
B="$W/.sglbundle"
PY="$PY" bash "$HERE/build-sglbundle.sh" "$R" "$B" >/dev/null
DL=("$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all:
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
    --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
SERVER=(setproctitle==1.3.8 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
        rpds-py==2026.9.1 json_repair==0.64.6 soundfile==0.13.1 cffi==2.1.1 pycparser==3.12
        python-multipart==0.0.34 uvloop==0.23.0)
# xgrammar: imported by the function-call parser even with --grammar-backend none; releases up to
# 0.5.21 already bring their own pin (0.2.1) in the base bundle.
ls "$B/wheels" "$B/wheels-large" 2>/dev/null | grep -q '^xgrammar-' || SERVER+=(xgrammar==0.2.7)
"${DL[@]}" --dest "$B/wheels" "${SERVER[@]}"
mkdir -p "$B/server/standins"
cp "$HERE/server/setup.sh" "$HERE/server/server_check.py" "$HERE/server/make_model.py" "$B/server/"
cp "$HERE/server/standins/cutedsl_dual_gemm.py" "$B/server/standins/"
[[ "${KEEP_MM:-0}" == 1 ]] || rm -rf "$B/sglang/multimodal_gen"   # the diffusion runtime: not on the LLM path
if [[ "${KERNELS:-0}" == 1 ]]; then
    case "$R" in
        0.5.13) K=0.4.3 ;; 0.5.1[4-5]) K=0.4.4 ;; 0.5.1[6-7]) K=0.4.5 ;;
        *) echo "build-server-bundle: no sglang-kernel built for torch 2.11 goes with SGLang $R" >&2; exit 2 ;;
    esac
    "${DL[@]}" --dest "$W/k" "sglang-kernel==$K"
    mkdir -p "$B/kernels"
    (cd "$B/kernels" && unzip -q "$W/k"/sglang_kernel-"$K"-*.whl 'sgl_kernel/*' "sglang_kernel-$K.dist-info/*" \
        -x 'sgl_kernel/sm100/*' 'sgl_kernel/flash_ops*' 'sgl_kernel/flashmla_ops*' 'sgl_kernel/infllm_ops*')
fi
find "$B" -name __pycache__ -prune -exec rm -rf {} +
tar czf "$OUT" -C "$W" .sglbundle
size=$(stat -c %s "$OUT")
LARGE="${OUT%.tgz}-large.tgz"
rm -f "$LARGE"
if (( size > 60 << 20 )) && [[ -n "$(ls -A "$B/wheels-large" 2>/dev/null)" ]]; then
    # Over what one device call carries: the large wheels go in a second archive, unpacked on top
    # of the first by a second call of the same warm machine (gpu-server-check.sh takes either).
    echo 2 > "$B/PARTS"
    parts=(.sglbundle/wheels-large); [[ -d "$B/kernels" ]] && parts+=(.sglbundle/kernels)
    tar czf "$OUT" -C "$W" --exclude=.sglbundle/wheels-large --exclude=.sglbundle/kernels .sglbundle
    tar czf "$LARGE" -C "$W" "${parts[@]}"
fi
for f in "$OUT" "$LARGE"; do
    [[ -f "$f" ]] || continue
    size=$(stat -c %s "$f")
    echo "build-server-bundle: SGLang $R, $(( size >> 20 )) MiB -> $f"
    if (( size > 60 << 20 )); then echo "build-server-bundle: $f is over 60 MiB: a device call carries 64 MiB in all" >&2; exit 1; fi
done
