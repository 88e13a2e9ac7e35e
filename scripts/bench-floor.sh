#!/usr/bin/env bash
# The least a daemon-mediated one-way can cost on this machine, beside the direct TCP path
# (crates/vrdmad/bench/wakeup_floor.c says what each mode does): two network namespaces
# joined by a veth pair (198.18.99.0/30), an 8-byte ping-pong pinned to CPUs 0 and 1, ROUNDS
# (default 3) rounds of each mode (MODES, default "direct daemon remote timed"). Needs root
# and two CPUs. Compare with ucx-baseline's TCP
# latency and with scripts/bench-cluster.sh (vrdma's engine between simulated hosts).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/wakeup_floor
mkdir -p target/release
gcc -O2 -Wall -o "$bin" crates/vrdmad/bench/wakeup_floor.c -lpthread
cleanup() { ip netns del vrdma-floor-a 2>/dev/null || true; ip netns del vrdma-floor-b 2>/dev/null || true; }
trap cleanup EXIT
cleanup
ip netns add vrdma-floor-a
ip netns add vrdma-floor-b
ip link add vrdma-fl-a type veth peer name vrdma-fl-b
ip link set vrdma-fl-a netns vrdma-floor-a
ip link set vrdma-fl-b netns vrdma-floor-b
ip -n vrdma-floor-a addr add 198.18.99.1/30 dev vrdma-fl-a
ip -n vrdma-floor-b addr add 198.18.99.2/30 dev vrdma-fl-b
for n in a b; do ip -n vrdma-floor-$n link set vrdma-fl-$n up; ip -n vrdma-floor-$n link set lo up; done
for round in $(seq "${ROUNDS:-3}"); do
  for mode in ${MODES:-direct daemon remote timed}; do
    echo "round $round $(timeout 120 "$bin" $mode "${ITERS:-30000}" 100)"
  done
done
