#!/usr/bin/env bash
# Husky-style isolation figures (issue 29): crates/vrdma-cli/tests/husky.rs with longer runs
# (VRDMA_HUSKY_SECS, default 5 here; VRDMA_HUSKY_LAT_ITERS, default 20000), its ignored cases
# included, then the table of its `husky-row` lines. Needs root and etcd-server; takes the
# shared end-to-end lock. Builds in release with LTO off and 16 codegen units (quicker to
# build; say so beside the figures).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16
export VRDMA_HUSKY_SECS=${VRDMA_HUSKY_SECS:-5} VRDMA_HUSKY_LAT_ITERS=${VRDMA_HUSKY_LAT_ITERS:-20000}
log=$(mktemp /tmp/vrdma-bench-husky.XXXXXX)
cargo test --release -p vrdma-cli --test husky --no-run --quiet
# (A case that misses its target fails; the table shows it all the same.)
flock /tmp/vrdma-e2e.lock cargo test --release -p vrdma-cli --test husky -- --include-ignored --nocapture --test-threads 1 >"$log" 2>&1 || true
grep -q 'husky-row' "$log" || { tail -40 "$log"; echo "benchmark failed; full output in $log" >&2; exit 1; }
echo "victim: write_bw 64 KiB 1 QP (${VRDMA_HUSKY_SECS} s), send_lat 8 B (${VRDMA_HUSKY_LAT_ITERS} iterations); fair share = alone / 2"
printf '| %-12s | %9s | %9s | %6s | %9s | %9s | %6s | %10s |\n' antagonist "bw alone" "bw with" share "p99 alone" "p99 with" ratio "antag MB/s"
printf '|%s|%s|%s|%s|%s|%s|%s|%s|\n' -------------- ----------- ----------- -------- ----------- ----------- -------- ------------
# husky-row | name | alone MB/s | with MB/s | fair MB/s | with/fair | p99 alone | p99 with | ratio | antagonist MB/s
grep '^husky-row' "$log" | awk -F' [|] ' '{ printf "| %-12s | %9s | %9s | %5.0f%% | %7s us | %7s us | %5sx | %10s |\n", $2, $3, $4, 100 * $6, $7, $8, $9, $10 }'
grep -E '^test .* (ok|FAILED|ignored)$' "$log" || true
echo "(full output in $log)"
