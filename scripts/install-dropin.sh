#!/usr/bin/env bash
# Installs vrdma's drop-in libibverbs (crates/vrdma-ibverbs) as
#   <prefix>/lib/vrdma/libibverbs.so.1
# which is where `vrdma run` looks for it: <directory of the vrdma binary>/../lib/vrdma
# (or $VRDMA_LIB_DIR). The default prefix is the cargo target directory, so that
# target/release/vrdma finds target/lib/vrdma/libibverbs.so.1; for a system install use the
# prefix of the installed vrdma binary (e.g. --prefix /usr/local with /usr/local/bin/vrdma).
#
# usage: scripts/install-dropin.sh [--prefix DIR] [--no-build]
set -euo pipefail
cd "$(dirname "$0")/.."
target_dir=${CARGO_TARGET_DIR:-$PWD/target}
prefix=$target_dir
build=1
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix=$2; shift 2 ;;
    --prefix=*) prefix=${1#--prefix=}; shift ;;
    --no-build) build=0; shift ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
if [ "$build" = 1 ]; then
  cargo build --release --quiet -p vrdma-ibverbs
fi
so=$target_dir/release/libvrdma_ibverbs.so
[ -f "$so" ] || { echo "$so is missing: build it with cargo build --release -p vrdma-ibverbs" >&2; exit 1; }
dest=$prefix/lib/vrdma
mkdir -p "$dest"
# Copy to a temporary name and rename, so running programs keep their mapping of the old file.
cp "$so" "$dest/.libibverbs.so.1.tmp"
chmod 0755 "$dest/.libibverbs.so.1.tmp"
mv -f "$dest/.libibverbs.so.1.tmp" "$dest/libibverbs.so.1"
echo "installed $dest/libibverbs.so.1"
