#!/usr/bin/env bash
# What metering and fair queuing cost (issue 29, Performance): crates/vrdma-cli/tests/qos_cost.rs
# in release, VRDMA_QOS_COST_ROUNDS alternating rounds (default 5, ABBA order) of vrdma perf on
# the direct path and across two simulated hosts with QoS policies absent and present (a cap
# too high to bind, weights set); prints each figure's medians and the cost. Targets: <= 3%
# direct, <= 5% across hosts. Needs root and etcd-server; takes the shared end-to-end lock.
# Builds with LTO off and 16 codegen units (quicker to build; say so beside the figures).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16
log=$(mktemp /tmp/vrdma-bench-qos-cost.XXXXXX)
cargo test --release -p vrdma-cli --test qos_cost --no-run --quiet
if flock /tmp/vrdma-e2e.lock cargo test --release -p vrdma-cli --test qos_cost -- --ignored --nocapture --test-threads 1 >"$log" 2>&1; then
  echo "rounds: ${VRDMA_QOS_COST_ROUNDS:-5}; medians; cost = slower latency or less throughput with policies present"
  printf '| %-30s | %10s | %10s | %7s |\n' measure absent present cost
  printf '|%s|%s|%s|%s|\n' -------------------------------- ------------ ------------ ---------
  grep '^qos-cost' "$log" | awk -F' [|] ' '{ printf "| %-30s | %10s | %10s | %7s |\n", $2, $3, $4, $5 }'
  echo "(per-round figures: grep qos-cost $log)"
else
  tail -40 "$log"; echo "benchmark failed; full output in $log" >&2; exit 1
fi
