#!/usr/bin/env bash
# Installs the system packages vrdma needs (Debian 12), only those missing.
set -euo pipefail
pkgs=(iproute2 iputils-ping nftables python3 ucx-utils ibverbs-utils perftest libibverbs-dev rdma-core etcd-server openmpi-bin libopenmpi-dev podman runc containernetworking-plugins debootstrap python3-jsonschema protobuf-compiler python3-venv curl python3-prometheus-client qemu-system-x86 linux-image-cloud-amd64 busybox-static cpio)
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
# PyPI's kubernetes-validate (Kubernetes' schemas, offline) for the deployment manifests'
# test, in a venv of its own: Debian's Python refuses system-wide pip installs.
kv=/opt/vrdma/kubernetes-validate
if [ ! -x "$kv/bin/kubernetes-validate" ]; then
  echo "installing kubernetes-validate in $kv"
  rm -rf "$kv"
  /usr/bin/python3 -m venv "$kv"
  "$kv/bin/pip" install -q kubernetes-validate==1.37.0
fi
