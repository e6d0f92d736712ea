#!/usr/bin/env bash
# Interleaved before/after timing of `benches/step.rs` on a noisy machine: each round runs every
# given bench binary once (criterion, 1 s warm-up, 3 s measurement), and the summary prints,
# per bench and binary, the least and the median of the rounds' point estimates. The `GRNG_BENCH_*`
# variables of benches/step.rs pass through to every run.
#
#   cargo bench --bench step --no-run          # prints the binary's path; copy it per commit
#   GRNG_BENCH_EMA=0 GRNG_BENCH_ONLY=adamw,ring GRNG_BENCH_SKIPS=8 \
#       scripts/step-compare.sh 3 /tmp/step-before /tmp/step-after
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 ROUNDS BENCH_BINARY..." >&2
    exit 2
fi
rounds=$1
shift
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for _ in $(seq "$rounds"); do
    for bin in "$@"; do
        # Criterion prints the bench name, then `time: [low estimate high]`; keep the estimate
        # in ms, tagged with the binary's file name.
        "$bin" --bench --warm-up-time 1 --measurement-time 3 2>&1 |
            grep -E "time:|^step" | paste - - |
            awk -v b="$(basename "$bin")" '{n = $1; sub(".*/batch=[0-9]+/", "", n); t = $5;
                if ($6 == "µs") t /= 1000; if ($6 == "s") t *= 1000; print b, n, t}' >>"$log"
    done
done
python3 - "$log" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    binary, bench, ms = line.split()
    runs[(bench, binary)].append(float(ms))
for (bench, binary), t in sorted(runs.items()):
    print(f"{bench:16s} {binary:20s} least {min(t):9.3f}  median {statistics.median(t):9.3f} ms  (n = {len(t)})")
PY
