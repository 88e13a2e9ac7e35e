#!/usr/bin/env bash
# Compares builds across two simulated hosts by WR size, in alternated rounds of one run:
# each round sets up the hosts with each build in turn (scripts/lib/sim-hosts.sh: its own
# daemons, host certificates, a container on each host) and runs `vrdma perf` between the
# containers: write_bw (MB/s, -D 2; and the other BW_TESTS) and send_lat (p50 us, 1000
# iterations) for each size.
# Prints every figure, then per figure and build the median of the rounds and, for two or
# more builds, each build / the first.
#
# Usage: scripts/bench-cluster-wrs.sh BUILD_DIR...
#   each a directory holding vrdma, vrdmad and libvrdma_ibverbs.so (a target/release, or a
#   copy of one), e.g. the commit before a change and the change itself.
# ROUNDS (default 2), SIZES (default "8192 16384 65536"), BW_TESTS (default "write_bw"; e.g.
# "write_bw read_bw"), VRDMAD_EXTRA_ARGS (options for every vrdmad). Needs root and etcd-server; compare within one run only.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 BUILD_DIR..." >&2; exit 2; }
builds=()
for b in "$@"; do
  for f in vrdma vrdmad libvrdma_ibverbs.so; do [ -e "$b/$f" ] || { echo "$b: no $f" >&2; exit 2; }; done
  builds+=("$(cd "$b" && pwd)")
done
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench-cluster-wrs.sh: needs root (containers, namespaces)" >&2; exit 1; }
rounds=${ROUNDS:-2} sizes=${SIZES:-8192 16384 65536} bw_tests=${BW_TESTS:-write_bw}
work=$(mktemp -d /tmp/vrdma-bench-cluster-wrs.XXXXXX)
# Searchable by a container's root, an unprivileged uid on the host (user namespace).
chmod 755 "$work"
results=$work/results
pids=()
netns=()
# shellcheck source=scripts/lib/sim-hosts.sh
source scripts/lib/sim-hosts.sh
trap 'sim_hosts_down; rm -rf "$work"' EXIT

# perf_pair TEST SIZE ARGS...: the client's last line of `vrdma perf TEST` from xa to xb.
perf_pair() {
  local test=$1 size=$2 rsh=$work/cluster/rsh
  shift 2
  "$rsh" xb "$bin/vrdma perf $test -s $size $*" >/dev/null 2>&1 &
  local server=$!
  sleep 0.5
  "$rsh" xa "$bin/vrdma perf $test -s $size $* $xb_ip" 2>&1 | tail -1
  wait "$server" || true
}

for round in $(seq "$rounds"); do
  # Alternate the order of the builds from round to round, so none is always first.
  order=("${builds[@]}")
  if [ $((round % 2)) = 0 ]; then
    order=()
    for ((i = ${#builds[@]} - 1; i >= 0; i--)); do order+=("${builds[i]}"); done
  fi
  for bin in "${order[@]}"; do
    rm -rf "$work/cluster" "$work/lib"
    mkdir -p "$work/lib"
    cp "$bin/libvrdma_ibverbs.so" "$work/lib/libibverbs.so.1"
    cluster_setup
    xb_ip=$(ip netns exec vrh1-apps env VRDMA_RUN_DIR="$work/cluster/h1/run" "$bin/vrdma" vnic list |
      awk '$1 == "xb" {sub("/.*", "", $3); print $3}')
    for s in $sizes; do
      # (A failed run's last line is an error: its fields are not numbers.)
      for t in $bw_tests; do
        bw=$(perf_pair "$t" "$s" -D 2 | awk '$4 ~ /^[0-9.]+$/ {print $4}')
        echo "round $round $bin: $t $s ${bw:-failed} MB/s"
        echo "$bin $t-$s-MBps ${bw:-nan}" >>"$results"
      done
      lat=$(perf_pair send_lat "$s" -n 1000 | awk '$5 ~ /^[0-9.]+$/ {print $5}')
      echo "round $round $bin: send_lat $s p50 ${lat:-failed} us"
      echo "$bin send_lat-$s-p50-us ${lat:-nan}" >>"$results"
    done
    sim_hosts_down
  done
done

echo "=== medians over $rounds rounds (and / the first build)"
python3 - "$results" "${builds[@]}" <<'PY'
import collections, math, statistics, sys
vals = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    build, metric, v = line.split()
    v = float(v)
    if not math.isnan(v):
        vals[metric][build].append(v)
builds = sys.argv[2:]
for metric in sorted(vals):
    first = statistics.median(vals[metric][builds[0]]) if vals[metric][builds[0]] else None
    for b in builds:
        got = vals[metric][b]
        if not got:
            print(f"{metric:24} {b}: no figure")
            continue
        m = statistics.median(got)
        rel = f"  {m / first:.3f} x the first" if first and b != builds[0] else ""
        print(f"{metric:24} {b}: {m:10.1f}{rel}")
PY
