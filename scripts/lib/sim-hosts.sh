# Shared by the benchmark scripts (sourced, not run): a private vrdmad with two vNICs on one
# host, or two simulated hosts (network namespaces on an underlay bridge, etcd, one vrdmad
# each, host certificates from an operator CA, as crates/vrdma-cli/tests/common/cluster.rs
# makes them) with a vNIC on each. The caller sets `bin` (vrdma, vrdmad), `work` (a scratch
# directory searchable by others, holding lib/libibverbs.so.1) and the arrays `pids` and
# `netns`, which list what its cleanup must kill and delete; `VRDMAD_EXTRA_ARGS` adds options
# to every vrdmad.
# Names and addresses are the benchmarks' own (no test uses them): vNICs apa/apb
# (198.18.77.2-3) on one host; hosts vrh1-apps/vrh2-apps on underlay 198.19.250.0/24 with
# vNICs xa (h1) and xb (h2), and `$work/cluster/rsh NAME CMD` runs CMD in NAME's container
# (or, for h1/h2, in that host's namespace).

wait_for() { for _ in $(seq 200); do [ -e "$1" ] && return 0; sleep 0.1; done; echo "no $1" >&2; return 1; }

# ---- one host: a private vrdmad and two vNICs (names and addresses no test uses) ----
host_setup() {
  mkdir -p "$work/one"
  # shellcheck disable=SC2086
  "$bin/vrdmad" --run-dir "$work/one/run" --state-dir "$work/one/state" --cdi-dir none ${VRDMAD_EXTRA_ARGS:-} 2>"$work/one/vrdmad.log" &
  pids+=($!)
  wait_for "$work/one/run/admin.sock"
  local v=(env VRDMA_RUN_DIR="$work/one/run" VRDMA_STATE_DIR="$work/one/state" "$bin/vrdma")
  "${v[@]}" vnic create apa --tenant apps --ip 198.18.77.2/15 >/dev/null
  "${v[@]}" vnic create apb --tenant apps --ip 198.18.77.3/15 >/dev/null
  cat >"$work/one/rsh" <<EOF
#!/bin/sh
host=\$1; shift
exec env VRDMA_RUN_DIR=$work/one/run VRDMA_STATE_DIR=$work/one/state VRDMA_LIB_DIR=$work/lib $bin/vrdma run --vnic "\$host" -- sh -c "\$*"
EOF
  chmod +x "$work/one/rsh"
}

# ---- two simulated hosts: underlay 198.19.250.0/24 (outside the tests' 100-239) ----
cluster_setup() {
  local c=$work/cluster
  mkdir -p "$c"
  ip link del vrulapps 2>/dev/null || true
  ip link add vrulapps type bridge
  ip addr add 198.19.250.1/24 dev vrulapps
  ip link set vrulapps up
  /usr/bin/etcd --name apps --data-dir "$c/etcd" \
    --listen-client-urls http://198.19.250.1:23799 --advertise-client-urls http://198.19.250.1:23799 \
    --listen-peer-urls http://127.0.0.1:23798 --initial-advertise-peer-urls http://127.0.0.1:23798 \
    --initial-cluster apps=http://127.0.0.1:23798 >/dev/null 2>"$c/etcd.log" &
  pids+=($!)
  for i in 1 2; do
    local ns=vrh$i-apps
    ip netns del "$ns" 2>/dev/null || true
    ip link del "vuapph$i" 2>/dev/null || true
    ip netns add "$ns"
    netns+=("$ns")
    ip link add "vuapph$i" type veth peer name ul0 netns "$ns"
    ip link set "vuapph$i" master vrulapps up
    ip -n "$ns" addr add "198.19.250.1$i/24" dev ul0
    ip -n "$ns" link set ul0 up
    ip -n "$ns" link set lo up
  done
  for _ in $(seq 100); do curl -fs http://198.19.250.1:23799/health >/dev/null 2>&1 && break; sleep 0.2; done
  # The transport as vrdmad runs it by default: host certificates from an operator CA
  # (mutual TLS between the daemons). The store is this script's own plain etcd.
  "$bin/vrdma" ca init --dir "$c/ca" >/dev/null
  for i in 1 2; do
    "$bin/vrdma" ca issue "h$i" --dir "$c/ca" --out "$c/h$i/state/tls" >/dev/null
    ip netns exec "vrh$i-apps" "$bin/vrdmad" --run-dir "$c/h$i/run" --state-dir "$c/h$i/state" \
      --store etcd://198.19.250.1:23799 --insecure-store --host "h$i" --cdi-dir none ${VRDMAD_EXTRA_ARGS:-} 2>"$c/h$i.log" &
    pids+=($!)
    wait_for "$c/h$i/run/admin.sock"
  done
  local v1=(ip netns exec vrh1-apps env VRDMA_RUN_DIR="$c/h1/run" VRDMA_STATE_DIR="$c/h1/state" "$bin/vrdma")
  "${v1[@]}" vnic create xa --tenant apps >/dev/null
  "${v1[@]}" vnic create xb --tenant apps --host h2 >/dev/null
  wait_for "$c/h2/run/vnics/xb/control.sock"
  cat >"$c/rsh" <<EOF
#!/bin/sh
host=\$1; shift
case \$host in
  xa) exec ip netns exec vrh1-apps env VRDMA_RUN_DIR=$c/h1/run VRDMA_STATE_DIR=$c/h1/state VRDMA_LIB_DIR=$work/lib $bin/vrdma run --vnic xa -- sh -c "\$*" ;;
  xb) exec ip netns exec vrh2-apps env VRDMA_RUN_DIR=$c/h2/run VRDMA_STATE_DIR=$c/h2/state VRDMA_LIB_DIR=$work/lib $bin/vrdma run --vnic xb -- sh -c "\$*" ;;
  h1) exec ip netns exec vrh1-apps sh -c "\$*" ;;
  h2) exec ip netns exec vrh2-apps sh -c "\$*" ;;
esac
exit 1
EOF
  chmod +x "$c/rsh"
}

# Stops what the setups started (every process in `pids`, every namespace in `netns`, the
# underlay bridge) and forgets it, so that a setup can run again.
sim_hosts_down() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for n in "${netns[@]}"; do ip netns del "$n" 2>/dev/null || true; done
  ip link del vrulapps 2>/dev/null || true
  pids=()
  netns=()
}
