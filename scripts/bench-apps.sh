#!/usr/bin/env bash
# MPI application figures (issue 30): a Graph-500-style BFS + SSSP (bench/apps/graph500.c, our
# own kernel written to the specification: CI cannot fetch the reference code) and an
# OSU-style sweep over freshly allocated buffers (bench/apps/fresh_buffers.c, the registration
# cache's worst case) and Graph-500's exchange alone (bench/apps/fresh_alltoallv.c: fresh
# buffers around each MPI_Alltoallv, 16 KiB to 4 MiB to each rank, every byte checked; app
# `a2av`, not run unless in APPS) and the data path alone (bench/apps/exchange.c: the same
# buffers throughout, ping-pong and simultaneous exchange per size, 8 B to 1 MiB, every
# message's stamp and every block's bytes checked; app `exchange`), built with Debian's mpicc
# and run with Debian's Open MPI:
# Then (one host, APPS including regmr) registration times through the drop-in
# (bench/apps/reg_mr_repeat.c: first, repeated and overlapping registration, deregistration)
# and `vrdma perf reg_mr`, for 4 KiB, 1 MiB and 1 GiB (REG_SIZES).
#   one host:  vrdma  - Open MPI over UCX, UCX defaults, one rank in each of two `vrdma run`
#                       containers (the drop-in libibverbs; mpirun starts them through an rsh
#                       agent that is `vrdma run`, as crates/vrdma-cli/tests/dropin.rs does)
#              vrdmamoved - as vrdma, moving every registered range onto shared memory instead
#                       of registering above 64 KiB in place (VRDMA_MR_MOVE_MAX=inf, the
#                       default before 2026-11-28; not run unless in MODES)
#              vrdmarndv - as vrdma, with UCX_RNDV_THRESH=$RNDV (default inf: no rendezvous;
#                       not run unless in MODES)
#              tcp    - Open MPI ob1/tcp between the same two containers
#              vader  - Open MPI ob1/vader (shared memory), both ranks on the host
#   across two simulated hosts (network namespaces on an underlay bridge, etcd, one vrdmad
#   each, as crates/vrdma-cli/tests/common/cluster.rs makes them):
#              vrdma  - UCX defaults between a container on each host (the mediated engine;
#                       but UCX sees one kernel, so its defaults send large messages by
#                       cma, process_vm_readv, between the "hosts", bypassing vrdma)
#              vrdmarc - the same with UCX_TLS=rc_verbs,ud_verbs,self (what real hosts get)
#              ucxtcp - Open MPI over UCX with UCX_TLS=tcp between the host namespaces
#              ob1tcp - Open MPI ob1/tcp between the host namespaces (the underlay)
# Each placement runs with the ranks free (`spread`) and with both on CPU 0 (`onecpu`,
# taskset: what two containers that each think they are a node do to Graph-500's pinning).
# The modes alternate within each round; the script prints every figure, each round's
# ratios (vrdma / other, higher is better for vrdma; latencies inverted) and their medians.
# Needs root, mpicc/mpirun, etcd-server (for `cluster`), and a quiet machine for figures
# that mean anything. Variables:
#   ROUNDS (3), SCALES ("16 20"), ROOTS (graph500 roots per run, 16; at most 64),
#   PLACES ("spread onecpu"), WHERE ("host cluster"), APPS ("graph500 fresh exchange regmr"; also a2av),
#   MODES (the modes above to run, default all of the place's; e.g. "vrdma tcp"),
#   VRDMA_BIN_DIR (vrdma, vrdmad and libvrdma_ibverbs.so; default: build target/release),
#   TIMEOUT (seconds per run, 1800), KEEP=1 keeps the scratch directory,
#   SIZES_PROFILE=1 preloads bench/apps/mpi_sizes.c into Graph-500's ranks and prints where
#   their communication time went by message size (rank 0's MPI_Alltoallv by bytes sent,
#   MPI_Alltoall, MPI_Allreduce) under each run's line.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench-apps.sh: needs root (containers, namespaces)" >&2; exit 1; }
rounds=${ROUNDS:-3} scales=${SCALES:-16 20} roots=${ROOTS:-16} places=${PLACES:-spread onecpu}
where=${WHERE:-host cluster} apps=${APPS:-graph500 fresh exchange regmr} limit=${TIMEOUT:-1800}
reg_sizes=${REG_SIZES:-4096 1048576 1073741824}
if [ -z "${VRDMA_BIN_DIR:-}" ]; then
  cargo build --release --workspace --quiet
  VRDMA_BIN_DIR=$PWD/target/release
