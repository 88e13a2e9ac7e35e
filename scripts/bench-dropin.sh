#!/usr/bin/env bash
# The drop-in's overhead (the target: no more than 10% over vrdma perf for the same test):
# perftest through the drop-in and `vrdma perf` between the same two containers, the same
# test, size and iteration count, alternated ROUNDS times (default 15) so that both see the
# same machine; prints each pair and, per test, the ratio of the two sides' medians over
# the rounds and the median of the per-round ratios. Latency compares perftest's median
# (t_typical, computed from its per-iteration samples) with vrdma perf's p50, and the
# averages; bandwidth compares BW average (both in MB of 2^20 bytes). vrdma perf runs these
# as perftest does on a vNIC (-I 0 --spin plain, see below). Needs what scripts/bench.sh
# needs.
# Why many short latency runs (LAT_ITERS, default 20000) rather than a few long ones: on
# this VM an 8-byte ping-pong's latency settles for the whole life of a process pair (40
# windows of 5000 iterations of one run agree within 2%) but differs from one pair to the
# next by up to 40% (0.11 to 0.20 us, either program), so each run is one sample and only
# the number of runs narrows the comparison.
# ROUNDS (default 15), LAT_ITERS, PIN (default 1, below), TESTS (default: loop write_lat
# send_lat read_lat write_bw send_bw; `loop` is the C loops against vrdma perf write_lat
# and send_lat).
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/target/release:$PATH" RUST_BACKTRACE=0
for v in bench-a:198.18.20.2 bench-b:198.18.20.3; do
  vrdma vnic list | awk '{print $1}' | grep -qx "${v%%:*}" || vrdma vnic create "${v%%:*}" --tenant bench --ip "${v#*:}/15" >/dev/null
