#!/usr/bin/env bash
# run-all.sh of a GPU bundle (built by scripts/gpu-bundle.sh; do not run it from the source tree).
# Runs the GPU bench and the candle training-step bench's CUDA rows first, alone on the GPU (their
# timings are what a lease is short of), then every test binary (candle_grng with its candle CUDA
# arms; JOBS at a time), the main job and the candle digits MLP on CUDA, and compute-sanitizer
# (memcheck, racecheck) over one small test binary; writes one log each, summary.txt and
# logs.tar.gz (every log in one file: a device lease brings back only a few files) into OUT;
# exits non-zero when anything failed or was skipped for time, and with status 3 when there is
# no usable GPU.
#
# Usage: run-all.sh OUT [--ncu] [--bench-args "ARGS"] [--jobs N] [--budget SECS] [--step-limit SECS]
#                  [--no-sanitizer]
#   --ncu               also profile the GEMM engine's kernels with Nsight Compute (`--set full`,
#                       two launches of each `_tc` kernel in the bench's gemm-bf16, syrk and
#                       newton sections at --quick sizes: where the mainloop stalls), one
#                       log per section; a section passes when ncu profiled a kernel, and the
#                       rest are skipped when one profiled none (no counters: gVisor)
#   --bench-args ARGS   arguments of the bench (a section filter, --quick), e.g. "gemm --quick"
#   --jobs N            test binaries run at once (default 4; each runs its tests in threads)
#   --budget SECS       wall-clock budget: what has not started when it is spent is not run and
#                       says SKIP (time) in the summary; every step is also stopped at what is
#                       left of it (default: no budget)
#   --step-limit SECS   no one step (a bench, a test binary, ...) runs longer (default: none);
#                       the GPU bench gets --deadline= 10 s before its limit, so a bench cut
#                       short still prints the GEMM plan's choices and the `loaded:` lines
#   --no-sanitizer      leave out compute-sanitizer (racecheck alone takes minutes)
#   GRNG_MAIN_ARGS      arguments of the main job (default: --epochs 2)
#   GRNG_CANDLE_MLP_ARGS  arguments of the candle digits MLP besides --device cuda (default: none,
#                       i.e. every method, 10 epochs)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [[ $# -lt 1 ]]; then
    echo "usage: run-all.sh OUT [--ncu] [--bench-args \"ARGS\"] [--jobs N] [--budget SECS] [--step-limit SECS] [--no-sanitizer]" >&2
    exit 2
fi
out="$1"
shift
ncu_on=0
bench_args=""
jobs=4
budget=0
step_limit=0
sanitizer=1
while [[ $# -gt 0 ]]; do
    case "$1" in
    --ncu) ncu_on=1 ;;
    --bench-args)
        bench_args="${2:-}"
        shift
        ;;
    --jobs)
        jobs="${2:-4}"
        shift
        ;;
    --budget)
        budget="${2:-0}"
        shift
        ;;
    --step-limit)
        step_limit="${2:-0}"
        shift
        ;;
    --no-sanitizer) sanitizer=0 ;;
    *)
        echo "run-all.sh: unknown option $1" >&2
        exit 2
        ;;
    esac
    shift
done
mkdir -p "$out"
out="$(cd "$out" && pwd)"
summary="$out/summary.txt"
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }

say "grng GPU bundle, commit $(cat "$here/COMMIT" 2>/dev/null || echo unknown), $(date -u +%FT%TZ)"

# No GPU: say so plainly and stop (nothing here can be measured on the CPU).
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >"$out/nvidia-smi.log" 2>&1 ||
    ! grep -q '^GPU ' "$out/nvidia-smi.log"; then
    say "NO GPU: nvidia-smi is missing or lists no device; nothing was run."
    exit 3
fi
say "device: $(grep '^GPU 0' "$out/nvidia-smi.log")"
nvidia-smi >>"$out/nvidia-smi.log" 2>&1

