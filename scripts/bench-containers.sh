#!/usr/bin/env bash
# Issue 28's performance point: the same figures between two podman containers as between
# two `vrdma run` containers in the same run. Each round runs perftest's 8-byte
# ib_write_lat and 1 MiB ib_write_bw through the drop-in between two podman containers
# (`--device vrdma.io/vnic=…`, the vrdma CNI network, podman's default sandbox, the image
# crates/vrdma-cli/tests/podman.rs caches) and between two `vrdma run` containers,
# alternating, so both see the same machine; prints each round and, per figure, the ratio
# podman / vrdma run of the medians over the rounds (target: within 5%, i.e. 0.95..1.05).
#
# It starts a vrdmad of its own (private run and state directories, its CDI spec in a file
# of its own in /var/run/cdi, a CNI network of its own) and removes it all at the end.
# Needs root, podman + runc + containernetworking-plugins, the podman test's cached root
# filesystem (run `cargo test -p vrdma-cli --test podman` once), and the built binaries:
# BIN (default target/release if built there, else target/debug) holding vrdma, vrdmad,
# vrdma-cni and libvrdma_ibverbs.so. ROUNDS (default 5), LAT_ITERS (default 5000),
# BW_ITERS (default 2000), VRDMA_RUN_ARGS (more `vrdma run` options, e.g. --privileged).
set -uo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "bench-containers.sh: needs root" >&2; exit 1; }
BIN=${BIN:-$([ -x target/release/vrdmad ] && echo target/release || echo target/debug)}
BIN=$(realpath "$BIN")
suite=$(. /etc/os-release; echo "${VERSION_CODENAME:-bookworm}")
rootfs=/var/cache/vrdma-test/podman-rootfs-1-$suite
[ -x "$rootfs/usr/bin/ib_write_bw" ] || { echo "no cached root filesystem $rootfs: run cargo test -p vrdma-cli --test podman first" >&2; exit 1; }
for f in vrdma vrdmad vrdma-cni libvrdma_ibverbs.so; do
  [ -e "$BIN/$f" ] || { echo "missing $BIN/$f (cargo build -p vrdma-cli -p vrdma-cni -p vrdma-ibverbs)" >&2; exit 1; }
