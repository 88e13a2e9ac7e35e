#!/bin/bash
# A victim pair's send_lat (8 B) and write_bw (64 KiB) through one vrdmad --mediated: alone,
# beside an attacker pair's 1 MiB write_bw from file-backed memory (which the engine's
# threads read and write through /proc/PID/mem), and the same with the attacker's processes
# holding their mmap_lock for writing (scripts/lib/mmap-lock-hog.c, LD_PRELOADed: mprotect
# over HOG_MB MiB of populated memory in a loop). Root; release binaries in $BIN (default
# target/release). Usage: flock /tmp/vrdma-e2e.lock scripts/bench-mmap-lock.sh
set -u
D=/tmp/vrdma-mmap-lock-$$; BIN=${BIN:-$(dirname "$0")/../target/release}
HOG=$D/hog.so
pkill -f "$D/run" 2>/dev/null; sleep 0.5
. "$(dirname "$0")/lib/private-daemon.sh"
start_private_daemon "$BIN" $D --mediated || exit 1
export RUST_BACKTRACE=0
gcc -O2 -shared -fPIC -o $HOG "$(dirname "$0")/lib/mmap-lock-hog.c" -lpthread || exit 1
V=$BIN/vrdma
$V vnic create mv-a --tenant mvt --ip 198.18.230.2/15 >/dev/null
$V vnic create mv-b --tenant mvt --ip 198.18.230.3/15 >/dev/null
$V vnic create mx-a --tenant mxt --ip 198.18.230.4/15 >/dev/null
$V vnic create mx-b --tenant mxt --ip 198.18.230.5/15 >/dev/null
victim() { # test size port extra...
  local t=$1 s=$2 p=$3; shift 3
  $V run --vnic mv-b -- $V perf $t -s $s -p $p "$@" >/dev/null 2>&1 &
  local spid=$!
  sleep 1
  $V run --vnic mv-a -- $V perf $t -s $s -p $p --json "$@" 198.18.230.3 2>&1 | tail -1
  timeout 20 tail --pid=$spid -f /dev/null
}
attacker_start() { # extra env
  env "$@" $V run --vnic mx-b -- $V perf write_bw -s 1048576 -D 60 -p 18600 --mem file >/dev/null 2>&1 &
  sleep 1
  env "$@" $V run --vnic mx-a -- $V perf write_bw -s 1048576 -D 60 -p 18600 --mem file --json --interval 1 198.18.230.5 > $D/attacker.out 2>&1 &
  sleep 3
}
attacker_stop() { # prints the attacker's own rate over the phase (its per-second lines)
  pkill -f "perf write_bw -s 1048576 -D 60 -p 18600"; sleep 1
  python3 -c 'import json,sys
b=s=0
for l in open(sys.argv[1]):
    if l.startswith("{") and "interval_s" in l:
        d=json.loads(l); b+=d["bytes"]; s+=d["interval_s"]
print(json.dumps({"attacker_MBps": b/s/1e6 if s else 0, "seconds": s}))' $D/attacker.out
}
echo "== alone"
victim send_lat 8 18520 -n 20000
victim write_bw 65536 18521 -D 4
echo "== beside file-MR write_bw, no hog"
attacker_start X=1
victim send_lat 8 18522 -n 20000
victim write_bw 65536 18523 -D 4
attacker_stop
echo "== beside file-MR write_bw, hog (mprotect over ${HOG_MB:-2048} MiB in the attacker's perf processes)"
attacker_start LD_PRELOAD=$HOG HOG_MB=${HOG_MB:-2048}
victim send_lat 8 18524 -n 20000
victim write_bw 65536 18525 -D 4
attacker_stop
kill $DPID
rm -rf $D
