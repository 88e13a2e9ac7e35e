#!/usr/bin/env bash
# Compares two builds of vrdma on the direct path, in alternated rounds of one run: for each
# round and each build, that build's vrdmad (private run and state directories) serves two
# fresh vNICs and `vrdma perf` runs between them (server and client as host processes opening
# the vNICs through VRDMA_SOCKET; no containers, so builds whose `vrdma run` differs compare
# the data path alone). Prints every round, then per figure the medians, ranges and the
# ratio NEW / OLD. A refactoring should give ratios within the rounds' own spread.
#
# Usage: scripts/bench-builds.sh OLD_BIN_DIR NEW_BIN_DIR   (each holding vrdma and vrdmad)
# FIGURES: `write` (default: 8-byte write_lat, 1 MiB write_bw) or `send` (send_lat 8 B and
# 64 KiB, send_bw 8 B, 64 KiB and 1 MiB). ROUNDS (default 5), LAT_ITERS (default 20000),
# BW_SECS (write, default 3), BW_ITERS (send, default 20000; a tenth at 1 MiB).
set -uo pipefail
[ $# -eq 2 ] || { echo "usage: $0 OLD_BIN_DIR NEW_BIN_DIR" >&2; exit 2; }
old=$(realpath "$1") new=$(realpath "$2")
for b in "$old" "$new"; do
  for f in vrdma vrdmad; do [ -x "$b/$f" ] || { echo "missing $b/$f" >&2; exit 2; }; done
done
ROUNDS=${ROUNDS:-5} LAT_ITERS=${LAT_ITERS:-20000} BW_SECS=${BW_SECS:-3} BW_ITERS=${BW_ITERS:-20000}
work=$(mktemp -d /tmp/vrdma-bench-builds.XXXXXX)
# Searchable by a container's root, an unprivileged uid on the host (user namespace).
chmod 755 "$work"
daemon=
cleanup() {
  [ -n "$daemon" ] && kill "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
port=19400

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

field() { python3 -c "import json,sys; print(json.load(sys.stdin)['$1'])" 2>/dev/null || echo nan; }

case ${FIGURES:-write} in
  write) figures=(
    "write_lat_8B_p50_us write_lat -s 8 -n $LAT_ITERS lat_p50_us"
    "write_bw_1MiB_MBps write_bw -s 1048576 -D $BW_SECS bw_avg_MBps"
  ) ;;
  send) figures=(
    "send_lat_8B_p50_us send_lat -s 8 -n $LAT_ITERS lat_p50_us"
    "send_lat_64KiB_p50_us send_lat -s 65536 -n $((LAT_ITERS / 4)) lat_p50_us"
    "send_bw_8B_MBps send_bw -s 8 -n $BW_ITERS bw_avg_MBps"
    "send_bw_64KiB_MBps send_bw -s 65536 -n $BW_ITERS bw_avg_MBps"
    "send_bw_1MiB_MBps send_bw -s 1048576 -n $((BW_ITERS / 10)) bw_avg_MBps"
  ) ;;
  *) echo "FIGURES is write or send" >&2; exit 2 ;;
esac
results=$work/results
: >"$results"
for r in $(seq "$ROUNDS"); do
  for side in old new; do
    bin=$old; [ $side = new ] && bin=$new
    line="round $r $side"
    for f in "${figures[@]}"; do
      set -- $f
      name=$1 key=${!#}
      args=("${@:2:$(($# - 2))}")
      v=$(one "$bin" "${args[@]}" | field "$key")
      line="$line $name $v"
      echo "$side $name $v" >>"$results"
    done
    echo "$line"
  done
done
python3 - "$results" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
names = list(dict.fromkeys(r[1] for r in rows))
for n in names:
    def vals(side):
        return [float(r[2]) for r in rows if r[0] == side and r[1] == n and r[2] != "nan"]
    o, w = vals("old"), vals("new")
    if not o or not w:
        print(f"{n}: missing"); continue
    mo, mw = statistics.median(o), statistics.median(w)
    print(f"{n}: old {mo:.3f} ({min(o):.3f}-{max(o):.3f})  new {mw:.3f} ({min(w):.3f}-{max(w):.3f})  new/old {mw / mo:.3f}")
PY
