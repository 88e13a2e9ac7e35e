#!/usr/bin/env bash
# Cross-host figures: UCX TCP between two simulated hosts (network namespaces) beside vrdma
# between containers on them (send/write latency, 1 MiB write bandwidth), then one pair
# alone against N container pairs at once (VRDMA_BENCH_PAIRS, default 64), each in
# VRDMA_BENCH_ROUNDS alternating rounds (default 3) with their medians. Needs root and
# etcd-server; run it on a quiet machine, and compare ratios within one run only.
# VRDMAD_EXTRA_ARGS adds options to every vrdmad (e.g. --engine-no-follow-cpu, to compare).
set -euo pipefail
cd "$(dirname "$0")/.."
export UCX_BASELINE=${UCX_BASELINE:-$(cd .. && pwd)/shared/bench/ucx-baseline}
log=$(mktemp /tmp/vrdma-bench-cluster.XXXXXX)
cargo build --release --workspace --quiet
if cargo test --release -p vrdma-cli --test cluster_bench -- --ignored --nocapture --test-threads 1 >"$log" 2>&1; then
  sed -n '/==== across hosts/,$p' "$log"
else
  tail -40 "$log"; echo "benchmark failed; full output in $log" >&2; exit 1
fi
