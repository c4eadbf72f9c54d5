"""The read-only REST inspection API and the small web page, on FastAPI.

Every ``/v1`` route and the page need a key of any role (``read`` is enough: nothing here writes;
``Authorization: Bearer <key>``) or a web session: ``POST /login`` checks a key and sets the
``spade_memory_session`` cookie to a random session id whose SHA-256 the database keeps (never the
key itself; ``HttpOnly``, ``SameSite=Strict``, ``Secure`` when served over HTTPS); a session reads,
whatever the role of the key that opened it. ``POST /logout`` ends the session. ``/healthz`` (the
bare word) and ``/docs`` are open; ``/healthz/details`` and ``/metrics`` need a key or a session too.
Errors, ``/healthz`` and ``/metrics`` are the shared ones of ``spade.serving.http``: every error
answers ``{"error": {"code", "message"}}`` — bad filters and cursors 422 with a message naming the
rule, unknown ids 404, a missing key or session 401.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs

from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.responses import HTMLResponse, PlainTextResponse, RedirectResponse, StreamingResponse
from fastapi.templating import Jinja2Templates
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import PythonLexer

from services.memory.service import MemoryService
from services.memory.settings import MemorySettings
from spade.auth import Principal, Role, Unauthenticated, authorize
from spade.envs.types import Setting
from spade.memory.records import DesignerAttempt, EnvFilter, Environment, EnvStatus, MemoryStats, Play
from spade.runspec import RunSpec
from spade.serving.http import HttpMetrics, install_error_handlers, ops_router

COOKIE = "spade_memory_session"
"""The web page's cookie: a random session id (the database keeps its SHA-256), never a key."""
TEMPLATES = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))


# -- response models (they document the API at /docs) ------------------------------------------


class StatsOut(BaseModel):
    plays: int
    window_plays: int = Field(description="Unhinted plays of the env's window slots 0..k-1.")
    win_rate: float | None = Field(description="Mean return of those plays (spade.signal.win_rate).")
    solved_fraction: float | None = Field(description="Share of those plays that reached return 1 (display only).")
    regret: float | None = Field(description="spade.signal.regret of slot 0's two arms; null until they match.")
    regret_note: str = Field(description="Why no regret is stored (empty when one is).")
    learnable: bool
    reward_components: dict[str, float]


class EnvSummary(BaseModel):
    id: str
    setting: str
    skill: str
    status: EnvStatus
    env_class: str
    hint: str
    weight_version: int
    designer_sample_id: str
    corpus_ref: str
    batch_id: str
    parent_ids: list[str]
    code_hash: str
    created_at: datetime
    window_start: int | None = Field(description="The env's first window version (null until first played).")
    window_versions: int = Field(description="k: the slots of its window (0 until first played).")
    stats: StatsOut
    code: str | None = Field(default=None, description="Present in listings only with include_code=true.")


class EnvDetail(EnvSummary):
    code: str | None
    validation_report: dict[str, Any]


class EnvPage(BaseModel):
    items: list[EnvSummary]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page.")


class PlayOut(BaseModel):
    env_id: str
    seed: int
    hinted: bool
    episode_return: float
    turns: int
    weight_version: int
    trajectory_id: str
    finish_reason: str
    played_at: datetime | None
    window_start: int
    window_index: int = Field(description="The window slot (0..k-1) the play belongs to.")
    spec_id: str


class PlayPage(BaseModel):
    items: list[PlayOut]
    next_cursor: str | None


class AttemptOut(BaseModel):
    sample_id: str
    setting: str
    skill: str
    outcome: str = Field(description="valid, malformed, duplicate or the failing check's name.")
    batch_id: str
    weight_version: int
    env_id: str
    spec_id: str
    created_at: datetime | None


class RunSpecOut(BaseModel):
    spec_id: str
    set_at: datetime
    spec: RunSpec


def _stats_out(e: Environment) -> StatsOut:
    s = e.stats
    return StatsOut(
        plays=s.plays,
        window_plays=s.window_plays,
        win_rate=s.win_rate,
        solved_fraction=s.solved_fraction,
        regret=s.regret,
        regret_note=s.regret_note,
        learnable=s.learnable,
        reward_components=s.reward_components,
    )


