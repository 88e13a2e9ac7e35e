#!/bin/busybox sh
# PID 1 of the cgroup v2 virtual machine (tests/cgroup_v2.rs): a kernel that mounts only the
# unified hierarchy, vrdmad and one vNIC, then `vrdma run` with and without limits. Reports a
# line `CHECK <name> ok|FAIL <what was seen>` per check and `VM DONE` at the end; the test
# asserts them. Runs as busybox sh (the machine has no other shell).
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount -t tmpfs tmp /tmp
mount -t tmpfs run /run
for m in $(cat /mods/order); do insmod "/mods/$m.ko" || echo "insmod $m failed"; done
ip link set lo up

check() { # name, condition (shell), what was seen
  if eval "$2"; then echo "CHECK $1 ok"; else echo "CHECK $1 FAIL $3"; fi
  echo "at $(cut -d' ' -f1 /proc/uptime) s"
}
# Waits up to $2 tenths of a second for the condition $1.
wait_for() {
  n=0
  while ! eval "$1"; do
    n=$((n + 1))
    [ $n -ge "$2" ] && return 1
    sleep 0.1
  done
}
# The cgroup directory of the one container running (empty when none).
container_cgroup() { ls -d /sys/fs/cgroup/vrdma/ca-* 2>/dev/null | head -1; }
# The processes in cgroup $1 (cgroupfs files have size 0: `test -s` cannot tell).
procs_in() { cat "$1/cgroup.procs" 2>/dev/null | tr '\n' ' '; }

echo "controllers: $(cat /sys/fs/cgroup/cgroup.controllers); v1 mounts: $(grep -c ' cgroup ' /proc/mounts)"
vrdmad --run-dir /run/vrdma --state-dir /tmp/state >/tmp/vrdmad.log 2>&1 &
wait_for '[ -S /run/vrdma/admin.sock ]' 300 || echo "vrdmad did not start: $(cat /tmp/vrdmad.log)"
export VRDMA_RUN_DIR=/run/vrdma VRDMA_STATE_DIR=/tmp/state
vrdma vnic create ca --tenant t --ip 198.18.20.2/15 >/dev/null

# 1. Limits as given, seen from the host while the container runs; a killed `vrdma run`
#    takes its container with it, and the next run removes the cgroup it left.
vrdma run --vnic ca --pids-limit 64 --memory 64M --cpus 0.5 -- sh -c 'cat /proc/self/cgroup; exec sleep 1000' >/tmp/a.out 2>&1 &
run_a=$!
wait_for '[ -n "$(container_cgroup)" ] && [ -n "$(procs_in "$(container_cgroup)")" ]' 600
cg=$(container_cgroup)
wait_for 'grep -q "^0::" /tmp/a.out' 300
check container_in_its_cgroup 'grep -q "^0::/vrdma/ca-" /tmp/a.out' "cgroup dir '$cg', the container's /proc/self/cgroup: $(cat /tmp/a.out)"
check pids_max '[ "$(cat $cg/pids.max)" = 64 ]' "$(cat $cg/pids.max)"
check memory_max '[ "$(cat $cg/memory.max)" = 67108864 ]' "$(cat $cg/memory.max)"
check swap_off '[ ! -e $cg/memory.swap.max ] || [ "$(cat $cg/memory.swap.max)" = 0 ]' "$(cat $cg/memory.swap.max)"
check cpu_max '[ "$(cat $cg/cpu.max)" = "50000 100000" ]' "$(cat $cg/cpu.max)"
check container_running '[ -n "$(procs_in $cg)" ]' "nothing in '$cg': $(cat /tmp/a.out)"
kill -9 $run_a
wait_for '[ -z "$(procs_in $cg)" ]' 100
check killed_run_leaves_no_process '[ -z "$(procs_in $cg)" ]' "still in $cg: $(procs_in $cg)"

