#!/usr/bin/env bash
# Installs the system packages vrdma needs (Debian 12), only those missing.
set -euo pipefail
pkgs=(iproute2 iputils-ping nftables python3 ucx-utils ibverbs-utils perftest libibverbs-dev rdma-core etcd-server openmpi-bin libopenmpi-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q "${missing[@]}"
fi
