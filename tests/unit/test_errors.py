"""One Unavailable error kind: every client raises it for an unreachable dependency, and the rollout's
outage check finds it anywhere in a failure's chain."""

from __future__ import annotations

import pytest

from services.rollout.worker import outage
from spade.dependencies import DependencyUnavailable
from spade.errors import ErrorKind, Unavailable
from spade.inference.client import InferenceUnavailable
from spade.memory.errors import DatabaseUnavailable, InvalidArgument, MemoryUnavailable


@pytest.mark.parametrize("error", [InferenceUnavailable, MemoryUnavailable, DatabaseUnavailable, DependencyUnavailable])
def test_every_client_s_unreachable_error_is_one_kind(error: type[Exception]) -> None:
    assert issubclass(error, Unavailable) and error.kind is ErrorKind.UNAVAILABLE


async def test_an_unreachable_dependency_deep_in_a_failure_is_an_outage_and_a_bad_request_is_not() -> None:
    def failed_play(cause: Exception) -> Exception:
        try:
            try:
                raise cause
            except Exception as inner:
                raise RuntimeError("the play failed") from inner
        except RuntimeError as outer:
            return outer

    down = failed_play(InferenceUnavailable("gave up after 5 tries"))
    assert (await outage(down) or "").startswith("InferenceUnavailable: gave up")
    bad = failed_play(InvalidArgument("return 2.0 is outside [0, 1]"))
    assert await outage(bad) is None


@pytest.mark.parametrize(
    ("value", "index"), [("\ud800", 0), ("ok \udfff", 3), ("x" * 10 + "\ud83d", 10), ("\ude00\ud83d", 0)]
)
def test_text_utf8_cannot_carry_is_one_refusal_naming_the_field(value: str, index: int) -> None:
    from services.sandbox.core.errors import InvalidRequest
    from spade.errors import InvalidInput, require_text

    with pytest.raises(InvalidRequest) as refused:
        require_text(value, "stdin", InvalidRequest)
    assert isinstance(refused.value, InvalidInput) and refused.value.kind is ErrorKind.INVALID
    assert refused.value.field == "stdin" and f"at index {index}" in str(refused.value)
    str(refused.value).encode("utf-8")  # the refusal itself is sendable text
    assert require_text("\U0001f600 ✓", "stdin") == "\U0001f600 ✓"
