#!/usr/bin/env bash
# Build the compose stack's images with podman, offline apart from the Debian mirror:
#   localhost/spade:latest           every service (CPU), from the Dockerfile ($SPADE_IMAGE, as compose reads it)
#   localhost/spade-postgres:latest  localhost/spade-redis:latest
# on the local debootstrap base image, with Python dependencies from the host-built wheelhouse.
# Layers are cached by podman; base image and wheelhouse by their own keys (see those scripts).
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$SPADE_ROOT"

bash scripts/containers/setup.sh
base=$(bash scripts/containers/base-image.sh)
wheels=$(bash scripts/containers/wheelhouse.sh)

build() {  # build TAG DOCKERFILE [extra podman build args...]
  local tag=$1 file=$2
  shift 2
  echo "image: $tag" >&2
  podman build --quiet --layers --pull=never --build-arg BASE_IMAGE="$base" -f "$file" -t "$tag" "$@" . >/dev/null
}
build localhost/spade-redis:latest deploy/images/redis.Dockerfile
build localhost/spade-postgres:latest deploy/images/postgres.Dockerfile
build "${SPADE_IMAGE:-localhost/spade:latest}" Dockerfile --volume "$wheels:/wheels:ro"
