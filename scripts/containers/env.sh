# Sourced by the container scripts: where podman's settings and SPADE's build caches live.
# SPADE_CACHE: kept between runs on a machine (base image tarball, wheelhouse), keyed by inputs.
SPADE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export CONTAINERS_CONF=${CONTAINERS_CONF:-$SPADE_ROOT/deploy/containers/containers.conf}
if [ "$(id -u)" = 0 ]; then
  SPADE_CACHE=${SPADE_CACHE:-/var/cache/spade}
else
  SPADE_CACHE=${SPADE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/spade}
fi
export SPADE_CACHE
# The Debian suite every image is built from (the machines run Debian 12).
SPADE_DEBIAN_SUITE=${SPADE_DEBIAN_SUITE:-bookworm}
# The Python of the images (Debian 12's python3.11): dependency markers are evaluated for it.
SPADE_IMAGE_PYTHON=${SPADE_IMAGE_PYTHON:-3.11.2}
# The Debian packages of the service image, one list for the base image and the Dockerfile.
SPADE_BASE_PACKAGES_FILE=$SPADE_ROOT/deploy/images/packages.txt

# The Debian mirror this machine is configured with (first deb822 URIs or sources.list line).
spade_debian_mirror() {
  local uri
  uri=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -1)
  [ -n "$uri" ] || uri=$(grep -hs '^deb ' /etc/apt/sources.list | awk '{print $2}' | head -1)
  echo "${uri:-http://deb.debian.org/debian}"
}

# A short content key of the given files and strings (what a cache entry is keyed by).
spade_key() {
  { for f in "$@"; do if [ -f "$f" ]; then cat "$f"; else printf '%s\n' "$f"; fi; done; } | sha256sum | cut -c1-16
}