def summary(e: Environment, include_code: bool = False) -> EnvSummary:
    return EnvSummary(
        id=e.id,
        setting=e.setting,
        skill=e.skill,
        status=e.status,
        env_class=e.env_class,
        hint=e.hint,
        weight_version=e.weight_version,
        designer_sample_id=e.designer_sample_id,
        corpus_ref=e.corpus_ref,
        batch_id=e.batch_id,
        parent_ids=list(e.parent_ids),
        code_hash=e.code_hash,
        created_at=e.created_at,
        window_start=e.window_start,
        window_versions=e.window_versions,
        stats=_stats_out(e),
        code=e.code if include_code else None,
    )


def detail(e: Environment) -> EnvDetail:
    return EnvDetail(**summary(e, include_code=True).model_dump(), validation_report=e.validation_report)


def play_out(p: Play) -> PlayOut:
    values = {k: getattr(p, k) for k in PlayOut.model_fields}
    values["finish_reason"] = p.finish_reason or ""  # "" when the producer named none, as stored
    return PlayOut(**values)


def attempt_out(a: DesignerAttempt) -> AttemptOut:
    return AttemptOut(**{k: getattr(a, k) for k in AttemptOut.model_fields})


# -- filters ---------------------------------------------------------------------------------------


class FilterParams(BaseModel):
    """Filters of ``/v1/environments``, ``/v1/export`` and the page; every one optional."""

    model_config = ConfigDict(extra="ignore")

    setting: Setting | None = Field(default=None, description="game or tool")
    skill: str | None = Field(default=None, max_length=100)
    status: EnvStatus | None = Field(default=None, description="valid, invalid, retired or trivially_won")
    min_regret: float | None = Field(default=None, ge=-1.0, le=1.0, allow_inf_nan=False)
    max_win_rate: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    q: str | None = Field(default=None, min_length=1, max_length=200, description="Text in the code or hint")

    def to_filter(self) -> EnvFilter:
        return EnvFilter(
            setting=self.setting,
            skill=self.skill,
            status=self.status,
            min_regret=self.min_regret,
            max_win_rate=self.max_win_rate,
            q=self.q,
        )


def env_filter(params: Annotated[FilterParams, Query()]) -> EnvFilter:
    return params.to_filter()


Filter = Annotated[EnvFilter, Depends(env_filter)]
# Module level: route annotations are resolved in this module's namespace.
Limit = Annotated[int, Query(ge=1, le=1000, description="Page size")]
Cursor = Annotated[str | None, Query(max_length=200, description="next_cursor of the previous page")]


# -- metrics ---------------------------------------------------------------------------------------


class _MemoryCollector(Collector):
    def __init__(self, service: MemoryService, max_age_s: float) -> None:
        self._service = service
        self._max_age_s = max_age_s

    def collect(self) -> Iterator[GaugeMetricFamily]:
        st = self._service.store.stats(self._max_age_s)
        g = GaugeMetricFamily("spade_memory_environments", "Stored environments by status", labels=["status"])
        for status in EnvStatus:
            g.add_metric([status.value], st.by_status.get(status.value, 0))
        yield g
        yield GaugeMetricFamily("spade_memory_plays", "Recorded plays", value=st.plays)
        yield GaugeMetricFamily(
            "spade_memory_learnable_fraction",
            "Learnable fraction of scored environments",
            value=st.learnable_fraction or 0.0,
        )
        outcomes = GaugeMetricFamily(
            "spade_memory_designer_attempts", "Designer attempts by outcome", labels=["outcome"]
        )
        for outcome, n in sorted(st.attempts.by_outcome.items()):
            outcomes.add_metric([outcome], n)
        yield outcomes


# -- the app ---------------------------------------------------------------------------------------


