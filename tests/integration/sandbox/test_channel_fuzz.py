"""Property test: whatever env code writes on its channel, the service answers, and keeps serving.

Hypothesis draws what an env writes on the channel it shares with the sandbox: random bytes, a
header announcing a huge or a short length, nesting hundreds of thousands deep, JSON of the wrong
types (an ``outcome`` that is a number, a list, a string; fields of any type), text that is not
UTF-8 or holds a lone surrogate, several frames at once, and whether the env's process then exits.
It writes it from ``reset()`` or ``step()`` of a session (its env channel), or from ``reset()`` while
the env is validated (its host's channel to the checker). The service must answer every call (no
5xx), put the env's misbehaviour on the env (never ``sandbox_fault``: the pool counts no fault),
and still serve a plain execution afterwards (no zygote died).

Modest and reproducible: ``derandomize``, no example database, a few dozen examples.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.sandbox.conftest import ALICE_KEY, Service
from tests.integration.sandbox.test_channel_attacks import writer

pytestmark = pytest.mark.slow

ALICE = {"Authorization": f"Bearer {ALICE_KEY}"}

ENV_OUTCOMES = {"ok", "env_error", "output_limit", "limit", "timeout"}
"""What a session may end with when its env scribbles on its channel: its own doing, never a fault."""

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
outcome_fields = st.fixed_dictionaries(
    {},
    optional={
        "observation": json_values,
        "reward": json_values,
        "terminated": json_values,
        "truncated": json_values,
        "info": json_values,
        "turn": json_values,
        "max_turns": json_values,
        "outcome": st.sampled_from(["ok", "env_error", "sandbox_fault", "killed", "nope"]) | json_values,
    },
)
messages = st.fixed_dictionaries(
    {"op": st.sampled_from(["outcome", "env_error", "fault", "exit", "report"]) | json_values},
    optional={"outcome": outcome_fields | json_values, "error": json_values},
)


def _framed(body: bytes) -> str:
    return f"frame({body!r})"


@st.composite
def frames(draw: Any) -> tuple[str, bool]:
    """A Python expression of the bytes the env writes, and whether it must exit after (a frame
    announcing more bytes than follow would otherwise wait out the call's wall clock)."""
    kind = draw(st.sampled_from(["raw", "huge", "deep", "json", "bad_text", "several"]))
    if kind == "raw":
        return repr(draw(st.binary(max_size=64))), True
    if kind == "huge":
        size = draw(st.integers(min_value=1 << 16, max_value=0xFFFFFFFF))
        return f"({size}).to_bytes(4, 'big') + {draw(st.binary(max_size=16))!r}", True
    if kind == "deep":
        depth = draw(st.integers(min_value=50, max_value=300_000))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        tail = "1" if opener != "[" else ""
        return f"frame(b{opener!r} * {depth} + b{tail!r} + b{closer!r} * {depth})", draw(st.booleans())
    if kind == "json":
        body = json.dumps(draw(messages)).encode()
        return _framed(body), draw(st.booleans())
    if kind == "bad_text":
        body = json.dumps(draw(messages)).encode()
        cut = draw(st.integers(min_value=0, max_value=len(body)))
        poison = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b'"\\ud800"', b"NaN", b"1e999"]))
        return _framed(body[:cut] + poison + body[cut:]), draw(st.booleans())
    parts = draw(st.lists(st.builds(lambda m: json.dumps(m).encode(), messages), min_size=2, max_size=4))
    return " + ".join(_framed(p) for p in parts), draw(st.booleans())


def _env(expression: str, where: str, then_exit: bool) -> str:
    code = writer(expression, where)
    if then_exit:
        code = code.replace("os.write(3, FRAME)", "os.write(3, FRAME)\n            os._exit(0)")
    return code


@pytest.fixture
def http(sandbox_service: Service) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sandbox_service.http_url, timeout=120) as client:
        yield client


def _faults(http: httpx.Client) -> tuple[int, list[int]]:
    sandbox = http.get("/healthz/details", headers=ALICE).json()["sandbox"]
    return sandbox["faults"], [z["restarts"] for z in sandbox["zygotes"]]


FUZZ = settings(
    max_examples=30,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FUZZ
@given(written=frames(), where=st.sampled_from(["reset", "step"]))
def test_whatever_env_code_writes_on_its_session_channel_is_answered(
    http: httpx.Client, written: tuple[str, bool], where: str
) -> None:
    expression, then_exit = written
    before = _faults(http)
    opened = http.post("/v1/sessions", json={"code": _env(expression, where, then_exit), "seed": 3}, headers=ALICE)
    assert opened.status_code == 201, opened.text
    body = opened.json()
    assert body["outcome"] in ENV_OUTCOMES, body
    if body["outcome"] == "ok" and not (body["terminated"] or body["truncated"]):
        step = http.post(f"/v1/sessions/{body['session_id']}/step", json={"action": "\\boxed{go}"}, headers=ALICE)
        assert step.status_code == 200, step.text
        assert step.json()["outcome"] in ENV_OUTCOMES, step.json()
    http.delete(f"/v1/sessions/{body['session_id']}", headers=ALICE)
    assert _faults(http) == before, "the env's writing counted as a sandbox fault, or a zygote died"


@settings(FUZZ, max_examples=12)
@given(written=frames())
def test_whatever_env_code_writes_on_its_host_channel_fails_a_check(
    http: httpx.Client, written: tuple[str, bool]
) -> None:
    expression, then_exit = written
    before = _faults(http)
    response = http.post("/v1/validate", json={"code": _env(expression, "reset", then_exit)}, headers=ALICE)
    assert response.status_code == 200, response.text
    report = response.json()
    failed = [c for c in report["checks"] if not c["passed"]]
    assert not report["valid"] and failed and failed[0]["detail"], report
    assert _faults(http) == before


def test_the_service_still_serves_after_the_fuzz(http: httpx.Client) -> None:
    result = http.post("/v1/execute", json={"code": "print('still here')"}, headers=ALICE)
    assert result.status_code == 200 and result.json()["stdout"] == "still here\n"
    assert all(z["alive"] for z in http.get("/healthz/details", headers=ALICE).json()["sandbox"]["zygotes"])
