#!/usr/bin/env bash
# Installs the NVIDIA compilers grng needs to build its GPU kernels — NVRTC, the CUDA headers,
# ptxas, cuobjdump and nvdisasm — from NVIDIA's pip wheels into ./.cuda-tools (no GPU, driver
# or system CUDA toolkit needed), then prints the environment to export.
#
# Usage: scripts/install-cuda-tools.sh [--quiet] [--candle]   (idempotent: does nothing when present)
#   eval "$(scripts/install-cuda-tools.sh --quiet)"   # install if needed and export
#   --candle   also the CUDA 13.0 toolchain of grng-candle's `cuda` feature (below), and its
#              exports after the first ones (for the grng-candle `cuda` builds only)
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD/.cuda-tools"
nv="$root/nvidia"
quiet=0
candle=0
for arg in "$@"; do
    case "$arg" in
    --quiet) quiet=1 ;;
    --candle) candle=1 ;;
    *)
        echo "install-cuda-tools: unknown option $arg" >&2
        exit 2
        ;;
    esac
done
py="$(command -v python3 || command -v python || true)"
# pip_target DIR WHEEL...: installs pinned wheels into DIR, in one pip call (a second `--target`
# call into the same DIR would replace the shared `nvidia/` folder).
pip_target() {
    local dir="$1"
    shift
    if [[ -z "$py" ]]; then
        echo "install-cuda-tools: python3 with pip is required" >&2
        exit 1
    fi
    echo "install-cuda-tools: installing NVIDIA wheels into $dir" >&2
    "$py" -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
        --upgrade --target "$dir" "$@" >&2
}

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
    # Pinned to the versions verified here. -cu12 wheels: CUDA 12.x PTX loads on every current driver; cuobjdump/nvdisasm only ship
    # as CUDA 13 wheels (they only read cubins, the version does not matter).
    pip_target "$root" \
        nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-runtime-cu12==12.9.79 \
        nvidia-cuda-nvcc-cu12==12.9.86 nvidia-cuda-cuobjdump==13.5.37 \
        nvidia-cuda-nvdisasm==13.5.37
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

[[ $candle == 1 ]] || exit 0

# candle's `cuda` feature compiles candle-kernels' .cu files with nvcc at build time and links
# the CUDA libraries (its cudarc uses `dynamic-linking`). A system nvcc of CUDA 13.0 is used as
# it is; otherwise NVIDIA's CUDA 13.0 wheels go into ./.cuda-tools/cu13, laid out like a
# toolkit root (bin/nvcc, include, lib). 13.0.x exactly: the GPU machines' driver is CUDA 13.0,
# which loads no newer PTX. They are real libraries, not stubs, so a symbol that candle's or
# grng's cudarc bindings (CUDA 12.8 API) use and CUDA 13 lacks fails the link here, not the run
# on the GPU.
if command -v nvcc >/dev/null 2>&1 && nvcc --version | grep -q 'release 13\.0,'; then
    cuda="$(cd "$(dirname "$(command -v nvcc)")/.." && pwd)"
    cccl=""
else
    cuda="$root/cu13/nvidia/cu13"
    if [[ ! -x "$cuda/bin/nvcc" || ! -e "$cuda/lib/libcusolver.so" || ! -e "$cuda/lib/stubs/libcuda.so" ]]; then
        # --no-deps: the wheels' own dependencies are unpinned (cuSOLVER's would bring the
        # newest cuBLAS); every one needed is listed.
        pip_target "$root/cu13" --no-deps \
            nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
            nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cuda-nvrtc==13.0.88 \
            nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 nvidia-cusolver==12.0.4.66 \
            nvidia-cusparse==12.6.3.3 nvidia-nvjitlink==13.0.88
        # The linker asks for the unversioned names (-lcublas); wheels hold only libX.so.N.
        for f in "$cuda"/lib/lib*.so.[0-9]*; do
            base="${f%%.so.*}.so"
            [[ -e "$base" ]] || ln -s "$(basename "$f")" "$base"
        done
        # libcuda comes with the driver, never in a wheel: as in a toolkit's lib/stubs, a
        # library of the same soname defining every driver function cudarc binds, each
        # returning CUDA_ERROR_STUB_LIBRARY (34). Only the linker sees it (and a CPU-only run
        # with it on LD_LIBRARY_PATH, where every CUDA arm then finds no GPU).
        cudarc="$(cargo metadata --format-version 1 --features grng-candle/cuda | "$py" -c '
import json, os, sys
print(next(os.path.dirname(p["manifest_path"]) for p in json.load(sys.stdin)["packages"] if p["name"] == "cudarc"))')"
        mkdir -p "$cuda/lib/stubs"
        grep -ohE 'load::<_F>\("cu[A-Za-z0-9_]+"\)' "$cudarc/src/driver/sys/mod.rs" |
            sed -E 's/.*\("(.*)"\)/int \1(void) { return 34; }/' | sort -u |
            cc -shared -fPIC -x c - -o "$cuda/lib/stubs/libcuda.so" -Wl,-soname,libcuda.so.1
        ln -sf libcuda.so "$cuda/lib/stubs/libcuda.so.1"
    fi
    # The wheel's nvcc does not search the CCCL wheel's headers (nv/target, cuda/std).
    cccl="-I$cuda/include/cccl"
fi
[[ $quiet == 1 ]] || echo "# grng-candle 'cuda' toolchain ready in $cuda; export for the grng-candle 'cuda' builds:" >&2
# NVCC: candle-kernels' build (cudaforge) takes it before PATH. NVCC_APPEND_FLAGS: read by nvcc
# itself. CUDA_COMPUTE_CAP=90: no GPU to ask here; the kernels are built for sm_90a, what both
# lent GPUs (H100, H200) are. CUDA_HOME: where cudarc's build script looks for the libraries
# (lib, lib/stubs); grng's own build keeps GRNG_CUDA_TOOLS, which it takes first.
echo "export NVCC=\"$cuda/bin/nvcc\""
echo "export NVCC_APPEND_FLAGS=\"$cccl\""
echo "export CUDA_COMPUTE_CAP=90"
echo "export CUDA_HOME=\"$cuda\""
