"""Shared fixtures (the real Postgres and Redis on this machine) and the test tiers.

Every test that needs more than this Python process carries a marker saying what (pyproject.toml
lists them): ``db`` (Postgres), ``redis``, ``sandbox`` (real jails), ``model`` (a torch model, even a
tiny random one; the SmolLM2 checkpoint or tokenizer; the MiniLM embedder; the inference server),
``slow``, ``e2e``. ``make test-fast`` runs the tests with none of them; ``make test-tiers`` proves
that they need nothing else (scripts/check_test_tiers.py). Markers come from three places, most to
least automatic:

- the directory: everything under ``tests/e2e/`` is ``e2e``;
- the fixtures a test uses, however indirectly: a fixture declares what its users need with
  ``@needs(...)`` under its ``@pytest.fixture``, or, when only some of its params need it, with a
  marked ``pytest.param``;
- an explicit ``pytestmark`` / ``@pytest.mark...`` where a test reaches the resource itself.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import pytest

if TYPE_CHECKING:
    from services.sandbox.isolation import SandboxPool

POSTGRES_URL = os.environ.get("SPADE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("SPADE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

# `spade run` keeps what its process frees at its high-water mark (services.embedded.system); a test worker
# that invoked it would keep every later test's memory too. Set here, the workers and every `spade`
# subprocess inherit glibc's defaults; test_memory.py sets the allocator in processes of its own.
os.environ["SPADE_KEEP_FREED_MEMORY"] = "0"

NEEDS = ("db", "redis", "sandbox", "model", "slow")
"""What a fixture may declare that its users need (the markers of pyproject.toml but ``e2e``)."""

_E2E = Path(__file__).parent / "e2e"
_F = TypeVar("_F", bound=Callable[..., object])


def needs(*markers: str) -> Callable[[_F], _F]:
    """Declare that every test using the decorated fixture needs ``markers`` (put it under ``@pytest.fixture``)."""
    unknown = set(markers) - set(NEEDS)
    if unknown:
        raise ValueError(f"needs({', '.join(sorted(unknown))}): not a test tier marker; use one of {NEEDS}")

    def declare(fixture: _F) -> _F:
        fixture.spade_needs = (*getattr(fixture, "spade_needs", ()), *markers)  # type: ignore[attr-defined]
        return fixture

    return declare


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with the tiers its directory and its fixtures imply."""
    for item in items:
        found: set[str] = set()
        if item.path.is_relative_to(_E2E):
            found.add("e2e")
        info = getattr(item, "_fixtureinfo", None)  # every fixture of the test's closure
        if info is not None:
            for defs in info.name2fixturedefs.values():
                for fixture_def in defs:
                    found.update(getattr(fixture_def.func, "spade_needs", ()))
        for marker in sorted(found - {m.name for m in item.iter_markers()}):
            item.add_marker(marker)
    items[:] = longest_first(items)


MEASURED_S = {
    "e2e/test_compose.py": 520,
    "e2e/test_embedded_run.py": 490,
    "e2e/test_chaos.py": 380,
    "integration/eval/test_suites_real_model.py": 270,
    "integration/eval/test_batch_invariance.py": 135,
    "e2e/test_cluster_status.py": 130,
    "integration/inference/test_batch_invariance.py": 105,
    "integration/eval/test_cli_resume.py": 100,
    "e2e/test_embedded_pool_designer.py": 95,
    "e2e/test_distributed.py": 90,
    "integration/learner/test_restarts.py": 90,
    "integration/warmstart/test_tiny_sft.py": 85,
    "e2e/test_embedded_no_idle.py": 85,
}
"""The costliest modules' seconds in a full ``make test`` (a fresh clone, 2026-12-03: each module's setup, calls
and teardowns under ``--durations=0``), for ``longest_first`` alone."""

COST_ORDER = ("e2e", "slow", "model", "sandbox")
"""The markers that say a module is costly, costliest first: ``longest_first``'s order for the rest."""


def longest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The items with the costliest modules first, modules kept whole, otherwise in collection order.

    ``make test`` hands modules to its workers in this order (``--dist loadfile
    --no-loadscope-reorder``). xdist's own order (most tests first) left the one-test end-to-end modules,
    the longest of all, for last, two of them queued behind each other on one worker while the others
    had finished; the longest jobs first is the usual cure for such a tail. The measured modules
    (``MEASURED_S``) go first, longest first, then the others by the costliest marker they carry
    (``COST_ORDER``). A stale figure costs only a worse order.
    """
    rank: dict[Path, tuple[float, int]] = {}
    root = Path(__file__).parent
    for item in items:
        names = {m.name for m in item.iter_markers()}
        marker = next((i for i, name in enumerate(COST_ORDER) if name in names), len(COST_ORDER))
        seconds = MEASURED_S.get(item.path.relative_to(root).as_posix(), 0) if item.path.is_relative_to(root) else 0
        rank[item.path] = min(rank.get(item.path, (0.0, marker)), (-seconds, marker))
    first_seen = {path: i for i, path in reversed(list(enumerate(item.path for item in items)))}
    return sorted(items, key=lambda item: (rank[item.path], first_seen[item.path]))


@pytest.fixture
@needs("sandbox")
async def sandbox_pool() -> AsyncIterator[SandboxPool]:
    """A started sandbox pool with the default isolation (real jails), stopped after the test."""
    from services.sandbox.isolation import IsolationSettings, SandboxPool

    sandbox = SandboxPool(IsolationSettings())
    await sandbox.start()
    try:
        yield sandbox
    finally:
        await sandbox.stop()