done
work=$(mktemp -d /tmp/vrdma-bench-containers.XXXXXX)
spec=/var/run/cdi/vrdma-bench-$$.json
network=vrdma-bench-$$
mkdir -p "$work/lib" "$work/run" "$work/state"
cp "$BIN/libvrdma_ibverbs.so" "$work/lib/libibverbs.so.1"
export VRDMA_RUN_DIR=$work/run VRDMA_STATE_DIR=$work/state VRDMA_LIB_DIR=$work/lib RUST_BACKTRACE=0
daemon=
cleanup() {
  [ -n "$daemon" ] && kill "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null
  rm -f "$spec"
  rmdir "/var/lib/cni/vrdma/$network" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
RUST_LOG=warn "$BIN/vrdmad" --run-dir "$work/run" --state-dir "$work/state" --cdi-dir none 2>"$work/vrdmad.log" &
daemon=$!
for _ in $(seq 100); do [ -S "$work/run/admin.sock" ] && break; sleep 0.1; done
A=198.18.50.2 B=198.18.50.3
"$BIN/vrdma" vnic create bca --tenant bench --ip $A/15 >/dev/null
"$BIN/vrdma" vnic create bcb --tenant bench --ip $B/15 >/dev/null
"$BIN/vrdma" cdi generate --output "$spec" 2>/dev/null
"$BIN/vrdma-cni" install --name "$network" --vnic-arg "" --conf-dir "$work/cni/net.d" --bin-dir "$work/cni/bin" \
  --admin-socket "$work/run/admin.sock" >/dev/null
# podman's configuration: the system's, with the CNI backend pointed at this network.
python3 - "$work" <<'PY'
import sys, pathlib
w = pathlib.Path(sys.argv[1])
system = pathlib.Path("/usr/share/containers/containers.conf")
text = system.read_text() if system.exists() else ""
ours = f'network_backend = "cni"\nnetwork_config_dir = "{w}/cni/net.d"\ncni_plugin_dirs = ["{w}/cni/bin", "/usr/lib/cni"]\n'
marker = "\n[network]\n"
text = text.replace(marker, marker + ours, 1) if marker in text else text + marker + ours
(w / "containers.conf").write_text(text)
PY
export CONTAINERS_CONF=$work/containers.conf
podman_in() {
  local vnic=$1; shift
  CNI_ARGS=VRDMA_VNIC=$vnic podman --runtime runc --cgroup-manager=cgroupfs run --rm --ulimit nofile=1024:1024 \
    --ulimit nproc=1024:1024 --network "$network" --device "vrdma.io/vnic=$vnic" --rootfs "$rootfs" "$@"
}
# VRDMA_RUN_ARGS: more `vrdma run` options (e.g. --privileged, to see what the sandbox costs).
read -r -a run_args <<<"${VRDMA_RUN_ARGS:-}"
vrdma_in() { local vnic=$1; shift; "$BIN/vrdma" run --vnic "$vnic" "${run_args[@]}" -- "$@"; }
# pair RUNNER START_DELAY CMD…: server in bca, client in bcb (the client's output).
pair() {
  local runner=$1 delay=$2; shift 2
  "$runner" bca "$@" >/dev/null 2>&1 & local s=$!
  sleep "$delay"
  "$runner" bcb "$@" $A 2>&1
  wait $s
}
results=$work/results
lat_iters=${LAT_ITERS:-5000} bw_iters=${BW_ITERS:-2000}
for round in $(seq "${ROUNDS:-5}"); do
  # podman needs a second or two to start a container before its server listens.
  for side in podman vrdma; do
    if [ $side = podman ]; then runner=podman_in delay=3; else runner=vrdma_in delay=0.5; fi
    # ib_write_lat: #bytes #iterations t_min t_max t_typical t_avg …
    lat=$(pair $runner $delay ib_write_lat -x 0 -s 8 -n "$lat_iters" | awk '$1 == 8 {print $5, $6; exit}')
    # ib_write_bw: #bytes #iterations BW_peak BW_average MsgRate
    bw=$(pair $runner $delay ib_write_bw -x 0 -s 1048576 -n "$bw_iters" | awk '$1 == 1048576 {print $4; exit}')
    read -r typical avg <<<"${lat:-nan nan}"
    echo "round $round $side: write_lat 8 B typical ${typical} avg ${avg} us, write_bw 1 MiB ${bw:-nan} MB/s"
    echo "$side lat_typical ${typical:-nan}" >>"$results"
    echo "$side lat_avg ${avg:-nan}" >>"$results"
    echo "$side bw ${bw:-nan}" >>"$results"
  done
done
echo "=== podman / vrdma run, ratio of the medians over the rounds (target 0.95..1.05; bandwidth: higher is better)"
python3 - "$results" <<'PY'
import collections, statistics, sys
d = collections.defaultdict(list)
for line in open(sys.argv[1]):
    side, key, v = line.split()
    try:
        v = float(v)
    except ValueError:
        continue
    if v == v and v > 0:
        d[(side, key)].append(v)
for key in ["lat_typical", "lat_avg", "bw"]:
    p, r = d[("podman", key)], d[("vrdma", key)]
    if not p or not r:
        print(f"{key:12} no figures (podman {len(p)}, vrdma run {len(r)})")
        continue
    mp, mr = statistics.median(p), statistics.median(r)
    print(f"{key:12} podman {mp:10.3f}  vrdma run {mr:10.3f}  ratio {mp / mr:.3f}  ({len(p)}/{len(r)} runs)")
PY