# 2. Enforcement: a fork bomb stops at pids.max, an allocation past memory.max is killed (one
#    under it is not), a busy loop is throttled to its CPU quota. The bomb forks in a subshell
#    (busybox's shell exits when it cannot fork) and is counted and killed with builtins only.
vrdma run --vnic ca --pids-limit 32 --memory 64M --cpus 0.5 -- sh -c '
  (i=0; while [ $i -lt 100 ]; do sleep 60 & i=$((i + 1)); done) 2>/dev/null
  set -- /proc/[0-9]*; echo "PROCS $#"
  for p in /proc/[0-9]*; do read -r c <$p/comm; [ "$c" = sleep ] && kill ${p#/proc/}; done
  dd if=/dev/zero of=/dev/null bs=16M count=1 2>/dev/null; echo "SMALL_DD $?"
  dd if=/dev/zero of=/dev/null bs=96M count=1 2>/dev/null; echo "BIG_DD $?"
  t0=$(cut -d" " -f1 /proc/uptime); end=$(($(date +%s) + 4)); while [ $(date +%s) -lt $end ]; do :; done
  echo "BUSY_FROM $t0 TO $(cut -d" " -f1 /proc/uptime)"
' >/tmp/b.out 2>&1 &
run_b=$!
check stale_cgroup_removed_by_the_next_run 'wait_for "[ ! -e $cg ]" 300' "$cg is still there"
# The busy loop's throttling, read from the host: the cgroup goes with the container.
wait_for 'grep -q BIG_DD /tmp/b.out' 1200
cg=$(container_cgroup)
sleep 2
stat=$(cat $cg/cpu.stat 2>/dev/null | tr '\n' ' ')
wait $run_b
procs=$(sed -n 's/^PROCS //p' /tmp/b.out)
check fork_bomb_stops_at_pids_max '[ -n "$procs" ] && [ "$procs" -le 32 ] && [ "$procs" -ge 16 ]' "$(cat /tmp/b.out)"
check allocation_under_the_limit_runs 'grep -q "^SMALL_DD 0" /tmp/b.out' "$(cat /tmp/b.out)"
check allocation_past_the_limit_is_killed 'grep -q "^BIG_DD 137" /tmp/b.out' "$(cat /tmp/b.out)"
throttled=$(echo "$stat" | sed -n 's/.*nr_throttled \([0-9]*\).*/\1/p')
check cpu_quota_throttles '[ -n "$throttled" ] && [ "$throttled" -gt 0 ]' "cpu.stat: $stat"
check cgroup_removed_after_the_run '[ ! -e "$cg" ]' "$cg is still there"

# 3. Defaults: 2048 pids, half the memory, no CPU quota; and no cgroup at all when every limit
#    is lifted.
vrdma run --vnic ca -- sleep 1000 >/dev/null 2>&1 &
run_d=$!
wait_for '[ -n "$(container_cgroup)" ] && [ -n "$(procs_in "$(container_cgroup)")" ]' 600
cg=$(container_cgroup)
half=$(($(sed -n 's/^MemTotal: *\([0-9]*\) kB/\1/p' /proc/meminfo) * 512))
mem=$(cat $cg/memory.max)
check default_pids_max '[ "$(cat $cg/pids.max)" = 2048 ]' "$(cat $cg/pids.max)"
check default_memory_max_is_half_the_ram '[ $((mem / 4096)) -eq $((half / 4096)) ]' "memory.max $mem, half of MemTotal $half"
check default_cpu_unlimited '[ "$(cat $cg/cpu.max)" = "max 100000" ]' "$(cat $cg/cpu.max)"
kill $run_d
wait $run_d
check cgroup_removed_after_sigterm '[ ! -e "$cg" ]' "$cg is still there"
out=$(vrdma run --vnic ca --pids-limit 0 --memory 0 -- cat /proc/self/cgroup 2>&1)
check no_limits_no_cgroup '[ "$out" = "0::/" ]' "$out"

# 4. Started from a limited cgroup (a pod's, a slice's: /job, its processes in /job/runner),
#    the container's cgroup goes beside the caller's, under /job, whose limits bind it too:
#    its own pids.max is 64, /job's 24.
mkdir -p /sys/fs/cgroup/job
echo "+pids +memory +cpu" >/sys/fs/cgroup/job/cgroup.subtree_control
mkdir -p /sys/fs/cgroup/job/runner
echo 24 >/sys/fs/cgroup/job/pids.max
sh -c 'echo $$ >/sys/fs/cgroup/job/runner/cgroup.procs; exec vrdma run --vnic ca --pids-limit 64 -- sh -c "
  cat /proc/self/cgroup
  (i=0; while [ \$i -lt 100 ]; do sleep 60 & i=\$((i + 1)); done) 2>/dev/null
  set -- /proc/[0-9]*; echo PROCS \$#
  for p in /proc/[0-9]*; do read -r c <\$p/comm; [ \"\$c\" = sleep ] && kill \${p#/proc/}; done
"' >/tmp/j.out 2>&1
procs=$(sed -n 's/^PROCS //p' /tmp/j.out)
check container_beside_the_callers_cgroup 'grep -q "^0::/job/vrdma/ca-" /tmp/j.out' "$(cat /tmp/j.out)"
check the_callers_parent_limits_bind '[ -n "$procs" ] && [ "$procs" -le 24 ] && [ "$procs" -ge 8 ]' "$(cat /tmp/j.out)"
check no_cgroup_left_under_the_parent '[ -z "$(ls -d /sys/fs/cgroup/job/vrdma/ca-* 2>/dev/null)" ]' "$(ls /sys/fs/cgroup/job/vrdma)"

echo "vrdmad log:"; tail -5 /tmp/vrdmad.log
echo "VM DONE"
poweroff -f
