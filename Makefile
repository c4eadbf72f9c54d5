# The two commands of the README. Both install everything first (idempotent, fast when done).
.PHONY: run test lint protos install images image-gpu compose-up compose-down k8s-check

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/spade run $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

protos: $(STAMP)
	$(PY) -m spade.protogen

# --- deployment (docs/deploy.md) -------------------------------------------------------------------
COMPOSE := CONTAINERS_CONF=$(CURDIR)/deploy/containers/containers.conf $(VENV)/bin/podman-compose --profile $(or $(PROFILE),cpu)

# The CPU images with podman, offline apart from the Debian mirror (cached base image and wheelhouse).
images: $(STAMP)
	bash scripts/containers/build-images.sh

# The CUDA learner image (too large for CI): torch from the CUDA index, everything else as `images`.
image-gpu:
	podman build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t localhost/spade-gpu:latest .

compose-up: $(STAMP)
	$(COMPOSE) up -d

compose-down: $(STAMP)
	$(COMPOSE) down

# Render, validate and check both Kubernetes overlays offline (no cluster needed).
k8s-check: $(STAMP)
	$(PY) -m pytest tests/unit/deploy -q
