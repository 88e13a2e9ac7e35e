#!/usr/bin/env bash
# Compares two builds of vrdma across hosts, in alternated rounds of one run: each round runs
# the cluster benchmark (crates/vrdma-cli/tests/cluster_bench.rs: two simulated hosts, UCX TCP
# between their namespaces beside vrdma between containers on them, then one pair against
# PAIRS pairs at once) once with the OLD build and once with the NEW one. Every figure is
# taken beside UCX's from the same moment, so the builds compare by their ratios to UCX
# (send_lat p50 / UCX, write_lat p50 / UCX, write_bw 1 MiB / UCX, PAIRS-pair aggregate / one
# pair), and by their own figures. Prints every round, then per figure the medians of each
# build and NEW / OLD.
#
# Usage: scripts/bench-cluster-builds.sh OLD_TEST_BIN NEW_TEST_BIN
#   each a cluster_bench test executable, built with
#   `cargo test --release -p vrdma-cli --test cluster_bench --no-run` in that build's tree
#   (it finds its own vrdma and vrdmad in the same target directory).
# ROUNDS (default 3), PAIRS (default 8); E2E_LOCK=FILE runs each benchmark under flock(1) on
# FILE (to share the machine's test namespaces with other runs). Needs root, etcd-server and
# ../shared/bench/ucx-baseline.
set -uo pipefail
[ $# -eq 2 ] || { echo "usage: $0 OLD_TEST_BIN NEW_TEST_BIN" >&2; exit 2; }
old=$(realpath "$1") new=$(realpath "$2")
for b in "$old" "$new"; do [ -x "$b" ] || { echo "not an executable: $b" >&2; exit 2; }; done
cd "$(dirname "$0")/.."
export UCX_BASELINE=${UCX_BASELINE:-$(cd .. && pwd)/shared/bench/ucx-baseline}
ROUNDS=${ROUNDS:-3} PAIRS=${PAIRS:-8}
work=$(mktemp -d /tmp/vrdma-bench-cluster-builds.XXXXXX)
# Searchable by a container's root, an unprivileged uid on the host (user namespace).
chmod 755 "$work"
trap 'rm -rf "$work"' EXIT

results=$work/results
: >"$results"
for r in $(seq "$ROUNDS"); do
  for side in old new; do
    bin=$old; [ $side = new ] && bin=$new
    out=$work/$side.$r.log
    lock=(); [ -n "${E2E_LOCK:-}" ] && lock=(flock "$E2E_LOCK")
    if ! VRDMA_BENCH_ROUNDS=1 VRDMA_BENCH_PAIRS=$PAIRS "${lock[@]}" "$bin" --ignored --exact bench_across_hosts \
      --nocapture --test-threads 1 >"$out" 2>&1; then
      echo "round $r $side: the benchmark failed; its output:" >&2
      tail -30 "$out" >&2
      echo "$side nan nan nan nan nan nan" >>"$results"
      continue
    fi
    # "round 1: ... (1.23x) | write_lat ... (1.10x) | write_bw ... (0.95x)" and
    # "scaling round 1: ... = 0.91 x one pair".
    line=$(python3 - "$out" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
r = re.search(r"^round 1: .*", text, re.M)
row = r.group(0) if r else ""
def num(pattern):
    m = re.search(pattern, row)
    return m.group(1) if m else "nan"
x = re.findall(r"\(([0-9.]+|NaN|nan|inf)x\)", row)
s = re.search(r"^scaling round 1: .*= ([0-9.]+) x one pair", text, re.M)
vals = (x + ["nan"] * 3)[:3] + [s.group(1) if s else "nan"]
vals += [num(r"send_lat p50 ([0-9.]+)"), num(r"write_bw 1 MiB ([0-9.]+) MB/s")]
print(" ".join(v.lower() for v in vals))
PY
)
    echo "round $r $side send_p50/ucx write_p50/ucx write_bw/ucx pairs/one send_p50_us write_bw_MBps: $line"
    echo "$side $line" >>"$results"
  done
done
python3 - "$results" <<'PY'
import math, statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
def med(side, i):
    v = [float(r[i]) for r in rows if r[0] == side and not math.isnan(float(r[i]))]
    return statistics.median(v) if v else float("nan")
for name, i in (("send_lat 8 B p50 / UCX TCP", 1), ("write_lat 8 B p50 / UCX TCP", 2),
                ("write_bw 1 MiB / UCX TCP", 3), ("pairs aggregate / one pair", 4),
                ("send_lat 8 B p50 (us)", 5), ("write_bw 1 MiB (MB/s)", 6)):
    o, n = med("old", i), med("new", i)
    print(f"{name}: old {o:.2f}  new {n:.2f}  new/old {n / o:.3f}")
PY