# Vendor libraries (loaded dynamically by cudarc): the CUDA toolkit's lib64, then PyTorch's
# nvidia/*/lib wheels.
libdirs=()
for d in "${CUDA_HOME:-}/lib64" /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    /usr/local/cuda-*/lib64; do
    [[ -d "$d" ]] && libdirs+=("$d")
done
if command -v python3 >/dev/null 2>&1; then
    while IFS= read -r d; do
        [[ -d "$d" ]] && libdirs+=("$d")
    done < <(python3 -c '
import os
try:
    import nvidia
except ImportError:
    raise SystemExit
for p in nvidia.__path__:
    for d in sorted(os.listdir(p)):
        print(os.path.join(p, d, "lib"))
' 2>/dev/null)
fi
for d in "${libdirs[@]}"; do
    LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
# cudarc opens NCCL as libnccl.so (or .so.12 and older names), never libnccl.so.2, the only name
# PyTorch's nvidia-nccl wheel holds: an unversioned link to it in a folder of our own, last on
# the path (tests/dist_nccl, the world of one).
shim="$(mktemp -d "${TMPDIR:-/tmp}/grng-libs.XXXXXX")"
for d in "${libdirs[@]}"; do
    f="$(compgen -G "$d/libnccl.so.2*" | head -n1)"
    if [[ -n "$f" && ! -e "$d/libnccl.so" ]]; then
        ln -s "$f" "$shim/libnccl.so"
        LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$shim"
        break
    fi
done
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
# ncu and compute-sanitizer where PATH lacks them: the CUDA toolkit's bin, Nsight Compute's
# folder (after PATH: the tools PATH finds first stay first).
for d in "${CUDA_HOME:-}/bin" /usr/local/cuda/bin /opt/nvidia/nsight-compute/*; do
    [[ -x "$d/ncu" || -x "$d/compute-sanitizer" ]] && PATH="$PATH:$d"
done
export PATH
# What the dynamic loader will pick for each name cudarc opens (or, in the grng-candle `cuda` binaries,
# links: libcudart, libcurand and the .so.13/.so.12 names of CUDA 13 too) (first LD_LIBRARY_PATH hit,
# else ldconfig), with its real file and the version in that file's name. The bench prints
# the ones it actually mapped ("loaded:" lines, copied into the summary below).
for lib in libcuda.so.1 libnvrtc.so libcublas.so libcublasLt.so libcusolver.so libnccl.so \
    libcudart.so.13 libcurand.so.10 libcublas.so.13 libcublasLt.so.13 libcusolver.so.12; do
    found=""
    IFS=: read -ra dirs <<<"$LD_LIBRARY_PATH"
    for d in "${dirs[@]}"; do
        f="$(compgen -G "$d/$lib*" | head -n1)"
        [[ -n "$f" ]] && found="$f" && break
    done
    [[ -z "$found" ]] && found="$(ldconfig -p 2>/dev/null | awk -v l="$lib" 'index($1, l) == 1 { print $NF; exit }')"
    if [[ -n "$found" ]]; then
        real="$(readlink -f "$found")"
        say "library $lib: $found -> $real (version ${real##*.so.})"
    else
        say "library $lib: NOT FOUND"
    fi
done
# The tests' CUDA arms must run here: a missing GPU fails them instead of skipping them.
export GRNG_REQUIRE_CUDA=1

failed=0
t_start=$(date +%s)
# Seconds of the budget left (a large number without one); by the clock, not $SECONDS, which
# starts again in each test's subshell.
left() {
    if ((budget > 0)); then echo $((budget - $(date +%s) + t_start)); else echo 1000000; fi
}
# Seconds the next step may run: what is left of the budget, at most --step-limit.
cap() {
    local rest
    rest="$(left)"
    ((step_limit > 0 && step_limit < rest)) && rest=$step_limit
    echo "$rest"
}
# run NAME LOG CMD...: runs CMD with its output in LOG, one PASS/FAIL line in the summary; not
# started (SKIP) when under 10 s of the budget is left, stopped (timeout) at what is left.
# With pass_if set (a grep -E pattern; `pass_if=... run ...`), PASS is: not stopped, and the
# log matches it, whatever CMD's exit status.
run() {
    local name="$1" log="$2"
    shift 2
    local t0=$SECONDS rest
    if (($(left) < 10)); then
        say "SKIP $name (time: the --budget is spent)"
        failed=1
        return
    fi
    rest="$(cap)"
    timeout --kill-after=5 "$rest" "$@" >"$log" 2>&1
    local rc=$?
    if [[ -n "${pass_if:-}" && $rc -ne 124 && $rc -ne 137 ]]; then
        if grep -qE "$pass_if" "$log"; then rc=0; elif [[ $rc -eq 0 ]]; then rc=1; fi
    fi
    if [[ $rc -eq 0 ]]; then
        say "PASS $name ($((SECONDS - t0)) s)"
    elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
        say "FAIL $name (stopped at the --budget or --step-limit, $((SECONDS - t0)) s; log: $log)"
        failed=1
    else
        say "FAIL $name (exit $rc, $((SECONDS - t0)) s; log: $log)"
        failed=1
    fi
}
# Every log in one archive at exit, whatever stopped the run.
pack_logs() {
    tar -C "$out" -czf "$out/logs.tar.gz" --exclude logs.tar.gz . 2>/dev/null || true
}

mkdir -p "$out/tests"
# The bundle's binaries come in one xz archive (scripts/gpu-bundle.sh); unpacked outside OUT
# (so they do not travel back with the logs), with Python's tarfile where the xz tool is
# missing.
pkg="$(mktemp -d "${TMPDIR:-/tmp}/grng-bundle.XXXXXX")"
trap 'rm -rf "$pkg" "$shim"; pack_logs' EXIT
if command -v xz >/dev/null 2>&1; then
    tar -C "$pkg" -xJf "$here/bundle.tar.xz"
else
    python3 -c '
import sys, tarfile
t = tarfile.open(sys.argv[1], "r:xz")
try:
    t.extractall(sys.argv[2], filter="data")
except TypeError:  # a Python without extraction filters
    t.extractall(sys.argv[2])
' "$here/bundle.tar.xz" "$pkg"
fi || {
    say "FAIL unpacking $here/bundle.tar.xz"
    exit 1
}
# The tests that run the main job start it by its build-time path (CARGO_BIN_EXE_grng), which
# gpu-bundle.sh recorded: put the bundle's binary there unless something is.
if [[ -f "$here/MAIN_PATH" ]]; then
    main_path="$(cat "$here/MAIN_PATH")"
    if [[ ! -e "$main_path" ]]; then
        mkdir -p "$(dirname "$main_path")" && ln -s "$pkg/bin/grng" "$main_path" ||
            say "note: could not place the main binary at $main_path (train_smoke, train_reliability need it)"
    fi
fi
# The timings first, with the GPU to themselves.
bench_bin=""
[[ -f "$pkg/bench/gpu" ]] && bench_bin="$pkg/bench/gpu"
if [[ -n "$bench_bin" ]]; then
    # Cut short (a --budget or --step-limit), the bench still prints its closing tables: its
    # own --deadline, 10 s before run's timeout.
    deadline=()
    c="$(cap)"
    ((c < 1000000 && c > 20)) && deadline=("--deadline=$((c - 10))")
    # shellcheck disable=SC2086 # bench_args is a word list by design
    run "bench gpu $bench_args" "$out/bench-gpu.log" "$bench_bin" $bench_args \
        ${deadline[@]+"${deadline[@]}"}
    grep '^GEMM mainloop' "$out/bench-gpu.log" | sed 's/^/bench /' | tee -a "$summary"
    grep '^loaded: ' "$out/bench-gpu.log" | sed 's/^/bench /' | tee -a "$summary"
    if [[ $ncu_on == 1 ]]; then
        # --launch-skip passes the sm_90a self-checks' 10 `_tc` launches (check_sm90, before
        # any section; 2 per variant) on a CC 9.0 device, the first warm-up calls elsewhere. Clocks left alone
        # (--clock-control none): the timings beside them ran at the same clocks. --kill 1 (where
        # this ncu's help lists `--kill arg`) ends the bench once the 2 launches are profiled:
        # the rest of the section, run under the profiler, would be lease time spent on nothing.
        ncu_kill=()
        ncu --help 2>/dev/null | grep -qE -- '--kill +arg' && ncu_kill=(--kill 1)
        for section in gemm-bf16 syrk newton; do
            log="$out/ncu-$section.log"
            pass_if='^==PROF== Profiling' run "ncu bench gpu $section" "$log" \
                ncu --clock-control none --set full ${ncu_kill[@]+"${ncu_kill[@]}"} \
                --kernel-name 'regex:_tc$' --launch-skip 10 --launch-count 2 \
                "$bench_bin" "$section" --quick
            if [[ -f "$log" ]] && ! grep -q '^==PROF== Profiling' "$log"; then
                say "SKIP ncu after $section: it profiled no kernel (no counters here? $(grep -m1 '==ERROR==' "$log"))"
                failed=1
                break
            fi
        done
    fi
else
    say "SKIP bench gpu (not in this bundle)"
fi
# The candle training step on CUDA (criterion filter `cuda`: its CUDA rows only): RING S=8,
# grng's and candle's AdamW on the MLP 784-1024-1024-10 at m = 256 (issue 11's H100 target:
# RING S=8 below ASDL's 1.26 ms).
if [[ -f "$pkg/bench/candle_step" ]]; then
    CRITERION_HOME="$out/criterion" run "bench candle_step cuda" "$out/bench-candle-step.log" \
        "$pkg/bench/candle_step" --bench cuda \
        --warm-up-time 1 --measurement-time 3
    [[ -f "$out/bench-candle-step.log" ]] &&
        grep -A2 '^candle-step-cuda' "$out/bench-candle-step.log" | tee -a "$summary"
    rm -rf "$out/criterion"
else
    say "SKIP bench candle_step (not in this bundle)"
fi
# The test binaries, JOBS at a time (the summary lists them in the bundle's order).
export -f run say left cap
export out summary budget step_limit t_start
ls "$pkg"/tests/* | xargs -P "$jobs" -I{} bash -c \
    'n="$(basename "$1")"; failed=0; run "test $n" "$out/tests/$n.log" "$1"; exit $failed' _ {} ||
    failed=1
# shellcheck disable=SC2086 # GRNG_MAIN_ARGS is a word list by design
run "main job --device cuda" "$out/main.log" \
    "$pkg/bin/grng" --device cuda --out "$out/main" ${GRNG_MAIN_ARGS:---epochs 2}
if [[ -f "$pkg/bin/candle_mlp" ]]; then
    # shellcheck disable=SC2086 # GRNG_CANDLE_MLP_ARGS is a word list by design
    run "candle_mlp --device cuda" "$out/candle-mlp.log" \
        "$pkg/bin/candle_mlp" --device cuda ${GRNG_CANDLE_MLP_ARGS:-}
    [[ -f "$out/candle-mlp.log" ]] && tail -n 12 "$out/candle-mlp.log" | tee -a "$summary"
else
    say "SKIP candle_mlp (not in this bundle)"
fi
small="$pkg/tests/emu_elementwise"
if [[ $sanitizer == 0 ]]; then
    say "SKIP compute-sanitizer (--no-sanitizer)"
elif command -v compute-sanitizer >/dev/null 2>&1; then
    for tool in memcheck racecheck; do
        run "compute-sanitizer $tool emu_elementwise" "$out/sanitizer-$tool.log" \
            compute-sanitizer --tool "$tool" --error-exitcode 1 "$small"
    done
else
    say "FAIL compute-sanitizer not found (CUDA toolkit bin not on PATH)"
    failed=1
fi

if [[ $failed == 0 ]]; then say "ALL PASSED"; else say "SOME FAILED"; fi
exit "$failed"