fi
bin=$(cd "$VRDMA_BIN_DIR" && pwd)
work=$(mktemp -d /tmp/vrdma-bench-apps.XXXXXX)
# Searchable by a container's root, an unprivileged uid on the host (user namespace).
chmod 755 "$work"
results=$work/results
pids=()
netns=()
# shellcheck source=scripts/lib/sim-hosts.sh
source scripts/lib/sim-hosts.sh
cleanup() {
  sim_hosts_down
  [ "${KEEP:-0}" = 1 ] && echo "kept $work" || rm -rf "$work"
}
trap cleanup EXIT
mpicc -O2 -o "$work/graph500" bench/apps/graph500.c -lm
mpicc -O2 -o "$work/fresh_buffers" bench/apps/fresh_buffers.c
mpicc -O2 -o "$work/fresh_alltoallv" bench/apps/fresh_alltoallv.c
mpicc -O2 -o "$work/exchange" bench/apps/exchange.c
mpicc -O2 -shared -fPIC -o "$work/libmpi_sizes.so" bench/apps/mpi_sizes.c
gcc -O2 -o "$work/reg_mr_repeat" bench/apps/reg_mr_repeat.c -libverbs
mkdir -p "$work/lib"
cp "$bin/libvrdma_ibverbs.so" "$work/lib/libibverbs.so.1"

