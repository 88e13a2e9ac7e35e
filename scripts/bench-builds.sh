#!/usr/bin/env bash
# Compares two builds of vrdma on the direct path, in alternated rounds of one run: for each
# round and each build, that build's vrdmad (private run and state directories) serves two
# vNICs and `vrdma perf` runs 8-byte write_lat and 1 MiB write_bw between them (server and
# client as host processes opening the vNICs through VRDMA_SOCKET; no containers, so builds
# whose `vrdma run` differs compare the data path alone). Prints every round, then per figure
# the medians and the ratio NEW / OLD of the medians. A refactoring should give ratios within
# the rounds' own spread.
#
# Usage: scripts/bench-builds.sh OLD_BIN_DIR NEW_BIN_DIR   (each holding vrdma and vrdmad)
# ROUNDS (default 5), LAT_ITERS (default 20000), BW_SECS (default 3).
set -uo pipefail
[ $# -eq 2 ] || { echo "usage: $0 OLD_BIN_DIR NEW_BIN_DIR" >&2; exit 2; }
old=$(realpath "$1") new=$(realpath "$2")
for b in "$old" "$new"; do
  for f in vrdma vrdmad; do [ -x "$b/$f" ] || { echo "missing $b/$f" >&2; exit 2; }; done
done
ROUNDS=${ROUNDS:-5} LAT_ITERS=${LAT_ITERS:-20000} BW_SECS=${BW_SECS:-3}
work=$(mktemp -d /tmp/vrdma-bench-builds.XXXXXX)
daemon=
cleanup() {
  [ -n "$daemon" ] && kill "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
port=18900

# one BIN TEST ARGS... -> the client's JSON row of `vrdma perf TEST` between two fresh vNICs.
one() {
  local bin=$1 test=$2; shift 2
  rm -rf "$work/run" "$work/state"; mkdir -p "$work/run" "$work/state"
  VRDMA_RUN_DIR=$work/run RUST_LOG=warn "$bin/vrdmad" --run-dir "$work/run" --state-dir "$work/state" \
    $("$bin/vrdmad" --help 2>/dev/null | grep -q -- --cdi-dir && echo --cdi-dir none) 2>>"$work/vrdmad.log" &
  daemon=$!
  for _ in $(seq 100); do [ -S "$work/run/admin.sock" ] && break; sleep 0.1; done
  VRDMA_RUN_DIR=$work/run "$bin/vrdma" vnic create ba --tenant bench >/dev/null
  VRDMA_RUN_DIR=$work/run "$bin/vrdma" vnic create bb --tenant bench >/dev/null
  port=$((port + 1))
  VRDMA_SOCKET=$work/run/vnics/ba/control.sock "$bin/vrdma" perf "$test" -p $port "$@" >/dev/null 2>>"$work/perf.log" &
  local srv=$!
  sleep 0.3
  VRDMA_SOCKET=$work/run/vnics/bb/control.sock "$bin/vrdma" perf "$test" -p $port --json "$@" 127.0.0.1 2>>"$work/perf.log" | tail -n 1
  wait "$srv" 2>/dev/null
  kill "$daemon" 2>/dev/null; wait "$daemon" 2>/dev/null; daemon=
}

results=$work/results
: >"$results"
for r in $(seq "$ROUNDS"); do
  for side in old new; do
    bin=$old; [ $side = new ] && bin=$new
    lat=$(one "$bin" write_lat -s 8 -n "$LAT_ITERS" | python3 -c 'import json,sys; print(json.load(sys.stdin)["lat_p50_us"])' 2>/dev/null || echo nan)
    bw=$(one "$bin" write_bw -s 1048576 -D "$BW_SECS" | python3 -c 'import json,sys; print(json.load(sys.stdin)["bw_avg_MBps"])' 2>/dev/null || echo nan)
    echo "round $r $side write_lat_8b_p50_us $lat write_bw_1m_MBps $bw"
    echo "$side $lat $bw" >>"$results"
  done
done
python3 - "$results" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
def med(side, i):
    v = [float(r[i]) for r in rows if r[0] == side and r[i] != "nan"]
    return statistics.median(v) if v else float("nan")
for name, i in (("write_lat 8 B p50 (us)", 1), ("write_bw 1 MiB (MB/s)", 2)):
    o, n = med("old", i), med("new", i)
    print(f"{name}: old {o:.3f}  new {n:.3f}  new/old {n / o:.3f}")
PY
