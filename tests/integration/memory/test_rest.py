"""The REST API and web page through httpx against the real app, on both databases."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
from pydantic import ValidationError
from sqlalchemy import Engine

from services.memory.rest import COOKIE, create_app
from services.memory.service import MemoryService
from services.memory.settings import MemorySettings
from services.memory.store.sql import SqlStore, migrate
from spade.auth import Principal, Role, hash_key
from spade.envs.types import FinishReason, Setting
from spade.memory.records import DesignerAttempt, EnvStatus, NewEnvironment, Play
from spade.runspec import RunSpec
from tests.integration.memory.conftest import new_env

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def service(empty_engine: Engine) -> MemoryService:
    migrate(empty_engine)
    return MemoryService(SqlStore(empty_engine))


@pytest.fixture
async def http(service: MemoryService) -> AsyncIterator[httpx.AsyncClient]:
    settings = MemorySettings(api_keys=[{"tenant": "ops", "key_sha256": hash_key(TOKEN)}])
    app = create_app(service, settings)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://memory") as c:
        yield c


async def seed(service: MemoryService) -> dict[str, str]:
    ids = {}
    report = {
        "valid": False,
        "checks": [
            {"name": "syntax", "passed": True, "detail": ""},
            {"name": "solution_replay", "passed": False, "detail": "lost on seed 3"},
        ],
    }
    ids["alpha"] = (await service.put_environment(new_env("Alpha", skill="Optimization", env_class="AlphaEnv"))).env_id
    ids["beta"] = (await service.put_environment(new_env("Beta", setting="tool", skill="Data Retrieval"))).env_id
    ids["bad"] = (
        await service.put_environment(
            new_env("Bad", status=EnvStatus.INVALID, validation_report=report, env_class="BadEnv")
        )
    ).env_id
    await service.record_plays(
        [
            Play(ids["alpha"], 1, False, 0.0, 3, 0, "a1", FinishReason.TRUNCATED),
            Play(ids["alpha"], 1, True, 1.0, 2, 0, "a2", FinishReason.TERMINATED),
        ]
    )
    return ids


async def test_api_needs_a_valid_bearer_token(http: httpx.AsyncClient) -> None:
    assert (await http.get("/v1/environments")).status_code == 401
    r = await http.get("/v1/stats", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert (await http.get("/v1/environments", headers=AUTH)).status_code == 200
    assert (await http.get("/healthz")).text == "ok"  # /healthz/details and /metrics need a key: test_privilege.py
    assert (await http.get("/metrics", headers=AUTH)).status_code == 200
    schema = (await http.get("/openapi.json")).json()
    assert {"/v1/environments", "/v1/environments/{env_id}/code", "/v1/export", "/v1/stats"} <= set(schema["paths"])
    assert (await http.get("/docs")).status_code == 200


async def test_listing_filters_and_details(http: httpx.AsyncClient, service: MemoryService) -> None:
    ids = await seed(service)

    async def listed(**params: str | float) -> set[str]:
        r = await http.get("/v1/environments", params=params, headers=AUTH)
        assert r.status_code == 200, r.text
        return {e["id"] for e in r.json()["items"]}

    assert await listed() == set(ids.values())
    assert await listed(setting="tool") == {ids["beta"]}
    assert await listed(status="invalid") == {ids["bad"]}
    assert await listed(min_regret=0.5) == {ids["alpha"]}
    assert await listed(max_win_rate=0.2, skill="Optimization") == {ids["alpha"]}
    assert await listed(q="betaenv") == {ids["beta"]}

    env = (await http.get(f"/v1/environments/{ids['bad']}", headers=AUTH)).json()
    assert env["validation_report"]["checks"][1]["detail"] == "lost on seed 3" and "class BadEnv" in env["code"]
    code = await http.get(f"/v1/environments/{ids['alpha']}/code", headers=AUTH)
    assert code.headers["content-type"].startswith("text/x-python") and code.text.startswith("import random")
    plays = (await http.get(f"/v1/environments/{ids['alpha']}/plays", headers=AUTH)).json()
    assert [p["trajectory_id"] for p in plays["items"]] == ["a2", "a1"]
    missing = await http.get("/v1/environments/ghost", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert "ghost" in missing.json()["error"]["message"]

    stats = (await http.get("/v1/stats", headers=AUTH)).json()
    assert stats["total"] == 3 and stats["by_status"] == {"valid": 2, "invalid": 1} and stats["mean_regret"] == 1.0
    assert stats["pool"]["envs"] == 2 and stats["pool"]["program_lines_mean"] > 5
    assert stats["attempts"] == {"attempts": 0, "valid": 0, "validity_rate": None, "by_outcome": {}, "by_round": {}}
    assert env["window_start"] is None and env["stats"]["regret_note"] == ""


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"min_regret": "lots"}, "min_regret"),
        ({"max_win_rate": "1.5"}, "max_win_rate"),
        ({"max_win_rate": "nan"}, "max_win_rate"),
        ({"status": "alive"}, "status"),
        ({"setting": "board"}, "setting"),
        ({"limit": "0"}, "limit"),
        ({"cursor": "not-a-cursor"}, "cursor"),
    ],
)
async def test_bad_filter_values_are_422_with_a_message(
    http: httpx.AsyncClient, params: dict[str, str], fragment: str
) -> None:
    r = await http.get("/v1/environments", params=params, headers=AUTH)
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"
    assert fragment in r.json()["error"]["message"]


async def test_cursor_pagination_is_stable_under_inserts(http: httpx.AsyncClient, service: MemoryService) -> None:
    first = [(await service.put_environment(new_env(f"P{i}"))).env_id for i in range(9)]
    r = (await http.get("/v1/environments", params={"limit": 4}, headers=AUTH)).json()
    seen = [e["id"] for e in r["items"]]
    await service.put_environment(new_env("Newcomer"))
    while r["next_cursor"]:
        r = (await http.get("/v1/environments", params={"limit": 4, "cursor": r["next_cursor"]}, headers=AUTH)).json()
        seen += [e["id"] for e in r["items"]]
    assert seen == first[::-1]


async def test_export_streams_jsonl(http: httpx.AsyncClient, service: MemoryService) -> None:
    ids = await seed(service)
    r = await http.get("/v1/export", headers=AUTH)
    assert r.headers["content-type"].startswith("application/x-ndjson")
    rows = [json.loads(line) for line in r.text.splitlines()]
    assert {row["id"] for row in rows} == set(ids.values()) and all(row["code"] for row in rows)
    only_tool = (await http.get("/v1/export", params={"setting": "tool"}, headers=AUTH)).text.splitlines()
    assert [json.loads(x)["id"] for x in only_tool] == [ids["beta"]]


async def login(http: httpx.AsyncClient) -> str:
    """Log in through the form; returns the session cookie's value (the client keeps the cookie)."""
    response = await http.post("/login", data={"token": TOKEN})
    assert response.status_code == 303
    return response.cookies[COOKIE]