def create_app(service: MemoryService, settings: MemorySettings) -> FastAPI:
    """The REST API + web page for ``service``; tokens and dev mode come from ``settings``."""
    app = FastAPI(
        title="SPADE environment memory",
        version="1",
        description="Read-only inspection of every environment the designer produced and how the agent did.",
    )
    registry = CollectorRegistry()
    registry.register(_MemoryCollector(service, settings.stats_refresh_s))
    app.state.registry = registry  # the gRPC server's call metrics go to the same /metrics
    keyring = settings.keyring()
    store = service.store

    async def session_tenant(request: Request) -> str | None:
        session_id = request.cookies.get(COOKIE, "")
        return await asyncio.to_thread(store.session_tenant, session_id) if session_id else None

    async def caller(request: Request) -> Principal:
        """A key in ``Authorization: Bearer``, else a live web session (which reads); 401 otherwise."""
        header = request.headers.get("authorization")
        if header or keyring.open:
            principal = keyring.authenticate(header)
        else:
            tenant = await session_tenant(request)
            if tenant is None:
                raise Unauthenticated(
                    "missing API key: send the header 'Authorization: Bearer <key>' or log in at /login"
                )
            principal = Principal(tenant, Role.READ)
        authorize(principal, Role.READ, "reading the memory")
        return principal

    auth = [Depends(caller)]
    install_error_handlers(app, service="memory")

    async def health() -> tuple[bool, dict[str, Any]]:
        try:
            await asyncio.to_thread(service.store.ping)
        except Exception:
            return False, {"status": "unavailable", "database": "unreachable"}
        return True, {"status": "ok"}

    app.include_router(ops_router(health=health, registry=registry, guard=None if keyring.open else caller))
    app.add_middleware(HttpMetrics, service="memory", registry=registry)

    @app.get("/v1/environments", response_model=EnvPage, dependencies=auth, tags=["environments"])
    async def list_environments(
        f: Filter, limit: Limit = 50, cursor: Cursor = None, include_code: bool = False
    ) -> EnvPage:
        """Environments newest first; keyset cursors stay stable while new environments arrive."""
        page = await service.list_environments(f, limit, cursor)
        return EnvPage(items=[summary(e, include_code) for e in page.items], next_cursor=page.next_cursor)

    @app.get("/v1/environments/{env_id}", response_model=EnvDetail, dependencies=auth, tags=["environments"])
    async def get_environment(env_id: str) -> EnvDetail:
        """One environment: code, hint, validation report and statistics."""
        return detail(await service.get_environment(env_id))

    @app.get(
        "/v1/environments/{env_id}/code",
        response_class=PlainTextResponse,
        dependencies=auth,
        tags=["environments"],
        responses={200: {"content": {"text/x-python": {}}}},
    )
    async def get_code(env_id: str) -> PlainTextResponse:
        """The environment's code as a Python file."""
        env = await service.get_environment(env_id)
        return PlainTextResponse(env.code, media_type="text/x-python")

    @app.get("/v1/environments/{env_id}/plays", response_model=PlayPage, dependencies=auth, tags=["environments"])
    async def get_plays(env_id: str, limit: Limit = 200, cursor: Cursor = None) -> PlayPage:
        """Plays of one environment, newest first."""
        plays, nxt = await service.plays(env_id, limit, cursor)
        return PlayPage(items=[play_out(p) for p in plays], next_cursor=nxt)

    @app.get("/v1/stats", response_model=MemoryStats, dependencies=auth, tags=["stats"])
    async def stats() -> MemoryStats:
        """Counts, the signal's aggregates, every designer attempt by outcome and round, and the pool's
        process metrics (learnable fraction, Vendi score / n, distinct envs and documents, reward levels,
        turns, program length, hidden state, formula leakage). Cached until the memory changes."""
        return await service.stats(settings.stats_refresh_s)

    @app.get("/v1/attempts", response_model=list[AttemptOut], dependencies=auth, tags=["stats"])
    async def attempts(
        batch_id: Annotated[str | None, Query(max_length=200, description="Only this round's attempts")] = None,
        limit: Limit = 200,
    ) -> list[AttemptOut]:
        """Designer attempts, newest first, whatever their outcome (malformed answers included)."""
        found = await asyncio.to_thread(store.attempts, batch_id, limit)
        return [attempt_out(a) for a in found]

    @app.get("/v1/runspec", response_model=RunSpecOut, dependencies=auth, tags=["runspec"])
    async def runspec() -> RunSpecOut:
        """The run spec every service of the run agreed on (404 before `spade runspec set FILE`)."""
        record = await service.get_run_spec()
        return RunSpecOut(spec_id=record.spec_id, set_at=record.set_at, spec=RunSpec.from_json(record.spec_json))

    @app.get(
        "/v1/export",
        dependencies=auth,
        tags=["environments"],
        response_class=StreamingResponse,
        responses={200: {"content": {"application/x-ndjson": {}}}},
    )
    def export(f: Filter) -> StreamingResponse:
        """Every matching environment (with code and report) as JSON Lines, streamed newest first."""

        def lines() -> Iterator[str]:
            for e in service.store.iter_environments(f):
                yield detail(e).model_dump_json() + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    # -- the web page ------------------------------------------------------------------------------

    @app.get("/login", response_class=HTMLResponse, include_in_schema=False)
    async def login_form(request: Request) -> HTMLResponse:
        return TEMPLATES.TemplateResponse(request, "login.html", {"error": None, "login_page": True})

    @app.post("/login", include_in_schema=False, response_model=None)
    async def login(request: Request) -> Response:
        # A one-field urlencoded form; parsed here to avoid a multipart dependency for it.
        form = parse_qs((await request.body()).decode(errors="replace"))
        token = (form.get("token") or [""])[0]
        principal = keyring.verify(token)
        if principal is None:
            return TEMPLATES.TemplateResponse(
                request, "login.html", {"error": "invalid token", "login_page": True}, status_code=401
            )
        session_id = await asyncio.to_thread(store.create_session, principal.tenant, settings.session_ttl_s)
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(
            COOKIE,
            session_id,
            max_age=int(settings.session_ttl_s),
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    @app.post("/logout", include_in_schema=False, response_model=None)
    async def logout(request: Request) -> Response:
        session_id = request.cookies.get(COOKIE, "")
        if session_id:
            await asyncio.to_thread(store.end_session, session_id)
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(COOKIE, httponly=True, samesite="strict", secure=request.url.scheme == "https")
        return response

    async def page_auth(request: Request) -> bool:
        header = request.headers.get("authorization", "")
        if keyring.open:
            return True
        if header.lower().startswith("bearer "):
            return keyring.verify(header[7:].strip()) is not None
        return await session_tenant(request) is not None

    @app.get("/", response_class=HTMLResponse, include_in_schema=False, response_model=None)
    async def index(request: Request, cursor: Cursor = None) -> Response:
        if not await page_auth(request):
            return RedirectResponse("/login", status_code=303)
        # An HTML form sends empty fields: they mean "no filter" here, unlike in the API.
        params = {k: v for k, v in request.query_params.items() if k in FilterParams.model_fields and v}
        error = None
        try:
            f = FilterParams.model_validate(params).to_filter()
        except ValidationError as exc:
            error = "; ".join(f"{e['loc'][0]}: {e['msg']}" for e in exc.errors())
            f = EnvFilter()
        page = await service.list_environments(f, 50, cursor)
        st = await service.stats(settings.stats_refresh_s)
        return TEMPLATES.TemplateResponse(
            request,
            "index.html",
            {"page": page, "stats": st, "params": params, "error": error, "statuses": list(EnvStatus)},
        )

    @app.get("/envs/{env_id}", response_class=HTMLResponse, include_in_schema=False, response_model=None)
    async def env_page(request: Request, env_id: str) -> Response:
        if not await page_auth(request):
            return RedirectResponse("/login", status_code=303)
        env = await service.get_environment(env_id)
        plays, _ = await service.plays(env_id, 200)
        formatter = HtmlFormatter(cssclass="code", linenos="table")
        return TEMPLATES.TemplateResponse(
            request,
            "env.html",
            {
                "env": env,
                "code_html": highlight(env.code, PythonLexer(), formatter),
                "code_css": formatter.get_style_defs(".code"),
                "checks": env.validation_report.get("checks", []),
                "report_json": json.dumps(env.validation_report, indent=2),
                "plays": plays,
            },
        )

    return app
