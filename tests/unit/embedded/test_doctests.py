"""The docstring examples of the embedded run's modules are true (the suite does not run --doctest-modules)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["services.embedded.metrics", "services.embedded.pool_choice", "services.embedded.settings"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0
