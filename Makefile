# The two commands of the README. Both install everything first (idempotent, fast when done).
.PHONY: run test test-fast test-tiers lint protos install images image-gpu compose-up compose-down k8s-check

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/spade run $(ARGS)

# The whole suite (CI's): needs Postgres, Redis, bubblewrap and the model (README). Prints the 25
# slowest tests, so a test that starts to dominate the run shows. TEST_WORKERS pytest-xdist workers
# share the machine a module at a time (--dist loadfile: a module-scoped fixture is built once); most
# of the suite waits on jails, servers and stores, not the CPU. Passive OpenMP threads yield the cores
# instead of spinning while another worker's model runs. 4 workers ran out of the machine's 24 GB
# (two `spade run`s and a cluster at once); TEST_WORKERS=0 runs everything in one process. Modules go
# out costliest first (tests/conftest.py: longest_first), not xdist's most-tests-first order. A worker
# that dies (a crash in native code) ends the run at once with that test failed: xdist 3.8 replaces a
# dead worker and then, under --dist loadfile, waits forever (reproduced with a test that aborts).
# 3 workers ran out of memory too (2026-12-05): two CI runs had several tests hang at once, and the
# kernel's log showed a global OOM kill of an 8.9 GB worker while end-to-end runs (a `spade run` peaks
# at 9-13 GB) and the quantized engines' module (7.2 GB) ran side by side. Two workers fit.
TEST_WORKERS ?= 2
test: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart=0 --durations=25 $(PYTEST_ARGS)

# The fast tier: no Postgres, Redis, jails, model, slow or e2e test (the markers: tests/conftest.py).
# Two workers, one per core: 1,235 tests took 122 s in one process and 69 s in two (2026-12-03).
FAST := not (db or redis or sandbox or model or slow or e2e)
FAST_WORKERS ?= 2
test-fast: $(STAMP)
	$(PY) -m pytest -n $(FAST_WORKERS) -m "$(FAST)" $(PYTEST_ARGS)

# The fast tier once more with those resources taken away (root: namespaces), to prove its markers.
test-tiers: $(STAMP)
	$(PY) scripts/check_test_tiers.py -m "$(FAST)" $(PYTEST_ARGS)

# ruff, mypy and the layering contracts ([tool.importlinter] in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-logo

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
