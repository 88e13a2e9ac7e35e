# Sourced by the benchmark scripts: a vrdmad of their own.
# start_private_daemon BIN DIR [vrdmad flags...]: starts $BIN/vrdmad with its run and state
# directories under DIR (made afresh; its log DIR/vrdmad.log), points the vrdma CLI at it
# (VRDMA_RUN_DIR, VRDMA_STATE_DIR) and waits for its admin socket. Sets DPID.
start_private_daemon() {
  local bin=$1 dir=$2; shift 2
  rm -rf "$dir"; mkdir -p "$dir"
  "$bin/vrdmad" --run-dir "$dir/run" --state-dir "$dir/state" --cdi-dir none "$@" 2>"$dir/vrdmad.log" &
  DPID=$!
  export VRDMA_RUN_DIR=$dir/run VRDMA_STATE_DIR=$dir/state
  for _ in $(seq 25); do [ -S "$dir/run/admin.sock" ] && return 0; sleep 0.2; done
  echo "vrdmad did not start: $dir/vrdmad.log" >&2
  return 1
}
