#!/usr/bin/env bash
# Static audit of the compiled CUDA kernels (GPU.md §3), no GPU needed.
#
# Installs the NVIDIA tools if needed (scripts/install-cuda-tools.sh), builds the crate so the
# PTX of every kernel file exists, then for each kernel and each target runs `ptxas -v` and
# prints registers, spill bytes, stack frame and static shared memory: the compute_80 PTX for
# sm_80 and sm_90, the compute_90a PTX (`<file>.sm90a.ptx`, the wgmma GEMM) for sm_90a.
# Kernels whose name ends in `_tc` (tensor-core kernels, kernels/README.md) must show
# tensor-core instructions in `cuobjdump --dump-sass`: HMMA, and for the sm_90a GEMM kernels
# (`_wg_tc`) HGMMA, the SASS of wgmma. Exits non-zero on any spill, on a `_tc` kernel without
# them, on wgmma that ptxas serialized (advisory C7515), when no kernel was audited, or when no
# sm_90a GEMM kernel was.
#
# Usage: scripts/audit-kernels.sh
set -euo pipefail
cd "$(dirname "$0")/.."

eval "$(scripts/install-cuda-tools.sh --quiet)"
for tool in ptxas cuobjdump nvdisasm; do
    command -v "$tool" >/dev/null || { echo "audit: $tool not found" >&2; exit 1; }
done

# Build with the tools exported; the build script's out_dir holds the PTX.
out_dir="$(cargo build --release -p grng --lib --message-format=json 2>/dev/null |
    jq -r 'select(.reason == "build-script-executed" and (.package_id | test("/crates/grng#"))) | .out_dir' |
    tail -n 1)"
if [[ -z "$out_dir" || ! -f "$out_dir/ptx.rs" ]]; then
    echo "audit: could not find the build's PTX (cargo build --release failed?)" >&2
    exit 1
fi
if ! grep -q "pub const BUILT: bool = true" "$out_dir/ptx.rs"; then
    echo "audit: the build did not compile the kernels to PTX" >&2
    exit 1
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

fail=0
rows=0
wg_rows=0
fmt="%-12s %-34s %-6s %5s %9s %9s %7s %7s %6s\n"
printf "$fmt" file kernel arch regs spill_st spill_ld stack smem mma
printf '%.0s-' {1..103}
echo
for ptx in "$out_dir"/*.ptx; do
    file="$(basename "$ptx" .ptx)"
    archs="sm_80 sm_90"
    [[ "$file" == *.sm90a ]] && archs="sm_90a"
    for arch in $archs; do
        cubin="$work/$file.$arch.cubin"
        if ! ptxas -arch="$arch" -v "$ptx" -o "$cubin" 2>"$work/log"; then
            cat "$work/log" >&2
            echo "audit: ptxas failed on $file for $arch" >&2
            exit 1
        fi
        # ptxas reports wgmma it had to serialize (a silent loss of most of the sm_90a
        # path's speed) as performance advisory C7515.
        if grep -q C7515 "$work/log"; then
            grep C7515 "$work/log" >&2
            echo "audit: ptxas serialized wgmma in $file for $arch" >&2
            fail=1
        fi
        # ptxas -v prints, per kernel: "Compiling entry function 'k' for 'sm_xx'", then
        # "N bytes stack frame, S bytes spill stores, L bytes spill loads", then
        # "Used R registers, ..., M bytes smem, ...".
        awk '
            /Compiling entry function/ { match($0, /function .[^'"'"']*/); k = substr($0, RSTART + 10, RLENGTH - 10) }
            /bytes stack frame/ { st = $1; ss = $5; sl = $9 }
            /Used [0-9]+ registers/ {
                r = $0; sub(/.*Used /, "", r); sub(/ registers.*/, "", r)
                m = 0; if (match($0, /[0-9]+ bytes smem/)) { m = substr($0, RSTART, RLENGTH); sub(/ .*/, "", m) }
                print k, r, ss, sl, st, m
            }' "$work/log" >"$work/table"
        while read -r kernel regs spill_st spill_ld stack smem; do
            hmma="-"
            if [[ "$kernel" == *_tc ]]; then
                # wgmma is HGMMA in SASS; mma.sync is HMMA.
                op=HMMA
                if [[ "$kernel" == *_wg_tc ]]; then
                    op=HGMMA
                    wg_rows=$((wg_rows + 1))
                fi
                hmma="$(cuobjdump --dump-sass --function "$kernel" "$cubin" 2>/dev/null | grep -c "$op" || true)"
                if [[ "$hmma" == 0 ]]; then
                    echo "audit: tensor-core kernel $kernel has no $op for $arch" >&2
                    fail=1
                fi
            fi
            if [[ "$spill_st" != 0 || "$spill_ld" != 0 ]]; then
                echo "audit: $kernel spills for $arch ($spill_st bytes stored, $spill_ld loaded)" >&2
                fail=1
            fi
            printf "$fmt" "$file" "$kernel" "$arch" "$regs" "$spill_st" "$spill_ld" "$stack" "$smem" "$hmma"
            rows=$((rows + 1))
        done <"$work/table"
    done
done
if [[ $rows == 0 ]]; then
    echo "audit: no kernel found in $out_dir" >&2
    exit 1
fi
if [[ $wg_rows == 0 ]]; then
    echo "audit: no sm_90a GEMM kernel (_wg_tc) in $out_dir (*.sm90a.ptx missing?)" >&2
    exit 1
fi
if [[ $fail != 0 ]]; then
    echo "audit: FAILED" >&2
    exit 1
fi
echo "audit: $rows kernel/target pairs, no spills, HMMA in every _tc kernel, HGMMA in the $wg_rows sm_90a GEMM kernels"