# mpirun_mode WHERE MODE PIN APP ARGS...: one run; its output on stdout.
mpirun_mode() {
  local at=$1 mode=$2 pin=$3
  shift 3
  # (RUN_EXTRA: mpirun options for this run only, in every mode.)
  local base=(timeout "$limit" mpirun --allow-run-as-root -np 2 --bind-to none ${RUN_EXTRA:-})
  local wrap=()
  [ "$pin" = onecpu ] && wrap=(taskset -c 0)
  local ucx=(--mca pml ucx --mca osc ucx --mca btl self -x UCX_LOG_LEVEL=info ${MPI_EXTRA:-})
  case $at/$mode in
    host/vader) "${base[@]}" --mca pml ob1 --mca btl self,vader "${wrap[@]}" "$@" ;;
    host/*)
      local net=(--mca plm_rsh_agent "$work/one/rsh" --host apa,apb --mca oob_tcp_if_include 198.18.0.0/15)
      case $mode in
        vrdma) "${base[@]}" "${net[@]}" "${ucx[@]}" "${wrap[@]}" "$@" ;;
        vrdmarndv) "${base[@]}" "${net[@]}" "${ucx[@]}" -x UCX_RNDV_THRESH="${RNDV:-inf}" "${wrap[@]}" "$@" ;;
        vrdmamoved) "${base[@]}" "${net[@]}" "${ucx[@]}" -x VRDMA_MR_MOVE_MAX=inf "${wrap[@]}" "$@" ;;
        tcp) "${base[@]}" "${net[@]}" --mca pml ob1 --mca btl self,tcp --mca btl_tcp_if_include 198.18.0.0/15 "${wrap[@]}" "$@" ;;
      esac ;;
    cluster/*)
      local agent=(--mca plm_rsh_agent "$work/cluster/rsh" --mca oob_tcp_if_exclude lo,vrdma0)
      local in_h1=(ip netns exec vrh1-apps)
      case $mode in
        vrdma) "${in_h1[@]}" "${base[@]}" "${agent[@]}" --host xa,xb "${ucx[@]}" "${wrap[@]}" "$@" ;;
        vrdmarc) "${in_h1[@]}" "${base[@]}" "${agent[@]}" --host xa,xb "${ucx[@]}" -x UCX_TLS=rc_verbs,ud_verbs,self "${wrap[@]}" "$@" ;;
        # (Open MPI's pml ucx declines to run over UCX's tcp unless told to.)
        ucxtcp) "${in_h1[@]}" "${base[@]}" "${agent[@]}" --host h1,h2 --mca pml ucx --mca btl self \
          --mca pml_ucx_tls any --mca pml_ucx_devices any \
          -x UCX_TLS=tcp,self -x UCX_NET_DEVICES=ul0 "${wrap[@]}" "$@" ;;
        ob1tcp) "${in_h1[@]}" "${base[@]}" "${agent[@]}" --host h1,h2 --mca pml ob1 --mca btl self,tcp \
          --mca btl_tcp_if_include ul0 "${wrap[@]}" "$@" ;;
      esac ;;
  esac
}

# record ROUND WHERE PLACE MODE METRIC VALUE (higher is better)
record() { echo "$*" >>"$results"; }

# run_failed WHAT: reports run_app's failed run (its caller's round, at, pin, mode, wall, out).
run_failed() {
  echo "round $round $at $pin $mode $1: FAILED after ${wall}s"
  [ -n "${KEEP_OUT:-}" ] && echo "$out" > "$KEEP_OUT.$round.$mode"
  echo "$out" | grep -Ev "^\[.* UCX  (INFO|DIAG) " | tail -15 | sed 's/^/    /'
}

run_app() {
  local round=$1 at=$2 pin=$3 mode=$4 app=$5 scale=${6:-} out t0 t1
  t0=$(date +%s.%N)
  case $app in
    graph500)
      local prof=
      [ "${SIZES_PROFILE:-0}" = 1 ] && prof="-x LD_PRELOAD=$work/libmpi_sizes.so"
      out=$(RUN_EXTRA=$prof mpirun_mode "$at" "$mode" "$pin" "$work/graph500" -s "$scale" -n "$roots" 2>&1) || true ;;
    fresh) out=$(mpirun_mode "$at" "$mode" "$pin" "$work/fresh_buffers" -C -i 20 2>&1) || true ;;
    a2av) out=$(mpirun_mode "$at" "$mode" "$pin" "$work/fresh_alltoallv" -i 30 2>&1) || true ;;
    exchange) out=$(mpirun_mode "$at" "$mode" "$pin" "$work/exchange" 2>&1) || true ;;
  esac
  t1=$(date +%s.%N)
  local wall
  wall=$(python3 -c "print(f'{$t1-$t0:.1f}')")
  # Which UCX transport carried the tagged messages (UCX_LOG_LEVEL=info), once per setup.
  local tl
  tl=$(echo "$out" | grep -o 'tag([a-z_]*/[^)]*)' | sort -u | tr '\n' ' ' || true)
  case $app in
    graph500)
      local bfs sssp cons
      bfs=$(echo "$out" | awk '/^bfs_harmonic_mean_TEPS:/ {print $2}')
      sssp=$(echo "$out" | awk '/^sssp_harmonic_mean_TEPS:/ {print $2}')
      cons=$(echo "$out" | awk '/^construction_time:/ {print $2}')
      if [ -z "$bfs" ] || ! echo "$out" | grep -q "validation passed"; then
        run_failed "graph500 s$scale"
        return
      fi
      echo "round $round $at $pin $mode graph500 s$scale: BFS $bfs SSSP $sssp TEPS, construction ${cons}s, wall ${wall}s ${tl}"
      echo "$out" | grep "^mpi_sizes:" | sed 's/^/    /' || true
      record "$round $at $pin $mode g500-s$scale-bfs-TEPS $bfs"
      record "$round $at $pin $mode g500-s$scale-sssp-TEPS $sssp"
      record "$round $at $pin $mode g500-s$scale-construction-1/s $(python3 -c "print(1/$cons)")" ;;
    fresh)
      if ! echo "$out" | grep -q "fresh buffers: all"; then
        run_failed "fresh_buffers"
        return
      fi
      local row
      for s in 8 131072 4194304; do
        row=$(echo "$out" | awk -v s="$s" '$1 == "size" && $2 == s')
        record "$round $at $pin $mode fresh-$s-bw-MBps $(echo "$row" | awk '{print $4}')"
        record "$round $at $pin $mode fresh-$s-1/lat_us $(echo "$row" | awk '{print 1/$6}')"
      done
      echo "round $round $at $pin $mode fresh_buffers (bw MB/s, one-way lat us):" \
        "$(echo "$out" | awk '$1 == "size" && ($2 == 8 || $2 == 131072 || $2 == 4194304) {printf "%s: %s %s  ", $2, $4, $6}')wall ${wall}s ${tl}" ;;
    a2av)
      if ! echo "$out" | grep -q "fresh alltoallv: all checked"; then
        run_failed "fresh_alltoallv"
        return
      fi
      local size inv
      while read -r size inv; do
        record "$round $at $pin $mode a2av-$size-1/us $inv"
      done < <(echo "$out" | awk '$1 == "alltoallv" {print $2, 1 / $4}')
      echo "round $round $at $pin $mode fresh_alltoallv (bytes to each rank: us a call):" \
        "$(echo "$out" | awk '$1 == "alltoallv" {printf "%s: %s  ", $2, $4}')wall ${wall}s ${tl}" ;;
    exchange)
      if ! echo "$out" | grep -q "exchange: all checked"; then
        run_failed "exchange"
        return
      fi
      local size pp ex
      while read -r size pp ex; do
        record "$round $at $pin $mode exchange-$size-pingpong-1/us $pp"
        record "$round $at $pin $mode exchange-$size-both-1/us $ex"
      done < <(echo "$out" | awk '$1 == "exchange" && $3 == "pingpong_us" {print $2, 1 / $4, 1 / $6}')
      echo "round $round $at $pin $mode exchange (bytes: ping-pong us one way / both at once us):" \
        "$(echo "$out" | awk '$1 == "exchange" && $3 == "pingpong_us" {printf "%s: %s/%s  ", $2, $4, $6}')wall ${wall}s ${tl}" ;;
  esac
}

