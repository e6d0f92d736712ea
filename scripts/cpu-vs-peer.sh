#!/usr/bin/env bash
# Issue 13's CPU table in one run: the last binary's GEMM flops per step (each ratio's floor), then
# `benches/step.rs` binaries interleaved (scripts/step-compare.sh)
# at the defaults (RING ε = 0.95, NGD ε = 0), at RING's ε = 0 with T = 1 and T = 5, then the
# peer (optax AdamW, kfac-jax K-FAC: scripts/peer_kfac_jax.py) and AdamW against optax in
# three interleaved rounds. Run it on a quiet machine; compare ratios within the run.
#
#   cargo bench --bench step --no-run                  # copy the printed binary per commit
#   python3 -m venv /work/venv-peer && /work/venv-peer/bin/pip install \
#       kfac-jax==0.0.8 jax==0.8.2 jaxlib==0.8.2 optax    # once (newer jax breaks kfac-jax)
#   scripts/cpu-vs-peer.sh /tmp/step-before /tmp/step-after
#
# ROUNDS (default 3) sets the interleaved rounds; PEER_PYTHON (default /work/venv-peer/bin/python)
# the peer's interpreter. The last binary given is the one timed against optax.
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 BENCH_BINARY..." >&2
    exit 2
fi
cd "$(dirname "$0")/.."
rounds=${ROUNDS:-3}
py=${PEER_PYTHON:-/work/venv-peer/bin/python}
compare=scripts/step-compare.sh
last=${*: -1}
# The GEMM work per step (benches/step.rs's `--test` mode prints it and times nothing): where
# two steps run the same micro-kernel near its peak, their time ratio does not fall below it.
echo "== GEMM GFLOP per step, $(basename "$last"): defaults; RING ε = 0 with T = 1, T = 5"
GRNG_BENCH_ONLY=adamw,ring,ngd GRNG_BENCH_SKIPS=8 "$last" --test 2>&1 | grep GFLOP
GRNG_BENCH_EMA=0 GRNG_BENCH_ONLY=ring GRNG_BENCH_SKIPS=8 "$last" --test 2>&1 | grep GFLOP
GRNG_BENCH_EMA=0 GRNG_BENCH_LM_INTERVAL=5 GRNG_BENCH_ONLY=ring GRNG_BENCH_SKIPS=8 \
    "$last" --test 2>&1 | grep GFLOP
echo "== $(date -u +%H:%M:%S) defaults (RING ε = 0.95, NGD ε = 0), S = 8"
GRNG_BENCH_ONLY=adamw,ring,ngd GRNG_BENCH_SKIPS=8 $compare "$rounds" "$@"
echo "== RING ε = 0, T = 1, S = 8"
GRNG_BENCH_EMA=0 GRNG_BENCH_ONLY=adamw,ring GRNG_BENCH_SKIPS=8 $compare "$rounds" "$@"
echo "== RING ε = 0, T = 5, S = 8"
GRNG_BENCH_EMA=0 GRNG_BENCH_LM_INTERVAL=5 GRNG_BENCH_ONLY=adamw,ring GRNG_BENCH_SKIPS=8 \
    $compare "$rounds" "$@"
echo "== $(date -u +%H:%M:%S) peer"
"$py" scripts/peer_kfac_jax.py 2>&1 | tail -5
echo "== AdamW against optax, interleaved"
for _ in $(seq "$rounds"); do
    "$py" scripts/peer_kfac_jax.py --only-adamw --steps 20 2>/dev/null | tail -1
    GRNG_BENCH_ONLY=adamw "$last" --bench --warm-up-time 1 --measurement-time 3 2>&1 | grep time:
done
echo "== $(date -u +%H:%M:%S) end"
