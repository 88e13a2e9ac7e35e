#!/usr/bin/env bash
# Benchmarks vrdma beside UCX in one session (ratios, never absolute times, are comparable):
# ../shared/bench/ucx-baseline (or $UCX_BASELINE), then vrdma perf and the drop-in under
# perftest between two containers, ROUNDS times (default 3). Needs vrdmad running (demo.sh
# starts it) and a release build with the drop-in installed (scripts/install-dropin.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/target/release:$PATH" RUST_BACKTRACE=0
baseline=${UCX_BASELINE:-../shared/bench/ucx-baseline}
for v in bench-a:198.18.20.2 bench-b:198.18.20.3; do
  vrdma vnic list | awk '{print $1}' | grep -qx "${v%%:*}" || vrdma vnic create "${v%%:*}" --tenant bench --ip "${v#*:}/15" >/dev/null
done
pair() { vrdma run --vnic bench-a -- "$@" & local s=$!; sleep 0.4; vrdma run --vnic bench-b -- "$@" 198.18.20.2; wait $s; }
# The client's output alone (with -H both sides print every sample).
client() { vrdma run --vnic bench-a -- "$@" >/dev/null 2>&1 & local s=$!; sleep 0.4; vrdma run --vnic bench-b -- "$@" 198.18.20.2; wait $s; }
# perftest's latency line, with its median (t_typical, printed to 0.01 us: at 0.06-0.1 us a
# 10-15% step) recomputed from the per-iteration samples of -H, to 0.1 ns.
perftest_lat() {
  client "$@" -H 2>&1 | python3 -c 'import sys, statistics as s
lines = sys.stdin.read().splitlines()
v = [float(l.split(",")[1]) for l in lines if l[:1].isdigit() and l.count(",") == 1]
row = next((l for l in lines if l.split()[:1] == ["8"]), "")
print(row.rstrip(), f" median of -H samples {s.median(v):.4f}" if v else " (no samples)")'
}
summary=$(mktemp)
for round in $(seq "${ROUNDS:-3}"); do
  echo "=== round $round: UCX"
  [ -x "$baseline" ] && "$baseline" | tee -a "$summary"
  echo "=== round $round: vrdma perf"
  pair vrdma perf write_lat -s 8 -n 200000 --json
  pair vrdma perf send_lat -s 8 -n 200000 --json
  pair vrdma perf write_bw -s 65536 -n 20000 --json
  pair vrdma perf write_bw -s 1048576 -n 2000 --json
  pair vrdma perf send_bw -s 8 -n 2000000 --json
  for q in 1 8 64; do pair vrdma perf write_bw -s 65536 -n 5000 -q "$q" --json; done
  pair vrdma perf write_bw -s 65536 -n 5000 -q 64 --buf-per-qp --json
  vrdma run --vnic bench-a -- vrdma perf reg_mr -s 1073741824 --json
  # The copying fallback (file-backed memory on both sides): what it costs against the above.
  pair vrdma perf write_lat -s 8 -n 20000 --mem file --json
  pair vrdma perf write_bw -s 1048576 -n 500 --mem file --json
  echo "=== round $round: drop-in perftest (#bytes #iters t_min t_max t_typical t_avg t_stdev 99% 99.9% / #bytes #iters BW_peak BW_avg MsgRate)"
  perftest_lat ib_write_lat -x 0 -s 8 -n 100000 | sed 's/^/ib_write_lat /' | tee -a "$summary"
  perftest_lat ib_send_lat -x 0 -s 8 -n 100000 | sed 's/^/ib_send_lat /' | tee -a "$summary"
  pair ib_write_bw -x 0 -s 1048576 -n 2000 2>&1 | grep -E '^ *1048576 ' | head -1 | sed 's/^/ib_write_bw /' | tee -a "$summary"
  echo "round-end" >>"$summary"
done
# Issue 3's ratios, per round (each against UCX's figure of the same round) and their median.
echo "=== drop-in / UCX by round (targets: latency <= 1.5, bandwidth >= 0.8)"
python3 - "$summary" <<'PY'
import re, statistics, sys
rounds, cur = [], {}
for line in open(sys.argv[1]):
    f = line.split()
    if not f:
        continue
    if f[0] == "round-end":
        rounds.append(cur); cur = {}
    elif f[0].startswith("ucx_") and len(f) == 2:
        cur[f[0]] = float(f[1])
    elif f[0] in ("ib_write_lat", "ib_send_lat"):
        m = re.search(r"median of -H samples ([\d.]+)", line)
        if m:
            cur[f[0]] = float(m.group(1))
    elif f[0] == "ib_write_bw" and len(f) >= 5:
        cur[f[0]] = float(f[4])
checks = [("ib_write_lat", "ucx_shm_put_lat_8b_us"), ("ib_send_lat", "ucx_shm_tag_lat_8b_us"), ("ib_write_bw", "ucx_shm_put_bw_1m_MBps")]
for ours, theirs in checks:
    r = [d[ours] / d[theirs] for d in rounds if d.get(ours) and d.get(theirs)]
    if r:
        print(f"{ours} / {theirs}: median {statistics.median(r):.2f} (rounds: {' '.join(f'{x:.2f}' for x in r)})")
    else:
        print(f"{ours} / {theirs}: no figures")
PY
rm -f "$summary"
