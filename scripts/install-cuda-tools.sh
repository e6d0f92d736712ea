#!/usr/bin/env bash
# Installs the NVIDIA compilers grng needs to build its GPU kernels — NVRTC, the CUDA headers,
# ptxas, cuobjdump and nvdisasm — from NVIDIA's pip wheels into ./.cuda-tools (no GPU, driver
# or system CUDA toolkit needed), then prints the environment to export.
#
# Usage: scripts/install-cuda-tools.sh [--quiet]   (idempotent: does nothing when present)
#   eval "$(scripts/install-cuda-tools.sh --quiet)"   # install if needed and export
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD/.cuda-tools"
nv="$root/nvidia"
quiet=0
[[ "${1:-}" == "--quiet" ]] && quiet=1

# Where each wheel lands inside the target folder (GPU.md §1).
nvrtc_lib="$nv/cuda_nvrtc/lib"
rt_inc="$nv/cuda_runtime/include"
nvcc_bin="$nv/cuda_nvcc/bin"
cu13_bin="$nv/cu13/bin"

have_all() {
    compgen -G "$nvrtc_lib/libnvrtc.so*" >/dev/null &&
        [[ -f "$rt_inc/cuda_bf16.h" && -f "$rt_inc/mma.h" && -x "$nvcc_bin/ptxas" ]] &&
        [[ -x "$cu13_bin/cuobjdump" && -x "$cu13_bin/nvdisasm" ]]
}

if ! have_all; then
    py="$(command -v python3 || command -v python || true)"
    if [[ -z "$py" ]]; then
        echo "install-cuda-tools: python3 with pip is required" >&2
        exit 1
    fi
    echo "install-cuda-tools: installing NVIDIA wheels into $root" >&2
    # Pinned to the versions verified here. -cu12 wheels: CUDA 12.x PTX loads on every current driver; cuobjdump/nvdisasm only ship
    # as CUDA 13 wheels (they only read cubins, the version does not matter).
    "$py" -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
        --upgrade --target "$root" \
        nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-runtime-cu12==12.9.79 \
        nvidia-cuda-nvcc-cu12==12.9.86 nvidia-cuda-cuobjdump==13.5.37 \
        nvidia-cuda-nvdisasm==13.5.37 >&2
    # Wheels store libnvrtc.so.12 only; loaders (cudarc) also try the unversioned name.
    for f in "$nvrtc_lib"/libnvrtc.so.*; do
        [[ -e "$nvrtc_lib/libnvrtc.so" ]] || ln -s "$(basename "$f")" "$nvrtc_lib/libnvrtc.so"
        break
    done
    if ! have_all; then
        echo "install-cuda-tools: the wheels did not provide every tool expected under $nv" >&2
        exit 1
    fi
fi

[[ $quiet == 1 ]] || echo "# CUDA tools ready in $root; export this environment:" >&2
echo "export GRNG_CUDA_TOOLS=\"$root\""
echo "export LD_LIBRARY_PATH=\"$nvrtc_lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\""
echo "export PATH=\"$nvcc_bin:$cu13_bin\${PATH:+:\$PATH}\""
