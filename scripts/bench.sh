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
for round in $(seq "${ROUNDS:-3}"); do
  echo "=== round $round: UCX"
  [ -x "$baseline" ] && "$baseline"
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
  echo "=== round $round: drop-in perftest (#bytes #iters t_min t_max t_typical t_avg ... / #bytes #iters BW_peak BW_avg MsgRate)"
  pair ib_write_lat -x 0 -s 8 -n 100000 2>&1 | grep -E '^ *8 ' | head -1
  pair ib_send_lat -x 0 -s 8 -n 100000 2>&1 | grep -E '^ *8 ' | head -1
  pair ib_write_bw -x 0 -s 1048576 -n 2000 2>&1 | grep -E '^ *1048576 ' | head -1
done