async def test_web_page_lists_and_shows_an_environment(http: httpx.AsyncClient, service: MemoryService) -> None:
    ids = await seed(service)
    assert (await http.get("/")).headers["location"] == "/login"
    assert (await http.post("/login", data={"token": "wrong"})).status_code == 401
    await login(http)
    index = await http.get("/", params={"skill": "Optimization", "min_regret": ""})
    assert index.status_code == 200 and "AlphaEnv" in index.text and "BadEnv" not in index.text
    bad = await http.get("/", params={"max_win_rate": "7"})
    assert "Ignored bad filters" in bad.text and "max_win_rate" in bad.text
    page = await http.get(f"/envs/{ids['bad']}")
    assert page.status_code == 200
    assert "solution_replay" in page.text and "lost on seed 3" in page.text and "hint for Bad" in page.text
    assert '<span class="k">class</span>' in page.text  # pygments-highlighted code
    alpha = await http.get(f"/envs/{ids['alpha']}")
    assert "a2" in alpha.text and "truncated" in alpha.text


def test_settings_refuse_unsafe_defaults() -> None:
    with pytest.raises(ValidationError, match="no API key configured"):
        MemorySettings()
    with pytest.raises(ValidationError, match="key_sha256"):
        MemorySettings(api_keys=[{"tenant": "ops", "key_sha256": "plaintext-token"}])
    assert MemorySettings(dev_mode=True).keyring().verify("") == Principal("dev", Role.ADMIN)  # dev: open
    closed = MemorySettings(dev_mode=True, api_keys=[{"tenant": "ops", "key_sha256": hash_key("x")}]).keyring()
    assert closed.verify("") is None and closed.verify("x") == Principal("ops", Role.WRITE)  # no role: write


async def test_page_escapes_designer_output(http: httpx.AsyncClient, service: MemoryService) -> None:
    # Hints, class names and check details are written by the model: they must never run in a browser.
    evil = "<script>alert(1)</script>"
    report = {"checks": [{"name": "smoke", "passed": False, "detail": evil}]}
    env_id = (
        await service.put_environment(
            NewEnvironment(
                setting=Setting.GAME,
                skill="s",
                code=f"x = '{evil}'\n",
                hint=evil,
                env_class=evil,
                validation_report=report,
            )
        )
    ).env_id
    await login(http)
    for path in ("/", f"/envs/{env_id}"):
        body = (await http.get(path)).text
        assert evil not in body and "&lt;script&gt;" in body


