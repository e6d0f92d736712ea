#!/usr/bin/env bash
# Runs the whole test suite N times, each with a fresh GRNG_TEST_SEED, and lists every failing
# test with the seed that replays it:
#   GRNG_TEST_SEED=<seed> cargo test --release --test <binary> <test>
# Builds once, then runs the test binaries directly (doctests draw no random input: skipped).
# Exits non-zero on any failure.
set -euo pipefail
n=${1:?usage: scripts/flake-hunt.sh N}
cd "$(dirname "$0")/.."

bins=$(cargo test --release --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["executable"])')
[ -n "$bins" ] || { echo "flake-hunt: no test binaries built" >&2; exit 2; }

failures=()
for run in $(seq 1 "$n"); do
    seed=$(od -An -N8 -tu8 /dev/urandom | tr -d ' ')
    echo "run $run/$n: GRNG_TEST_SEED=$seed"
    for bin in $bins; do
        name=$(basename "$bin" | sed 's/-[0-9a-f]*$//')
        if ! out=$(GRNG_TEST_SEED=$seed "$bin" 2>&1); then
            failed=$(printf '%s\n' "$out" | sed -n 's/^test \(.*\) \.\.\. FAILED$/\1/p')
            [ -n "$failed" ] || failed="(binary exited non-zero)"
            while IFS= read -r t; do
                echo "  FAILED $name::$t"
                failures+=("GRNG_TEST_SEED=$seed  $name::$t")
            done <<<"$failed"
        fi
    done
done

echo "flake-hunt: $n runs, ${#failures[@]} failures"
for f in "${failures[@]}"; do
    echo "  $f"
done
[ ${#failures[@]} -eq 0 ]
