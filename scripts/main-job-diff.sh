#!/usr/bin/env bash
# Runs the main job at commit REV and at the working tree, and says whether their results are
# identical: the table with its time columns masked, out/curves.svg byte for byte, and
# out/curves.csv without its `train_time_s` column. For changes that must not change behaviour.
#
# Usage: scripts/main-job-diff.sh REV [MAIN-JOB FLAGS...]
# REV is built in a temporary worktree with its own target folder (a full release build).
set -euo pipefail
cd "$(dirname "$0")/.."
rev="${1:?usage: scripts/main-job-diff.sh REV [flags]}"
shift
tmp="$(mktemp -d)"
trap 'git worktree remove --force "$tmp/base" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git worktree add --detach "$tmp/base" "$rev" >/dev/null
echo "main-job-diff: building $rev (release)" >&2
(cd "$tmp/base" && cargo build --release --bin grng >/dev/null 2>&1)
echo "main-job-diff: building the working tree (release)" >&2
cargo build --release --bin grng >/dev/null 2>&1
"$tmp/base/target/release/grng" --out "$tmp/a" "$@" >"$tmp/a.txt" 2>/dev/null
target/release/grng --out "$tmp/b" "$@" >"$tmp/b.txt" 2>/dev/null
# Times (a number with a unit) and the wall-time line are the only columns allowed to differ.
mask() { sed -E 's/[0-9]+(\.[0-9]+)? (ms|µs|s)\b/T/g; s/^wall time .*//; s/ +/ /g; s/-+/-/g' "$1"; }
ok=1
if diff <(mask "$tmp/a.txt") <(mask "$tmp/b.txt") >"$tmp/table.diff"; then
    echo "table: identical (time columns masked)"
else
    ok=0
    echo "table: DIFFERS"
    cat "$tmp/table.diff"
fi
if cmp -s "$tmp/a/curves.svg" "$tmp/b/curves.svg"; then
    echo "curves.svg: identical"
else
    ok=0
    echo "curves.svg: DIFFERS"
fi
cols() { cut -d, -f1-6 "$1"; }
if [[ "$(head -1 "$tmp/a/curves.csv")" == *,train_time_s ]] &&
    cmp -s <(cols "$tmp/a/curves.csv") <(cols "$tmp/b/curves.csv"); then
    echo "curves.csv: identical but for train_time_s ($(wc -l <"$tmp/a/curves.csv") lines)"
else
    ok=0
    echo "curves.csv: DIFFERS"
fi
[[ $ok == 1 ]]
