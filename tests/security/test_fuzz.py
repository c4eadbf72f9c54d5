"""Property-based fuzzing of every REST API (sandbox, memory, inference) from its own OpenAPI schema.

Each service runs in this process the way it is deployed: the real app with its real dependencies
(the sandbox over a real isolated ``SandboxPool``, the memory over a migrated SQLite store, the
inference server over the real SmolLM2 engine), served by the shared uvicorn bootstrap on a loopback
port in a thread of its own. schemathesis reads ``/openapi.json`` and generates, for every operation,
schema-conforming (positive) and schema-violating (negative) requests, sent with a valid bearer key
so they reach the handlers. Every answer must:

- never be a server error (status < 500);
- never carry a traceback, nor echo a string of the request's body in a refusal (the caller's code);
- answer every refusal in the one error shape, ``{"error": {"code": str, "message": str}}``
  (``spade.serving.http.error_response``), except the two SGLang-compatible answers of the inference
  server's admin routes (see ``SGLANG_BODIES``);
- for a 2xx, conform to the operation's declared response schema (schemathesis's
  ``response_schema_conformance``).

Every authenticated operation also answers 401, in the error shape with ``WWW-Authenticate: Bearer``,
without a key, with an unknown key and with a malformed header.

Runs are reproducible (``derandomize``, no example database) and bounded (``max_examples`` per
operation and mode); the number of calls per API is printed at the end of the module (and with
``-s`` after each API). docs/fuzzing.md says what is fuzzed and what is left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import hypothesis
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given
from schemathesis import GenerationMode
from schemathesis.checks import CheckFunction, not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import negative_data_rejection, response_schema_conformance
from starlette.types import ASGIApp

from spade.auth import hash_key
from spade.serving.http import http_server
from spade.serving.settings import ServerAddress

pytestmark = pytest.mark.slow

USER_KEY = "fuzz-user-key-0123456789"
ADMIN_KEY = "fuzz-admin-key-0123456789"
AUTH = {"Authorization": f"Bearer {USER_KEY}"}

OPEN_PATHS = {"/healthz", "/health", "/health_generate"}
"""Routes every service leaves open (health, without details); every other route needs a key
(``/healthz/details`` and ``/metrics`` included)."""

ADMIN_PATHS = {"/flush_cache", "/update_weights_from_disk"}
"""Inference routes that take the admin key: the user key, known but without the role, gets 403."""

SGLANG_BODIES = {
    ("POST", "/update_weights_from_disk"): 400,
    ("GET", "/flush_cache"): 400,
    ("POST", "/flush_cache"): 400,
}
"""Refusals that keep SGLang's own body (``{"success": false, "message": ...}``, plain text) for its clients."""

RUNS_CALLERS_CODE = {("POST", "/v1/execute")}
"""Operations whose answer carries the caller's own program's stdout and stderr (its traceback, if it failed)."""

ECHO_MIN_CHARS = 16
"""A request-body string this long found in a refusal counts as echoed (shorter ones match by chance)."""

CALLS: Counter[str] = Counter()
"""Requests sent per API (fuzzed and unauthenticated), printed when the module ends."""

STATUSES: dict[str, Counter[str]] = {"sandbox": Counter(), "memory": Counter(), "inference": Counter()}
"""Fuzzed answers per API, operation and status (printed with ``-s``: did the fuzzing reach the handlers?)."""


@pytest.fixture(scope="module", autouse=True)
def report_calls(request: pytest.FixtureRequest) -> Iterator[None]:
    """Print the calls made per API when the module ends (visible without ``-s``)."""
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    line = (
        "fuzz calls: " + ", ".join(f"{api}={n}" for api, n in sorted(CALLS.items())) + f", total={sum(CALLS.values())}"
    )
    if reporter is not None:
        reporter.write_line("")
        reporter.write_line(line)
    else:  # pragma: no cover - pytest without its terminal
        print(line)


# -- serving an app in a thread -------------------------------------------------------------------------


