#!/usr/bin/env bash
# The local Debian base image, built with debootstrap from the machine's configured Debian mirror
# and imported with `podman import` (no registry is reachable from CI). Prints the image name.
# The service image's Debian packages (deploy/images/packages.txt) are installed into it with apt
# inside the new root (debootstrap's own resolver does not follow virtual packages).
# Cached: the tarball in $SPADE_CACHE/base/ and the image in podman's store, keyed by this script,
# the package list, the suite and the mirror, so a second run only checks that the image exists.
set -euo pipefail
source "$(dirname "$0")/env.sh"

mirror=$(spade_debian_mirror)
key=$(spade_key "$0" "$SPADE_BASE_PACKAGES_FILE" "$mirror" "$SPADE_DEBIAN_SUITE")
image="localhost/spade-base:$key"
tarball="$SPADE_CACHE/base/spade-base-$key.tar"

if podman image exists "$image"; then
  echo "$image"
  exit 0
fi
if [ ! -s "$tarball" ]; then
  mkdir -p "$SPADE_CACHE/base"
  root=$(mktemp -d "$SPADE_CACHE/base/rootfs.XXXXXX")
  log="$SPADE_CACHE/base/build.log"
  trap 'umount "$root/proc" 2>/dev/null || true; rm -rf "$root"' EXIT
  echo "base image: debootstrap $SPADE_DEBIAN_SUITE from $mirror (a few minutes, once)" >&2
  fail() { tail -20 "$log" >&2; exit 1; }
  debootstrap --variant=minbase "$SPADE_DEBIAN_SUITE" "$root" "$mirror" >"$log" 2>&1 || fail
  cat >"$root/etc/apt/sources.list" <<SOURCES
deb $mirror $SPADE_DEBIAN_SUITE main
deb $mirror $SPADE_DEBIAN_SUITE-updates main
deb ${mirror%/debian}/debian-security $SPADE_DEBIAN_SUITE-security main
SOURCES
  mount -t proc proc "$root/proc"
  {
    chroot "$root" apt-get update -qq
    # shellcheck disable=SC2046
    DEBIAN_FRONTEND=noninteractive chroot "$root" apt-get install -y -qq --no-install-recommends \
      $(grep -v '^#' "$SPADE_BASE_PACKAGES_FILE")
  } >>"$log" 2>&1 || fail
  umount "$root/proc"
  chroot "$root" apt-get clean
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/log/*.log "$root"/var/log/apt/*
  tar --numeric-owner -C "$root" -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
fi
podman import --quiet --change 'CMD ["/bin/bash"]' "$tarball" "$image" >/dev/null
echo "$image"