async def test_the_login_cookie_holds_a_session_not_the_key(http: httpx.AsyncClient, service: MemoryService) -> None:
    response = await http.post("/login", data={"token": TOKEN})
    header = response.headers["set-cookie"]
    session = response.cookies[COOKIE]
    assert TOKEN not in header and hash_key(TOKEN) not in header and session != TOKEN
    assert "HttpOnly" in header and "SameSite=strict" in header.replace("Strict", "strict")
    assert "Secure" not in header  # plain HTTP here; over HTTPS the cookie is Secure (next test)
    assert (await http.get("/v1/stats")).status_code == 200  # the session opens the API too
    assert (await http.get("/")).status_code == 200

    stolen = httpx.AsyncClient(transport=http._transport, base_url="http://memory")
    stolen.cookies.set(COOKIE, TOKEN)  # a cookie carrying the raw key is no session
    assert (await stolen.get("/v1/stats")).status_code == 401
    stolen.cookies.set(COOKIE, session)
    assert (await stolen.get("/v1/stats")).status_code == 200

    out = await http.post("/logout")
    assert out.status_code == 303 and out.headers["location"] == "/login"
    assert (await stolen.get("/v1/stats")).status_code == 401, "logout did not end the session server-side"
    assert (await stolen.get("/")).headers["location"] == "/login"
    await stolen.aclose()


async def test_the_cookie_is_secure_over_https(service: MemoryService) -> None:
    settings = MemorySettings(api_keys=[{"tenant": "ops", "key_sha256": hash_key(TOKEN)}])
    transport = httpx.ASGITransport(app=create_app(service, settings))
    async with httpx.AsyncClient(transport=transport, base_url="https://memory") as https:
        header = (await https.post("/login", data={"token": TOKEN})).headers["set-cookie"]
    assert "Secure" in header and "HttpOnly" in header


async def test_runspec_and_attempts_routes(http: httpx.AsyncClient, service: MemoryService) -> None:
    missing = await http.get("/v1/runspec", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "runspec_not_set"
    spec = RunSpec(group_size=8)
    await service.set_run_spec(spec)
    got = (await http.get("/v1/runspec", headers=AUTH)).json()
    assert got["spec_id"] == spec.spec_id and RunSpec.model_validate(got["spec"]) == spec
    await service.record_attempts(
        [DesignerAttempt(f"a{i}", Setting.GAME, "Logic", "malformed", batch_id=f"r{i % 2}") for i in range(5)]
    )
    rows = (await http.get("/v1/attempts", params={"batch_id": "r0"}, headers=AUTH)).json()
    assert [r["sample_id"] for r in rows] == ["a4", "a2", "a0"] and rows[0]["outcome"] == "malformed"
    stats = (await http.get("/v1/stats", headers=AUTH)).json()
    assert stats["validity_rate"] == 0.0 and stats["attempts"]["by_round"] == {
        "r0": {"malformed": 3},
        "r1": {"malformed": 2},
    }
    assert stats["spec_id"] == spec.spec_id
    await login(http)
    page = (await http.get("/")).text
    assert "Designer validity: 0/5 attempts valid (0%)" in page and "5 malformed" in page


async def test_a_play_without_a_finish_reason_or_with_an_unknown_stored_one_is_listed_and_shown(
    http: httpx.AsyncClient, service: MemoryService, empty_engine: Engine
) -> None:
    """A play recorded without a finish reason (None, stored as "") and a row holding a reason this
    code does not know (an older producer's) are listed over REST and on the page, with "" for the
    reason, and count as no resource fault; a new play naming an unknown reason is refused."""
    from sqlalchemy import text

    from spade.memory.errors import InvalidArgument

    env_id = (await service.put_environment(new_env("Gamma"))).env_id
    await service.record_plays([Play(env_id, 1, False, 1.0, 2, 0, "g1"), Play(env_id, 2, False, 0.0, 2, 0, "g2")])
    with empty_engine.begin() as conn:
        conn.execute(text("UPDATE plays SET finish_reason = 'stop' WHERE trajectory_id = 'g2'"))
    r = await http.get(f"/v1/environments/{env_id}/plays", headers=AUTH)
    assert r.status_code == 200, r.text
    assert {p["trajectory_id"]: p["finish_reason"] for p in r.json()["items"]} == {"g1": "", "g2": ""}
    await login(http)
    page = await http.get(f"/envs/{env_id}")
    assert page.status_code == 200 and "g1" in page.text and "<td>None</td>" not in page.text
    plays, _ = await service.plays(env_id)
    assert [p.finish_reason for p in plays] == [None, None]
    with pytest.raises(InvalidArgument, match="finish reason 'exploded'"):
        await service.record_plays([Play(env_id, 3, False, 1.0, 2, 0, "g3", "exploded")])  # type: ignore[arg-type]