@contextlib.contextmanager
def served(make_app: Callable[[], contextlib.AbstractAsyncContextManager[ASGIApp]], service: str) -> Iterator[str]:
    """Serve the app ``make_app`` builds (on the server's own event loop) on a loopback port; yields its URL."""
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    started = threading.Event()
    url: list[str] = []
    failure: list[BaseException] = []

    async def main() -> None:
        try:
            async with (
                make_app() as app,
                http_server(app, ServerAddress(host="127.0.0.1", port=0), service=service, lifespan="off") as running,
            ):
                url.append(f"http://127.0.0.1:{running.port}")
                started.set()
                await stop.wait()
        except BaseException as exc:
            failure.append(exc)
            started.set()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True, name=f"fuzz-{service}")
    thread.start()
    started.wait(120)
    if failure:
        raise failure[0]
    assert url, f"the {service} server did not start within 120 s"
    try:
        yield url[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(60)
        with contextlib.suppress(Exception):
            loop.close()


@pytest.fixture(scope="module")
def sandbox_url() -> Iterator[str]:
    from services.sandbox.rest import create_app
    from services.sandbox.settings import SandboxSettings
    from services.sandbox.wiring import sandbox_service

    settings = SandboxSettings(
        max_request_bytes=256 * 1024,
        api_keys=[
            {
                "tenant": "fuzz",
                "key_sha256": hash_key(USER_KEY),
                "max_sessions": 4,
                "executions_per_minute": 100_000,
            }
        ],
    )

    @contextlib.asynccontextmanager
    async def make_app() -> AsyncIterator[ASGIApp]:
        async with sandbox_service(settings) as service:
            yield create_app(service, max_request_bytes=settings.max_request_bytes)

    with served(make_app, "sandbox") as url:
        yield url


@pytest.fixture(scope="module")
def memory_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    from services.memory.rest import create_app
    from services.memory.service import MemoryService
    from services.memory.settings import MemorySettings
    from services.memory.store.sql import SqlStore, make_engine, migrate
    from tests.integration.memory.conftest import new_env

    engine = make_engine(f"sqlite:///{tmp_path_factory.mktemp('fuzz-memory') / 'memory.db'}")
    migrate(engine)
    service = MemoryService(SqlStore(engine))
    settings = MemorySettings(api_keys=[{"tenant": "fuzz", "key_sha256": hash_key(USER_KEY)}])
    known: dict[str, str] = {}

    @contextlib.asynccontextmanager
    async def make_app() -> AsyncIterator[ASGIApp]:
        # Something to list, page through and export: two environments of different settings.
        alpha = await service.put_environment(new_env("Alpha", skill="Optimization"))
        await service.put_environment(new_env("Beta", setting="tool", skill="Data Retrieval"))
        known["env_id"] = alpha.env_id
        yield create_app(service, settings)

    try:
        with served(make_app, "memory") as url:
            yield url, known
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def inference_url() -> Iterator[str]:
    from services.inference.app import create_app
    from services.inference.engine import BatchEngine
    from services.inference.settings import InferenceSettings
    from spade.inference.models import ensure_default_model

    # One intra-op thread: see tests/integration/inference/conftest.py.
    engine = BatchEngine(ensure_default_model(), weight_version="0", max_batch_size=16, torch_threads=1)
    engine.start()

    @contextlib.asynccontextmanager
    async def make_app() -> AsyncIterator[ASGIApp]:
        settings = InferenceSettings(
            api_keys=[{"tenant": "fuzz", "key_sha256": hash_key(USER_KEY)}],
            admin_keys=[{"tenant": "fuzz-admin", "key_sha256": hash_key(ADMIN_KEY)}],
        )
        yield create_app(engine, keys=settings.keyring())

    try:
        with served(make_app, "inference") as url:
            yield url
    finally:
        engine.close()


# -- the checks -----------------------------------------------------------------------------------------


def strings_in(value: Any) -> Iterator[str]:
    """Every string value (not key) inside a JSON-like value."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings_in(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from strings_in(item)


@dataclass(frozen=True)
class Answer:
    """What a check reads of a response, from ``requests`` or schemathesis's own ``Response``."""

    status: int
    text: str
    headers: dict[str, str]

    @classmethod
    def of(cls, response: Any) -> Answer:
        headers = {k.lower(): v[0] if isinstance(v, list) else v for k, v in response.headers.items() if v}
        return cls(response.status_code, response.content.decode("utf-8", "replace"), headers)


def check_error_shape(answer: Answer, where: str) -> None:
    """The one REST error body: ``{"error": {"code": str, "message": str}}``, and nothing else."""
    try:
        body = json.loads(answer.text)
    except ValueError:
        raise AssertionError(f"{where}: error body is not JSON: {answer.text[:200]!r}") from None
    assert isinstance(body, dict) and set(body) == {"error"}, f"{where}: not the error shape: {body!r:.300}"
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"code", "message"}, f"{where}: not the error shape: {body!r:.300}"
    assert isinstance(error["code"], str) and error["code"], f"{where}: error.code is not a string: {body!r:.300}"
    assert isinstance(error["message"], str), f"{where}: error.message is not a string: {body!r:.300}"
    if answer.status == 401:
        assert answer.headers.get("www-authenticate") == "Bearer", f"{where}: no WWW-Authenticate: Bearer"