done
# PIN=1 (the default on two or more CPUs) pins the server to CPU 0 and the client to CPU 1,
# both sides of every comparison alike: a process migrating between CPUs mid-run moves a
# sub-microsecond latency by more than the 10% this script looks for.
if [ "${PIN:-1}" = 1 ] && [ "$(nproc)" -ge 2 ]; then on0=(taskset -c 0); on1=(taskset -c 1); else on0=(); on1=(); fi
pair() { vrdma run --vnic bench-a -- "${on0[@]}" "$@" & local s=$!; sleep 0.4; vrdma run --vnic bench-b -- "${on1[@]}" "$@" 198.18.20.2; wait $s; }
# The client's output alone (with -H both sides print every sample, and interleaved lines
# would not parse).
client() { vrdma run --vnic bench-a -- "${on0[@]}" "$@" >/dev/null 2>&1 & local s=$!; sleep 0.4; vrdma run --vnic bench-b -- "${on1[@]}" "$@" 198.18.20.2; wait $s; }
# Median and mean of perftest's per-iteration latencies (-H prints each, in us, to six
# digits; its summary's t_typical is the same median rounded to 0.01 us, which at 0.2 us is
# a 5% step, half the margin this script checks).
samples() { python3 -c 'import sys, statistics as s
v = [float(l.split(",")[1]) for l in sys.stdin if l[:1].isdigit() and l.count(",") == 1]
print(f"{s.median(v):.4f} {s.mean(v):.4f}" if len(v) > 1000 else "nan nan")'; }
json() { python3 -c 'import json,sys; r=[json.loads(l) for l in sys.stdin if l.startswith("{")][-1]; print(*[r[k] for k in sys.argv[1:]])' "$@"; }
# vrdma perf's write_lat and send_lat loops in C against libibverbs: through the drop-in
# they differ from vrdma perf by the C ABI layer alone (perftest's loops are its own code).
loop_bin=target/release/write_lat_loop
gcc -O2 -Wall -o "$loop_bin" crates/vrdma-ibverbs/bench/write_lat_loop.c -libverbs
results=$(mktemp)
lat_iters=${LAT_ITERS:-20000}
# record NAME DROPIN_COST VRDMA_PERF_COST: one round's pair (for bandwidth, the costs are
# vrdma perf's and the drop-in's bandwidth: lower is worse).
record() { echo "$1 $2 $3" >>"$results"; }
# loop_round NAME VRDMA_PERF_JSON LOOP_ARGS...: a C loop run through the drop-in against a
# vrdma perf run of the same loop.
loop_round() {
  local name=$1 vp=$2 lp vp_med vp_avg lp_med lp_avg
  shift 2
  lp=$(pair "$loop_bin" "$@" -s 8 -n "$lat_iters")
  read -r vp_med vp_avg <<<"$(echo "$vp" | json lat_p50_us lat_avg_us)"
  read -r lp_med lp_avg <<<"$(echo "$lp" | json lat_p50_us lat_avg_us)"
  echo "round $round $name${*:+ ($*)}: C loop through the drop-in p50 $lp_med avg $lp_avg us, vrdma perf p50 $vp_med avg $vp_avg us"
  record "$name-median" "$lp_med" "$vp_med"
  record "$name-average" "$lp_avg" "$vp_avg"
}
tests=" ${TESTS:-loop write_lat send_lat read_lat write_bw send_bw} "
want() { [[ $tests == *" $1 "* ]]; }
for round in $(seq "${ROUNDS:-15}"); do
  if want loop; then
    # The C loops: vrdma perf's write_lat (ibv_post_send, and -w the ibv_wr_* API) and
    # send_lat (-S) loops through the drop-in, against vrdma perf itself.
    vp=$(pair vrdma perf write_lat -s 8 -n "$lat_iters" --json)
    loop_round write_loop "$vp"
    loop_round write_loop-w "$vp" -w
    vp=$(pair vrdma perf send_lat -s 8 -n "$lat_iters" --json)
    loop_round send_loop "$vp" -S
    # The same, as perftest runs on a vNIC (nothing inline, no PAUSE in the wait): the C
    # ABI layer under perftest's conditions.
    vp=$(pair vrdma perf write_lat -s 8 -n "$lat_iters" --json -I 0 --spin plain)
    loop_round write_loop_plain "$vp" -I 0 -P
  fi
  for t in write_lat send_lat read_lat write_bw send_bw; do
    want "$t" || continue
    case $t in
      *_lat) size=8; iters=$lat_iters ;;
      write_bw) size=1048576; iters=5000 ;;
      send_bw) size=8; iters=1000000 ;;
    esac
    case $t in
      *_lat) ib=$(client "ib_$t" -x 0 -s "$size" -n "$iters" -H 2>&1) ;;
      *) ib=$(pair "ib_$t" -x 0 -s "$size" -n "$iters" 2>&1 | awk -v s="$size" '$1 == s {print; exit}') ;;
    esac
    # The same test as perftest runs it on a vNIC: nothing inline (perftest disables inline
    # on devices it does not know) and write_lat's memory polled without PAUSE, each poll
    # reading the byte and a stop flag, as ib_write_lat's loop reads the byte and its run
    # state; both sides read the clock before each post, as ib_write_lat does. (Before
    # vrdma perf's server did, vrdma perf reached this machine's fast mode of about 0.11 us
    # in a third of its runs; ib_write_lat, or a C loop stamping as it does, in none.)
    vp=$(pair vrdma perf "$t" -s "$size" -n "$iters" --json -I 0 --spin plain)
    case $t in
      *_lat)
        read -r ib_med ib_avg <<<"$(echo "$ib" | samples)"
        read -r vp_med vp_avg <<<"$(echo "$vp" | json lat_p50_us lat_avg_us)"
        echo "round $round $t: drop-in typical $ib_med avg $ib_avg us, vrdma perf p50 $vp_med avg $vp_avg us"
        record "$t-median" "$ib_med" "$vp_med"
        record "$t-average" "$ib_avg" "$vp_avg" ;;
      *)
        # perftest: #bytes #iters BW_peak BW_avg MsgRate; lower is worse, so the overhead is vrdma/drop-in
        ib_bw=$(echo "$ib" | awk '{print $4}')
        vp_bw=$(echo "$vp" | json bw_avg_MBps)
        echo "round $round $t: drop-in $ib_bw MB/s, vrdma perf $vp_bw MB/s"
        record "$t" "$vp_bw" "$ib_bw" ;;
    esac
  done
done
echo "=== drop-in cost / vrdma perf cost (time ratio; bandwidth inverted), target <= 1.10:"
echo "    ratio of the medians over the rounds, and the median of the per-round ratios"
python3 - "$results" <<'PY'
import statistics, sys, collections
d = collections.defaultdict(list)
for line in open(sys.argv[1]):
    try:
        k, a, b = line.split()
        a, b = float(a), float(b)
    except ValueError:  # a run that printed no figure
        continue
    if a > 0 and b > 0:
        d[k].append((a, b))
for k, v in d.items():
    ratios = [a / b for a, b in v]
    of_medians = statistics.median(a for a, _ in v) / statistics.median(b for _, b in v)
    print(f"{k:24} {of_medians:.3f}  median of rounds {statistics.median(ratios):.3f}  (rounds: {' '.join(f'{x:.2f}' for x in ratios)})")
PY
rm -f "$results"
