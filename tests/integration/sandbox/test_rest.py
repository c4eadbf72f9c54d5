"""The sandbox's REST API end to end over loopback: real isolated workers, auth, quotas, errors."""

from __future__ import annotations

import re

import httpx
import pytest

from spade.envs import CHECK_NAMES
from spade.envs.examples import EXAMPLES
from tests.integration.sandbox.conftest import ALICE_KEY, BOB_KEY, COUNTER_ENV, MEMORY_BOMB_ENV, Service

ALICE = {"Authorization": f"Bearer {ALICE_KEY}"}
BOB = {"Authorization": f"Bearer {BOB_KEY}"}


def _assert_clean_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"]["code"] == code
    assert "Traceback" not in response.text
    return body


def test_health_is_open_and_the_api_documented(http: httpx.Client) -> None:
    assert http.get("/healthz").text == "ok"  # the details and /metrics need a key: test_privilege.py
    assert http.get("/openapi.json").json()["paths"]["/v1/validate"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": "Token x"}])
def test_requests_without_a_valid_key_get_401(http: httpx.Client, headers: dict) -> None:
    response = http.post("/v1/execute", json={"code": "print(1)"}, headers=headers)
    _assert_clean_error(response, 401, "unauthenticated")


def test_every_example_env_validates(http: httpx.Client) -> None:
    for example in EXAMPLES.values():
        response = http.post(
            "/v1/validate", json={"code": example.code, "setting": example.setting.value}, headers=ALICE
        )
        assert response.status_code == 200
        report = response.json()
        assert [c["name"] for c in report["checks"]] == list(CHECK_NAMES)
        assert report["valid"], (example.name, [c for c in report["checks"] if not c["passed"]])


def test_broken_env_is_rejected_with_the_check_named(http: httpx.Client) -> None:
    report = http.post("/v1/validate", json={"code": "class BadEnv(:\n  pass", "setting": "game"}, headers=ALICE).json()
    assert report["valid"] is False
    syntax = next(c for c in report["checks"] if c["name"] == "syntax")
    assert syntax["passed"] is False and syntax["detail"]


def test_execute_with_stdin_files_and_exit_code(http: httpx.Client) -> None:
    code = "import sys\ndata = open('in/data.txt').read()\nprint(sys.stdin.read().upper() + data)\nsys.exit(3)\n"
    body = {"code": code, "stdin": "hello ", "files": {"in/data.txt": "world"}}
    result = http.post("/v1/execute", json=body, headers=ALICE).json()
    assert result["status"] == "error"
    assert result["exit_code"] == 3
    assert result["stdout"].strip() == "HELLO world"


def test_execute_timeout_is_reported(http: httpx.Client) -> None:
    result = http.post("/v1/execute", json={"code": "while True: pass", "timeout_s": 1}, headers=ALICE).json()
    assert result["status"] == "timeout"


def test_session_plays_to_the_end_then_refuses_steps(http: httpx.Client) -> None:
    opened = http.post("/v1/sessions", json={"code": COUNTER_ENV, "setting": "game", "seed": 5}, headers=ALICE)
    assert opened.status_code == 201, opened.text
    state = opened.json()
    sid = state["session_id"]
    target = int(state["observation"].split("exactly ")[1].split(" ")[0])
    for _ in range(target):
        state = http.post(f"/v1/sessions/{sid}/step", json={"action": "\\boxed{go}"}, headers=ALICE).json()
        assert state["terminated"] is False
    state = http.post(f"/v1/sessions/{sid}/step", json={"action": "\\boxed{stop}"}, headers=ALICE).json()
    assert state["terminated"] is True and state["reward"] == 1.0
    after = http.post(f"/v1/sessions/{sid}/step", json={"action": "\\boxed{go}"}, headers=ALICE)
    _assert_clean_error(after, 409, "session_finished")
    assert http.delete(f"/v1/sessions/{sid}", headers=ALICE).status_code == 204
    gone = http.post(f"/v1/sessions/{sid}/step", json={"action": "x"}, headers=ALICE)
    _assert_clean_error(gone, 404, "session_not_found")


def test_another_tenants_session_is_not_found(http: httpx.Client) -> None:
    sid = http.post("/v1/sessions", json={"code": COUNTER_ENV, "seed": 1}, headers=ALICE).json()["session_id"]
    try:
        response = http.post(f"/v1/sessions/{sid}/step", json={"action": "go"}, headers=BOB)
        _assert_clean_error(response, 404, "session_not_found")  # as if it did not exist: test_privilege.py
    finally:
        http.delete(f"/v1/sessions/{sid}", headers=ALICE)


def test_session_quota_gives_429(http: httpx.Client) -> None:
    opened = [http.post("/v1/sessions", json={"code": COUNTER_ENV, "seed": i}, headers=ALICE) for i in range(3)]
    try:
        assert [r.status_code for r in opened[:2]] == [201, 201]
        _assert_clean_error(opened[2], 429, "quota_exceeded")
    finally:
        for response in opened:
            if response.status_code == 201:
                http.delete(f"/v1/sessions/{response.json()['session_id']}", headers=ALICE)


def test_execution_rate_quota_gives_429(http: httpx.Client) -> None:
    statuses = [http.post("/v1/execute", json={"code": "pass"}, headers=BOB).status_code for _ in range(3)]
    assert statuses[:2] == [200, 200]
    assert statuses[2] == 429


def test_oversized_body_gets_413(http: httpx.Client, sandbox_service: Service) -> None:
    code = "x = 1\n" * (sandbox_service.max_request_bytes // 6 + 10)
    _assert_clean_error(http.post("/v1/execute", json={"code": code}, headers=ALICE), 413, "payload_too_large")


def test_bad_input_gets_422_without_echoing_it(http: httpx.Client) -> None:
    secret_code = "print('TOP-SECRET-CODE')"
    cases = [
        {"code": secret_code, "seed": "seven"},
        {"code": secret_code, "setting": "chess"},
        {"code": 12},
        {"code": secret_code, "unexpected": True},
    ]
    for body in cases:
        response = http.post("/v1/sessions", json=body, headers=ALICE)
        _assert_clean_error(response, 422, "invalid_request")
        assert "TOP-SECRET-CODE" not in response.text
    raw = http.post(
        "/v1/execute", content=b'{"code": "\xff\xfe"}', headers={**ALICE, "Content-Type": "application/json"}
    )
    _assert_clean_error(raw, 422, "invalid_request")
    empty = http.post("/v1/execute", json={"code": "   "}, headers=ALICE)
    _assert_clean_error(empty, 422, "invalid_request")


def test_unknown_session_gets_404(http: httpx.Client) -> None:
    _assert_clean_error(
        http.post("/v1/sessions/nope/step", json={"action": "x"}, headers=ALICE), 404, "session_not_found"
    )
    _assert_clean_error(http.delete("/v1/sessions/nope", headers=ALICE), 404, "session_not_found")


def test_env_that_crashes_in_reset_is_an_env_error_not_a_500(http: httpx.Client) -> None:
    code = (
        "class BoomEnv:\n"
        "    def reset(self, seed=None):\n"
        "        raise RuntimeError('boom')\n"
        "    def step(self, a):\n"
        "        return '', 0.0, True, False, {}\n"
        "    def solution(self):\n"
        "        return []\n"
    )
    response = http.post("/v1/sessions", json={"code": code, "seed": 0}, headers=ALICE)
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["outcome"] == "env_error"
    assert "boom" in body["observation"] or "boom" in str(body["info"])
    assert "Traceback" not in response.text
    step = http.post(f"/v1/sessions/{body['session_id']}/step", json={"action": "x"}, headers=ALICE)
    _assert_clean_error(step, 409, "session_finished")
    http.delete(f"/v1/sessions/{body['session_id']}", headers=ALICE)


def test_a_memory_bomb_is_reported_as_a_memory_limit(http: httpx.Client) -> None:
    opened = http.post("/v1/sessions", json={"code": MEMORY_BOMB_ENV, "seed": 1}, headers=ALICE)
    assert opened.status_code == 201 and opened.json()["outcome"] == "ok"
    session = opened.json()["session_id"]
    step = http.post(f"/v1/sessions/{session}/step", json={"action": "\\boxed{bomb}"}, headers=ALICE).json()
    assert step["outcome"] == "memory_limit" and step["terminated"] is False, step
    http.delete(f"/v1/sessions/{session}", headers=ALICE)


def test_docs_work_offline(http: httpx.Client) -> None:
    """/docs loads Swagger UI's assets from the service itself, never from a CDN."""
    page = http.get("/docs")
    assert page.status_code == 200 and "swagger-ui" in page.text
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert assets and all(a.startswith("/") and not a.startswith("//") for a in assets), assets
    assert "://" not in page.text.replace("'/openapi.json'", "")
    for asset in assets:
        assert http.get(asset).status_code == 200, asset
    assert http.get("/openapi.json").json()["openapi"].startswith("3.1")  # Swagger UI 5 renders 3.1
