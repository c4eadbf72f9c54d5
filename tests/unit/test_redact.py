"""One masking of URL passwords, used by every place that logs or shows a URL."""

from __future__ import annotations

from spade.dependencies import Dependency
from spade.redact import redact
from spade.serving.lifecycle import _scrub


def test_a_password_is_masked_with_or_without_a_user_and_nothing_else_is_touched() -> None:
    assert redact("postgresql+psycopg://spade:s3cret@db:5432/x") == "postgresql+psycopg://spade:***@db:5432/x"
    # Redis URLs carry a password without a user: the earlier lifecycle pattern let this one through.
    assert redact("redis://:p@ss@cache:6379/0") == "redis://:***@cache:6379/0"
    assert redact("http://host:8080/path and redis://cache:6379/0") == "http://host:8080/path and redis://cache:6379/0"


def test_the_settings_dump_and_a_dependency_s_description_use_it() -> None:
    assert _scrub({"queue": {"url": "redis://:hunter2@r:6379/0"}}) == {"queue": {"url": "redis://:***@r:6379/0"}}
    described = Dependency("redis", "redis://:hunter2@r:6379/0").describe()
    assert "hunter2" not in described and "redis://:***@r:6379/0" in described
