#!/bin/bash
# One stream's `vrdma perf write_bw` through a private `vrdmad --mediated --no-engine-lanes`
# (every WR through the engine's shared connection, on one host), for builds alternated
# round by round: bin directories as arguments (default target/release). Root.
# Usage: flock /tmp/vrdma-e2e.lock scripts/bench-mediated-bw.sh [BINDIR...]
# ROUNDS (3), SIZES ("1048576 4194304"), SECS (4), PERF_ARGS (more perf options on both
# sides, e.g. "--mem file" for copied MRs), LANES=1 (lanes on).
set -u
. "$(dirname "$0")/lib/private-daemon.sh"
BINS=("$@"); [ ${#BINS[@]} -gt 0 ] || BINS=("$(dirname "$0")/../target/release")
run() { # bindir size port
  local BIN=$1 S=$2 P=$3 D=/tmp/vrdma-bench-mbw-$$
  start_private_daemon "$BIN" $D --mediated $([ "${LANES:-0}" = 1 ] || echo --no-engine-lanes) || return 1
  local DP=$DPID
  $BIN/vrdma vnic create mbw-a --tenant t --ip 198.18.231.2/15 >/dev/null
  $BIN/vrdma vnic create mbw-b --tenant t --ip 198.18.231.3/15 >/dev/null
  $BIN/vrdma run --vnic mbw-b -- $BIN/vrdma perf write_bw -s $S -D ${SECS:-4} -p $P ${PERF_ARGS:-} >/dev/null 2>&1 &
  sleep 1
  $BIN/vrdma run --vnic mbw-a -- $BIN/vrdma perf write_bw -s $S -D ${SECS:-4} -p $P ${PERF_ARGS:-} --json 198.18.231.3 2>&1 | tail -1 |
    python3 -c 'import json,sys; print("%.0f MB/s" % json.loads(sys.stdin.read())["bw_avg_MBps"])' 2>/dev/null || echo failed
  sleep 1; kill $DP; wait $DP 2>/dev/null; rm -rf $D
}
for round in $(seq ${ROUNDS:-3}); do
  for s in ${SIZES:-1048576 4194304}; do
    line="round $round, $s B:"
    for i in "${!BINS[@]}"; do line="$line  ${BINS[$i]}: $(run "${BINS[$i]}" $s $((18700 + i)))"; done
    echo "$line"
  done
done