for at in $where; do
  case $at in
    host) host_setup; modes=${MODES:-vrdma tcp vader} ;;
    cluster) cluster_setup; modes=${MODES:-vrdma vrdmarc ucxtcp ob1tcp} ;;
    *) echo "WHERE: host or cluster" >&2; exit 1 ;;
  esac
  for round in $(seq "$rounds"); do
    for pin in $places; do
      for app in $apps; do
        [ "$app" = regmr ] && continue
        for scale in $([ "$app" = graph500 ] && echo "$scales" || echo "-"); do
          # Alternate the order of the modes from round to round, so neither is always first.
          ms=$modes
          [ $((round % 2)) = 0 ] && ms=$(echo "$modes" | tr ' ' '\n' | tac | tr '\n' ' ')
          for mode in $ms; do run_app "$round" "$at" "$pin" "$mode" "$app" "$scale"; done
        done
      done
    done
  done
done

if [[ " $apps " == *" regmr "* ]] && [[ " $where " == *" host "* ]]; then
  echo "=== registration through the drop-in in a container (median of 5 runs each)"
  one=(env VRDMA_RUN_DIR="$work/one/run" VRDMA_STATE_DIR="$work/one/state" VRDMA_LIB_DIR="$work/lib" "$bin/vrdma" run --vnic apa --)
  # shellcheck disable=SC2086
  "${one[@]}" "$work/reg_mr_repeat" -n 5 $reg_sizes || echo "reg_mr_repeat failed"
  for s in $reg_sizes; do "${one[@]}" "$bin/vrdma" perf reg_mr -s "$s" || echo "vrdma perf reg_mr -s $s failed"; done
fi

[ -s "$results" ] || exit 0 # (registration figures only: no ratios)
echo "=== vrdma / other (higher: vrdma better), per round and their median"
python3 - "$results" <<'PY'
import collections, statistics, sys
v = collections.defaultdict(dict)
for line in open(sys.argv[1]):
    r, at, pin, mode, metric, val = line.split()
    try:
        v[(at, pin, metric)].setdefault(mode, {})[r] = float(val)
    except ValueError:
        pass
for (at, pin, metric), modes in sorted(v.items()):
    for me in [m for m in sorted(modes) if m.startswith("vrdma")]:
        mine = modes[me]
        for other, vals in sorted(modes.items()):
            if other.startswith("vrdma"):
                continue
            ratios = [mine[r] / vals[r] for r in sorted(vals) if r in mine and vals[r] > 0]
            if ratios:
                print(f"{at:8}{pin:7}{metric:30} {me:7} / {other:7} median {statistics.median(ratios):6.3f}  rounds {' '.join(f'{x:.3f}' for x in ratios)}")
PY
