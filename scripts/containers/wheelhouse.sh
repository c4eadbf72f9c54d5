#!/usr/bin/env bash
# The Python dependencies of the images as a wheelhouse built on this machine (whose pip reaches
# PyPI through its own trust store), installed in the images with `pip install --no-index`: the
# air-gapped pattern, so no machine's CA certificate is baked into an image. Prints the directory.
# Cached in $SPADE_CACHE/wheelhouse/<key>, keyed by the runtime requirements of pyproject.toml
# (not its dev dependencies), this script and the Python version.
set -euo pipefail
source "$(dirname "$0")/env.sh"

pip=${SPADE_WHEELHOUSE_PIP:-$SPADE_ROOT/.venv/bin/pip}
python=$(dirname "$pip")/python
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
"$python" - "$SPADE_ROOT/pyproject.toml" >"$reqs" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))
for req in project["project"]["dependencies"]:
    print(req)
# What pip needs to build the project itself inside the image (installed in its venv first: the
# project's own layer builds with --no-build-isolation).
for req in project["build-system"]["requires"]:
    print(req)
PY
pyver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
# The wheels the image installs with --no-deps (their declared dependencies are unused: see
# scripts/setup.sh), read from the Dockerfile's NO_DEPS_WHEELS.
no_deps=$(grep '^ARG NO_DEPS_WHEELS=' "$SPADE_ROOT/Dockerfile" | cut -d'"' -f2)
key=$(spade_key "$0" "$reqs" "$pyver" "$SPADE_IMAGE_PYTHON" "$no_deps")
dir="$SPADE_CACHE/wheelhouse/$key"

if [ ! -f "$dir/.complete" ]; then
  echo "wheelhouse: building $dir (once per dependency set)" >&2
  rm -rf "$dir.tmp"
  mkdir -p "$dir.tmp"
  cp "$reqs" "$dir.tmp/requirements.txt"
  "$pip" wheel -q --wheel-dir "$dir.tmp" -r "$reqs" 2> >(grep -v "^WARNING: Location" >&2)
  # What the image's older patch release needs besides: markers such as python_full_version <
  # "3.11.3" pull in backports the host's Python does not (pip's --python-version does not apply
  # them). Every wheel's dependencies are evaluated for the image's Python until none is missing.
  while :; do
    missing=$("$python" - "$dir.tmp" "$SPADE_IMAGE_PYTHON" <<'PY'
import sys, zipfile
from pathlib import Path
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

wheels, full = Path(sys.argv[1]), sys.argv[2]
env = {"python_full_version": full, "python_version": ".".join(full.split(".")[:2]), "extra": ""}
have = {canonicalize_name(parse_wheel_filename(w.name)[0]) for w in wheels.glob("*.whl")}
for wheel in wheels.glob("*.whl"):
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:"):
                req = Requirement(line.split(":", 1)[1].strip())
                if (req.marker is None or req.marker.evaluate(env)) and canonicalize_name(req.name) not in have:
                    print(f"{req.name}{req.specifier}")
PY
)
    [ -n "$missing" ] || break
    echo "wheelhouse: for Python $SPADE_IMAGE_PYTHON also $(echo $missing)" >&2
    # shellcheck disable=SC2086
    "$pip" wheel -q --wheel-dir "$dir.tmp" $missing 2> >(grep -v "^WARNING: Location" >&2)
  done
  # shellcheck disable=SC2086
  "$pip" wheel -q --no-deps --wheel-dir "$dir.tmp" $no_deps 2> >(grep -v "^WARNING: Location" >&2)
  echo "$no_deps" >"$dir.tmp/no-deps.txt"
  touch "$dir.tmp/.complete"
  rm -rf "$dir"
  mv "$dir.tmp" "$dir"
fi
echo "$dir"