def check_answer(case: schemathesis.Case, answer: Answer) -> None:
    """What every answer must satisfy (the module docstring's list)."""
    method, path = case.operation.method.upper(), case.operation.path
    where = f"{method} {path} -> {answer.status}"
    assert answer.status < 500, f"{where}: server error: {answer.text[:300]!r}"
    text = answer.text
    if (method, path) in RUNS_CALLERS_CODE and answer.status < 300:
        text = json.dumps({k: v for k, v in json.loads(text).items() if k not in ("stdout", "stderr")})
    assert "Traceback" not in text, f"{where}: traceback in the answer: {answer.text[:300]!r}"
    if answer.status < 400 or SGLANG_BODIES.get((method, path)) == answer.status:
        return
    check_error_shape(answer, where)
    for text in strings_in(case.body):
        fragment = text.strip()
        if len(fragment) >= ECHO_MIN_CHARS:
            assert fragment not in answer.text, f"{where}: echoes the request's {fragment[:60]!r}"


# -- fuzzing ---------------------------------------------------------------------------------------------


@dataclass
class Api:
    """One API to fuzz: its name, how many examples per operation and mode, and per-case adjustments."""

    name: str
    examples: int
    adjust: Callable[[schemathesis.Case, GenerationMode], None] = lambda case, mode: None
    known: dict[str, str] = field(default_factory=dict)
    """Path parameters naming something that exists: operations taking one are also fuzzed with it."""
    failures: list[str] = field(default_factory=list)


def key_for(path: str) -> str:
    return ADMIN_KEY if path in ADMIN_PATHS else USER_KEY


