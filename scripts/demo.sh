#!/usr/bin/env bash
# The main job on a fresh machine: install what is missing, build, start vrdmad on its
# embedded default, create two vNICs, run two containers that exchange SEND/RECV, WRITE,
# READ and atomics with every byte checked, then measure latency and bandwidth.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "run as root (namespaces, veth, /run/vrdma)" >&2; exit 1; }
./scripts/deps.sh
cargo build --release --workspace --quiet
./scripts/install-dropin.sh --no-build   # target/lib/vrdma/libibverbs.so.1, found by `vrdma run`
export PATH="$PWD/target/release:$PATH" RUST_BACKTRACE=0
run_dir=${VRDMA_RUN_DIR:-/run/vrdma}
if ! [ -S "$run_dir/admin.sock" ] || ! vrdma vnic list >/dev/null 2>&1; then
  echo "== starting vrdmad (run dir $run_dir, embedded store in ${VRDMA_STATE_DIR:-/var/lib/vrdma})"
  nohup vrdmad >/tmp/vrdmad.log 2>&1 &
  for _ in $(seq 50); do vrdma vnic list >/dev/null 2>&1 && break; sleep 0.1; done
fi
for v in demo-a demo-b; do
  vrdma vnic list | awk '{print $1}' | grep -qx "$v" || vrdma vnic create "$v" --tenant demo
done
vrdma vnic list
addr_a=$(vrdma vnic list --json | python3 -c 'import json,sys; print([v["vnic"]["ip"] for v in json.load(sys.stdin) if v["vnic"]["name"]=="demo-a"][0])')
pair() { # pair ARGS... : server in container demo-a, client in demo-b
  vrdma run --vnic demo-a -- "$@" & local srv=$!
  sleep 0.3
  vrdma run --vnic demo-b -- "$@" "$addr_a"
  wait "$srv"
}
echo "== data check: SEND/RECV, RDMA WRITE, RDMA READ, atomics between two containers"
pair vrdma check
echo "== unmodified ibverbs-utils inside a container, over the drop-in libibverbs.so.1"
vrdma run --vnic demo-a -- ibv_devices
echo "== latency (8 bytes)"
for t in write_lat send_lat read_lat atomic_lat; do echo "-- $t"; pair vrdma perf "$t" -s 8 -n 100000; done
echo "== bandwidth"
echo "-- write_bw 64 KiB and 1 MiB"; pair vrdma perf write_bw -s 65536 -n 20000; pair vrdma perf write_bw -s 1048576 -n 2000
echo "-- send_bw 8 bytes (message rate)"; pair vrdma perf send_bw -s 8 -n 2000000
echo "== vrdma is running; vNICs stay for more experiments (vrdma vnic list)"
