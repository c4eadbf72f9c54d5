"""The docstring examples of the designer's modules are true (the suite does not run --doctest-modules)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "services.designer.core.skills",
    "services.designer.core.parsing",
    "services.designer.core.prompts",
    "services.designer.core.reachability",
    "services.designer.core.rounds",
    "services.designer.pool_files",
    "services.designer.adapters",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0
