#!/usr/bin/env bash
# What running the containers needs on a Debian 12 machine (root): podman with runc (crun refuses
# the build machines' hybrid cgroups), netavark + aardvark-dns (container names resolve on the
# compose network; netavark sets up the bridge and its NAT with the iptables binary, which no package
# pulls in), debootstrap for the local base image. podman-compose comes from PyPI with the
# project's dev dependencies (.venv/bin/podman-compose). Idempotent and fast when done.
set -euo pipefail
need=()
for pkg in podman runc netavark aardvark-dns iptables debootstrap; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if ((${#need[@]})); then
  if [ "$(id -u)" != 0 ]; then
    echo "containers: missing Debian packages ${need[*]}; run as root or apt-get install them" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
