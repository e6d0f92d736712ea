#!/usr/bin/env bash
# Builds everything a GPU machine needs to test and time grng — such a machine has the NVIDIA
# driver, the CUDA toolkit and PyTorch but no Rust toolchain and no network — into DIR:
#   bundle.tar.xz  one archive of
#     tests/NAME   every integration-test binary (the emu_* ones also run their Device::Cuda
#                  arms) but two that cannot run from a bundle, CPU-only both: `layering` reads
#                  the source tree at its build path, `examples` starts the example binaries
#                  from target/release/examples; candle_grng built with
#                  `-p grng-candle --features cuda` (its CUDA arms), dist_nccl with
#                  `-p grng --features nccl` (without it the binary holds no test)
#     bench/gpu    the GPU benchmark (benches/gpu.rs), when the project has one
#     bench/candle_step  the candle training-step bench, `-p grng-candle --features cuda` (CUDA rows)
#     bin/grng     the main job
#     bin/candle_mlp  the digits MLP through candle, `-p grng-candle --features cuda`
#   run-all.sh  unpacks it and runs them all there: `DIR/run-all.sh OUT [--ncu] [--bench-args "ARGS"]`
# grng's kernels are embedded as PTX (the pip CUDA tools are installed first if needed);
# candle's are compiled by nvcc 13.0 (`install-cuda-tools.sh --candle`: pip wheels unless a
# system nvcc 13.0 exists) for sm_90a, the H100/H200 of the GPU machines. The binaries are
# stripped and packed into ONE xz archive with a 512 MiB dictionary: the ~40 binaries share
# most of their bytes (the embedded PTX, the standard library, the dependencies), which a
# solid archive stores once — 15 MB where xz per binary gave 58 MiB (2026-11-24). The bundle
# must stay within 60 MiB. Packing needs ~6 GB of memory; unpacking 512 MiB.
#
# Usage: scripts/gpu-bundle.sh DIR
set -euo pipefail
if [[ $# -ne 1 ]]; then
    echo "usage: scripts/gpu-bundle.sh DIR" >&2
    exit 2
fi
dest="$1"
cd "$(dirname "$0")/.."
eval "$(scripts/install-cuda-tools.sh --quiet)"

# "NAME PATH" of each executable of target kind $1 in a cargo build's JSON messages (the builds
# use json-render-diagnostics: their errors still reach stderr as text).
executables() {
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and sys.argv[1] in m["target"]["kind"]:
        print(m["target"]["name"], m["executable"])
' "$1"
}

# Every binary is stripped into the staging tree; the tree becomes bundle.tar.xz at the end.
pack() { strip -o "$2" "$1"; }
# pack_all DIR <<< "NAME PATH" lines
pack_all() {
    while read -r name exe; do
        [[ -n "$name" ]] && pack "$exe" "$1/$name"
    done
}
rm -rf "$dest"
mkdir -p "$dest"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/tests" "$stage/bench" "$stage/bin"

echo "gpu-bundle: building (release, kernels embedded)" >&2
cargo build --release --bin grng
# candle_grng comes from the grng-candle `cuda` build below (without the feature it holds no test);
# layering and examples cannot run from the bundle (above).
tests="$(cargo test --release --no-run --tests --message-format=json-render-diagnostics |
    executables test | grep -Ev '^(candle_grng|layering|examples|dist_nccl) ')"
# NCCL with a world of one (issue 38): grng's `nccl` feature (cudarc's NCCL, loaded at run time
# like cuBLAS: nothing to link here; PyTorch's nvidia-nccl wheel there). A build of its own, so
# no other binary gets the feature.
tests+=$'\n'"$(cargo test --release --no-run -p grng --features nccl --test dist_nccl \
    --message-format=json-render-diagnostics | executables test)"
bench=""
if [[ -f crates/grng/benches/gpu.rs ]]; then
    bench="$(cargo bench --no-run --bench gpu --message-format=json-render-diagnostics |
        executables bench)"
fi
main="${CARGO_TARGET_DIR:-target}/release/grng"
# A build without the compiler silently runs CPU-only: refuse to ship that.
if ! grep -aq '\.target sm_' "$main"; then
    echo "gpu-bundle: $main has no embedded PTX (kernels not built)" >&2
    exit 1
fi
# Packed now: the grng-candle `cuda` test build below relinks target/release/grng with the feature.
pack "$main" "$stage/bin/grng"
pack_all "$stage/tests" <<<"$tests"
pack_all "$stage/bench" <<<"$bench"

# The grng-candle `cuda` binaries, built in the environment of install-cuda-tools.sh --candle only
# (a subshell): the builds above keep theirs, so nothing of them is rebuilt.
candle_cuda() {
    (
        eval "$(scripts/install-cuda-tools.sh --quiet --candle)"
        cargo "$@" -p grng-candle --features cuda --message-format=json-render-diagnostics
    )
}
echo "gpu-bundle: building the grng-candle 'cuda' binaries (candle's kernels: nvcc, minutes the first time)" >&2
# Assigned first: a failed build then stops the script (set -e), not a silently missing binary.
candle_test="$(candle_cuda test --release --no-run --test candle_grng | executables test)"
candle_bench="$(candle_cuda bench --no-run --bench candle_step | executables bench)"
candle_mlp="$(candle_cuda build --release --example candle_mlp | executables example)"
pack_all "$stage/tests" <<<"$candle_test"
pack_all "$stage/bench" <<<"$candle_bench"
pack_all "$stage/bin" <<<"$candle_mlp"
echo "gpu-bundle: packing (xz, 512 MiB dictionary: a few minutes)" >&2
tar -C "$stage" -cf - tests bench bin | xz -9e -T1 --lzma2=preset=9e,dict=512MiB >"$dest/bundle.tar.xz"
cp scripts/gpu-run-all.sh "$dest/run-all.sh"
chmod +x "$dest/run-all.sh"
git rev-parse HEAD >"$dest/COMMIT" 2>/dev/null || echo unknown >"$dest/COMMIT"
# Where the tests that start the main job look for it (their CARGO_BIN_EXE_grng): run-all.sh
# puts the bundle's copy there.
realpath "$main" >"$dest/MAIN_PATH"

bytes=$(du -sb "$dest" | cut -f1)
size_mib=$(((bytes + 1048575) / 1048576))
echo "gpu-bundle: $dest: $(ls "$stage/tests" | wc -l) test binaries, bench: $(ls "$stage/bench" | tr "\n" " "), ${size_mib} MiB" >&2
if ((bytes > 60 * 1048576)); then
    echo "gpu-bundle: $dest is ${size_mib} MiB, over the 60 MiB limit" >&2
    exit 1
fi
