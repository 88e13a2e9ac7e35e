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
# perftest's latency line (its size in $1), with its median (t_typical, printed to 0.01 us:
# at 0.06-0.1 us a 10-15% step) and mean recomputed from the per-iteration samples of -H.
perftest_lat() {
  local size=$1; shift
  client "$@" -s "$size" -H 2>&1 | python3 -c 'import sys, statistics as s
size = sys.argv[1]
lines = sys.stdin.read().splitlines()
v = []
for l in lines:
    f = l.split(",")
    if l[:1].isdigit() and len(f) == 2:
        try:
            v.append(float(f[1]))
        except ValueError:
            pass
row = next((l for l in lines if l.split()[:1] == [size]), "")
print(row.rstrip(), f"| median of -H samples {s.median(v):.4f} mean {s.mean(v):.4f}" if v else "| (no samples)")' "$size"
}
summary=$(mktemp)
trap 'rm -f "$summary"' EXIT
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
  perftest_lat 8 ib_write_lat -x 0 -n 100000 | sed 's/^/ib_write_lat /' | tee -a "$summary"
  perftest_lat 8 ib_send_lat -x 0 -n 100000 | sed 's/^/ib_send_lat /' | tee -a "$summary"
  pair ib_write_bw -x 0 -s 1048576 -n 2000 2>&1 | grep -E '^ *1048576 ' | head -1 | sed 's/^/ib_write_bw /' | tee -a "$summary"
  echo "round-end" >>"$summary"
done
# Issue 3's ratios, per round (each against UCX's figure of the same round) and their median.
echo "=== drop-in / UCX by round (targets: latency <= 1.5, bandwidth >= 0.8; ucx-baseline's latency is UCX's average)"
python3 - "$summary" <<'PY'
import re, statistics, sys
rounds, cur = [], {}
def num(x):
    try:
        return float(x)
    except ValueError:  # ucx-baseline prints NAME FAILED for a failed run
        return None
for line in open(sys.argv[1]):
    f = line.split()
    if not f:
        continue
    if f[0] == "round-end":
        rounds.append(cur); cur = {}
    elif f[0].startswith("ucx_") and len(f) == 2:
        cur[f[0]] = num(f[1])
    elif f[0] in ("ib_write_lat", "ib_send_lat"):
        m = re.search(r"median of -H samples ([\d.]+) mean ([\d.]+)", line)
        if m:
            cur[f[0]] = float(m.group(1))
            cur[f[0] + " (mean)"] = float(m.group(2))
    elif f[0] == "ib_write_bw" and len(f) >= 5:
        cur[f[0]] = num(f[4])
# Latency: perftest's typical (its median) against UCX, as the latency target is stated, and
# its mean against UCX's figure (an average), like for like.
checks = [("ib_write_lat", "ucx_shm_put_lat_8b_us"), ("ib_write_lat (mean)", "ucx_shm_put_lat_8b_us"),
          ("ib_send_lat", "ucx_shm_tag_lat_8b_us"), ("ib_send_lat (mean)", "ucx_shm_tag_lat_8b_us"),
          ("ib_write_bw", "ucx_shm_put_bw_1m_MBps")]
for ours, theirs in checks:
    r = [(i, d[ours] / d[theirs]) for i, d in enumerate(rounds, 1) if d.get(ours) and d.get(theirs)]
    if r:
        print(f"{ours} / {theirs}: median {statistics.median(x for _, x in r):.2f} (by round: {' '.join(f'r{i}={x:.2f}' for i, x in r)})")
    else:
        print(f"{ours} / {theirs}: no figures")
PY
