#!/usr/bin/env bash
# Builds everything a GPU machine needs to test and time grng — such a machine has the NVIDIA
# driver, the CUDA toolkit and PyTorch but no Rust toolchain and no network — into DIR:
#   tests/*.gz   every integration-test binary (gzip) (the emu_* ones also run their Device::Cuda arms)
#   bench/gpu.gz the GPU benchmark (benches/gpu.rs), when the project has one
#   bin/grng.gz  the main job
#   run-all.sh  runs them all there: `DIR/run-all.sh OUT [--ncu] [--bench-args "ARGS"]`
# The kernels are embedded as PTX (the pip CUDA tools are installed first if needed); the
# binaries are stripped and the bundle must stay within 60 MiB.
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

# "NAME PATH" of each executable of target kind $1 in a cargo build's JSON messages.
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

echo "gpu-bundle: building (release, kernels embedded)" >&2
cargo build --release --bin grng
tests="$(cargo test --release --no-run --tests --message-format=json | executables test)"
bench=""
if [[ -f benches/gpu.rs ]]; then
    bench="$(cargo bench --no-run --bench gpu --message-format=json | executables bench)"
fi
main="${CARGO_TARGET_DIR:-target}/release/grng"
# A build without the compiler silently runs CPU-only: refuse to ship that.
if ! grep -aq '\.target sm_' "$main"; then
    echo "gpu-bundle: $main has no embedded PTX (kernels not built)" >&2
    exit 1
fi

rm -rf "$dest"
mkdir -p "$dest/tests" "$dest/bench" "$dest/bin"
# Every binary is stripped and compressed (about 3x) to stay within 60 MiB; run-all.sh unpacks
# them into OUT.
pack() { strip -o "$2" "$1" && gzip -9 "$2"; }
pack "$main" "$dest/bin/grng"
while read -r name exe; do
    [[ -n "$name" ]] && pack "$exe" "$dest/tests/$name"
done <<<"$tests"
while read -r name exe; do
    [[ -n "$name" ]] && pack "$exe" "$dest/bench/$name"
done <<<"$bench"
cp scripts/gpu-run-all.sh "$dest/run-all.sh"
chmod +x "$dest/run-all.sh"
git rev-parse HEAD >"$dest/COMMIT" 2>/dev/null || echo unknown >"$dest/COMMIT"

bytes=$(du -sb "$dest" | cut -f1)
size_mib=$(((bytes + 1048575) / 1048576))
echo "gpu-bundle: $dest: $(ls "$dest/tests" | wc -l) test binaries, bench: $(ls "$dest/bench" | tr "\n" " "), ${size_mib} MiB" >&2
if ((bytes > 60 * 1048576)); then
    echo "gpu-bundle: $dest is ${size_mib} MiB, over the 60 MiB limit" >&2
    exit 1
fi
