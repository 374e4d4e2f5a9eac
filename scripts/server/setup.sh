#!/usr/bin/env bash
# On the GPU machine (no network, no SGLang): make a server bundle built by
# scripts/build-server-bundle.sh ready to run a real SGLang server, then export its environment.
#
#     tar xzf .sglbundle-srv.tgz -C /tmp && source /tmp/.sglbundle/server/setup.sh [CHECKOUT]
#
# 1. installs the bundle into $SITE (default /tmp/site: SGLang's sources, its wheels, the
#    stand-ins for what does not import; scripts/sglbundle/install.sh);
# 2. sgl_kernel: the bundle's real sglang-kernel (kernels/, built with KERNELS=1) or the pure-torch
#    stand-in with the package metadata SGLang asserts on CUDA (sglang-kernel >= 0.4.9), and
#    SGLANG_FORCE_FUSED_OP_BACKEND=torch so norms, activations and rope run SGLang's forward_native;
# 3. the cutedsl_dual_gemm stand-in where the release has that module (no CUTLASS DSL here);
# 4. no flashinfer stand-in where the release guards its flashinfer imports (0.5.22+), with
#    SGLANG_IS_FLASHINFER_AVAILABLE=false;
# 5. the plugin from CHECKOUT (default: the current directory) into $PLUGIN_SITE (default
#    /tmp/plugin), a directory kept OFF PYTHONPATH: server_check.py adds it for plugin variants;
# 6. exports PYTHONPATH, the offline switches and SGLang's switches for this machine.
_srv_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
_srv_bundle="$(dirname "$_srv_dir")"
_srv_checkout="$(cd "${1:-$PWD}" && pwd)"
export SITE="${SITE:-/tmp/site}" PLUGIN_SITE="${PLUGIN_SITE:-/tmp/plugin}"
_srv_py="${PY:-}"; [[ -n "$_srv_py" ]] || { [[ -x /opt/torch/.venv/bin/python3 ]] && _srv_py=/opt/torch/.venv/bin/python3 || _srv_py=python3; }
export PY="$_srv_py"
source "$_srv_bundle/install.sh" >/dev/null || return 1 2>/dev/null || exit 1
_srv_release="$(cat "$_srv_bundle/RELEASE")"
if [[ -d "$_srv_bundle/kernels/sgl_kernel" ]]; then
    rm -rf "$SITE/sgl_kernel" "$SITE"/sglang_kernel-*.dist-info
    cp -R "$_srv_bundle/kernels/"* "$SITE/"
    _srv_nv="$("$PY" -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))')"
    export LD_LIBRARY_PATH="$_srv_nv${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"   # libnvrtc.so.13 for common_ops
    # sgl_kernel's norms try flashinfer.norm first: the import stand-in must not offer it
    export SGLBUNDLE_FLASHINFER_ABSENT=norm
    echo "server setup: real sgl_kernel from the bundle"
else
    mkdir -p "$SITE/sglang_kernel-0.4.10.dist-info"
    printf 'Metadata-Version: 2.1\nName: sglang-kernel\nVersion: 0.4.10\n' > "$SITE/sglang_kernel-0.4.10.dist-info/METADATA"
    export SGLANG_FORCE_FUSED_OP_BACKEND=torch SGLANG_CRASH_ON_JIT_COMPILE=1
    echo "server setup: sgl_kernel is the pure-torch stand-in"
fi
if [[ -f "$SITE/sglang/kernels/ops/gemm/cutedsl_dual_gemm.py" ]]; then
    cp "$_srv_dir/standins/cutedsl_dual_gemm.py" "$SITE/sglang/kernels/ops/gemm/cutedsl_dual_gemm.py"
fi
case "$_srv_release" in
    0.5.2[2-9]) [[ -e "$SITE/flashinfer/.sglbundle-standin" ]] && rm -rf "${SITE:?}/flashinfer" ;;
esac
rm -rf "$PLUGIN_SITE"
(cd "$_srv_checkout" && "$PY" -m pip install -q --disable-pip-version-check --no-deps --no-index \
    --no-build-isolation --target "$PLUGIN_SITE" . >/dev/null) || { echo "server setup: plugin install failed" >&2; return 1 2>/dev/null || exit 1; }
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export SGLANG_IS_FLASHINFER_AVAILABLE=false SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python
echo "server setup: SGLang $_srv_release in $SITE, plugin in $PLUGIN_SITE (off PYTHONPATH)"
unset _srv_dir _srv_bundle _srv_checkout _srv_py _srv_release _srv_nv
