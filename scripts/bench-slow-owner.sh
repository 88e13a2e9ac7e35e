#!/bin/bash
# A pair whose own memory is slow: `vrdma perf write_bw --mem file` (copied MRs, reached
# through /proc/PID/mem on the owner's agent) through one vrdmad --mediated, with both perf
# processes holding their mmap_lock for writing in a loop (scripts/lib/mmap-lock-hog.c,
# LD_PRELOADed: mprotect over HOG_MB MiB), so each access of their memory waits. Prints the
# pair's rate over SECS seconds (default 30) and how its run ended. Root; release binaries
# in $BIN (default target/release). Usage: flock /tmp/vrdma-e2e.lock scripts/bench-slow-owner.sh
set -u
D=/tmp/vrdma-slow-owner-$$; BIN=${BIN:-$(dirname "$0")/../target/release}
SECS=${SECS:-30}; SIZE=${SIZE:-1048576}
. "$(dirname "$0")/lib/private-daemon.sh"
start_private_daemon "$BIN" $D --mediated || exit 1
export RUST_BACKTRACE=0
gcc -O2 -shared -fPIC -o $D/hog.so "$(dirname "$0")/lib/mmap-lock-hog.c" -lpthread || exit 1
V=$BIN/vrdma
$V vnic create so-a --tenant sot --ip 198.18.231.2/15 >/dev/null
$V vnic create so-b --tenant sot --ip 198.18.231.3/15 >/dev/null
HOG="LD_PRELOAD=$D/hog.so HOG_MB=${HOG_MB:-2048}"
env $HOG $V run --vnic so-b -- $V perf write_bw -s $SIZE -D $SECS -p 18610 --mem file >$D/server.out 2>&1 &
sleep 1
env $HOG timeout $((SECS + 15)) $V run --vnic so-a -- $V perf write_bw -s $SIZE -D $SECS -p 18610 --mem file --json --interval 1 198.18.231.3 >$D/client.out 2>&1
rc=$?
python3 - "$D/client.out" "$rc" <<'PY'
import json, sys
b = s = 0
for l in open(sys.argv[1]):
    if l.startswith("{") and "interval_s" in l:
        d = json.loads(l); b += d["bytes"]; s += d["interval_s"]
ends = [l.strip() for l in open(sys.argv[1]) if not l.startswith("{")]
print(json.dumps({"MBps": b / s / 1e6 if s else 0, "seconds": s, "exit": int(sys.argv[2]), "end": ends[-1] if ends else ""}))
PY
pkill -f "perf write_bw -s $SIZE -D $SECS -p 18610" 2>/dev/null
kill $DPID; wait $DPID 2>/dev/null
rm -rf $D