def fuzz(api: Api, url: str) -> None:
    """Fuzz every operation of the API at ``url`` in both modes; collect every failure, then fail once."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), f"{api.name}: an operation its schema cannot describe: {result!r}"
        operations.append(result.ok())
    assert operations, f"{api.name}: no operation in the schema"
    calls_before = CALLS[api.name]
    runs: list[tuple[Any, GenerationMode, dict[str, str] | None]] = [
        (operation, mode, None) for operation in operations for mode in GenerationMode
    ]
    for operation in operations:
        names = {p.name for p in operation.path_parameters}
        if names and names <= set(api.known):
            runs.append((operation, GenerationMode.POSITIVE, {n: api.known[n] for n in names}))
    for operation, mode, path_parameters in runs:
        try:
            fuzz_operation(api, url, operation, mode, path_parameters)
        except hypothesis.errors.Unsatisfiable:
            assert mode is GenerationMode.NEGATIVE, f"{operation.label}: no positive case"  # nothing to violate
        except Exception as exc:
            known = f" {path_parameters}" if path_parameters else ""
            api.failures.append(f"{operation.label} [{mode.value}{known}]: {str(exc)[:1500]}")
    print(f"{api.name}: {len(operations)} operations, {CALLS[api.name] - calls_before} fuzzed calls")
    for label, n in sorted(STATUSES[api.name].items()):
        print(f"  {label}: {n}")
    check_unauthenticated(api, url, operations)
    assert not api.failures, f"{api.name}: {len(api.failures)} failing operation(s):\n" + "\n\n".join(api.failures)


def fuzz_operation(
    api: Api, url: str, operation: Any, mode: GenerationMode, path_parameters: dict[str, str] | None
) -> None:
    """Send ``api.examples`` generated requests to one operation and check every answer."""
    checks: list[CheckFunction] = [not_a_server_error]
    if mode is GenerationMode.NEGATIVE:
        checks.append(negative_data_rejection)  # a request the schema forbids is refused

    @hypothesis.settings(
        max_examples=api.examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(case=operation.as_strategy(generation_mode=mode, path_parameters=path_parameters))
    def one(case: schemathesis.Case) -> None:
        api.adjust(case, mode)
        headers = {"Authorization": f"Bearer {key_for(case.operation.path)}"}
        response = case.call(base_url=url, headers=headers, timeout=120)
        CALLS[api.name] += 1
        STATUSES[api.name][f"{case.operation.label} {response.status_code}"] += 1
        check_answer(case, Answer.of(response))
        sglang = SGLANG_BODIES.get((case.operation.method.upper(), case.operation.path)) == response.status_code
        # Every declared answer matches its declared schema; SGLang's own bodies are not declared.
        declared = [] if sglang else [response_schema_conformance]
        case.validate_response(response, checks=[*checks, *declared], headers=headers)

    one()


def check_unauthenticated(api: Api, url: str, operations: list[Any]) -> None:
    """Every operation that needs a key answers 401 in the error shape without one, or with a bad one;
    an admin route answers 403 to a known key without the role."""
    for operation in operations:
        if operation.path in OPEN_PATHS:
            continue
        path = operation.path.replace("{", "").replace("}", "")  # any value: auth comes first
        if operation.path in ADMIN_PATHS:
            response = requests.request(operation.method.upper(), url + path, headers=AUTH, timeout=60)
            CALLS[api.name] += 1
            if response.status_code != 403:
                api.failures.append(f"{operation.label} with the user key: {response.status_code}, not 403")
        for headers in ({}, {"Authorization": "Bearer not-a-key"}, {"Authorization": "Basic Zm9vOmJhcg=="}):
            response = requests.request(operation.method.upper(), url + path, headers=headers, timeout=60)
            CALLS[api.name] += 1
            where = f"{operation.label} with {headers or 'no key'}"
            if response.status_code != 401:
                api.failures.append(f"{where}: {response.status_code}, not 401: {response.text[:200]!r}")
                continue
            try:
                check_error_shape(Answer.of(response), where)
            except AssertionError as exc:
                api.failures.append(str(exc))


GENERATION_LIMITS = {"max_new_tokens": 4, "max_tokens": 4, "max_completion_tokens": 4, "n": 2}
"""The most a fuzzed generation asks for (the engine clamps only to the context length: docs/fuzzing.md)."""


VOCAB_SIZE = 49152
"""SmolLM2's vocabulary: positive prompts' token ids are taken modulo it, so generation is reached."""


def client_shaped(case: schemathesis.Case, mode: GenerationMode) -> None:
    """Keep a fuzzed generation short, as a client holding to a budget would (a CPU model is slow).

    Positive cases are also shaped the way a client builds a prompt, which the schema cannot say
    (token ids within the vocabulary, chat messages with a role and text), so that generation, not
    only validation, is fuzzed; negative cases are sent as generated.
    """
    if not isinstance(case.body, dict):
        return
    body: dict[str, Any] = case.body
    if mode is GenerationMode.POSITIVE:
        if case.operation.path == "/generate" and body.get("input_ids") is None and body.get("text") is None:
            body["text"] = "Name a colour."  # the schema cannot say that one of the two is required
        ids = body.get("input_ids")
        if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
            body["input_ids"] = [abs(t) % VOCAB_SIZE for t in ids]
        messages = body.get("messages")
        if isinstance(messages, list):
            body["messages"] = [
                {"role": ("user", "assistant", "system")[i % 3], "content": json.dumps(m)[:200]}
                for i, m in enumerate(messages)
            ]
    if case.operation.path == "/v1/chat/completions":
        body.setdefault("max_tokens", GENERATION_LIMITS["max_tokens"])  # the default is 128 tokens
    elif isinstance(body.get("sampling_params"), dict):
        body["sampling_params"].setdefault("max_new_tokens", GENERATION_LIMITS["max_new_tokens"])
    elif "sampling_params" not in body:
        body["sampling_params"] = {"max_new_tokens": GENERATION_LIMITS["max_new_tokens"]}
    for holder in (body, body.get("sampling_params")):
        if not isinstance(holder, dict):
            continue
        for name, most in GENERATION_LIMITS.items():
            value = holder.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > most:
                holder[name] = most
    if isinstance(body.get("input_ids"), list):
        body["input_ids"] = body["input_ids"][:64]


def test_sandbox_api(sandbox_url: str) -> None:
    fuzz(Api("sandbox", examples=20), sandbox_url)


def test_memory_api(memory_url: tuple[str, dict[str, str]]) -> None:
    url, known = memory_url
    fuzz(Api("memory", examples=25, known=known), url)


@pytest.mark.model
def test_inference_api(inference_url: str) -> None:
    fuzz(Api("inference", examples=6, adjust=client_shaped), inference_url)
