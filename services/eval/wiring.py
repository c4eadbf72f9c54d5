"""Builds an eval from its settings and arguments: the only place the suites meet their adapters.

- **The model**: a URL is an SGLang-compatible server used as it is; a directory is a checkpoint
  (a Hugging Face directory, a published ``v<N>`` weights directory, or a learner checkpoint with
  ``model/`` and ``state.json``) served by the embedded server in this process on loopback, the
  way ``spade run`` serves its model; no ``--model`` means the default model.
- **The suite**: its adapter module, built with the model (and for ``pool`` a sandbox and the
  rollout's episode loop).
- **Batch invariance**: with ``batch_invariant`` (the default) every request asks for the server's
  batch-invariant mode; the server's ``/get_server_info`` says whether it can honour it, and the run
  header's ``sampling.batch_invariant`` records the answer (a warning says so when it cannot).
- **The run**: the store in the out directory, the loop, the summary.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.eval.core.records import ItemResult, RunHeader, Summary, summarise
from services.eval.core.runner import Suite, run_items, select
from services.eval.model import ClientChatModel, Invariance, Sampling, invariance_of
from services.eval.pool_source import PoolEnv, PoolSourceError
from services.eval.settings import SUITES, EvalSettings
from services.eval.store import RunStore
from spade.inference.client import InferenceClient, InferenceRequestError
from spade.serving.logs import get_logger

log = get_logger(__name__)


class EvalSetupError(RuntimeError):
    """The eval cannot start (bad model, server down, bad pool); the message is one line for a person."""


@dataclass(frozen=True)
class EvalRequest:
    """What the command line asks for.

    Attributes:
        suite: The suite's name.
        model: A checkpoint directory, a server URL, or None for the default model.
        seed: Seed of the item set (and of the sampling seeds).
        limit: Only the first ``limit`` items (None: all).
        out: The out directory (results are appended there; a rerun resumes).
        tokenizer: The model's checkpoint directory for its chat template (URL models only; default:
            the path the server reports, when it exists here).
    """

    suite: str
    model: str | None
    seed: int
    limit: int | None
    out: Path
    tokenizer: Path | None = None


@dataclass(frozen=True)
class ServedModel:
    """A model ready to answer.

    Attributes:
        client: The inference client (with the model's tokenizer).
        label: What the header calls the model (the ``--model`` argument, or the default's path).
        weight_version: ``/model_info``'s weight version.
        served_model: ``/model_info``'s model path.
    """

    client: InferenceClient
    label: str
    weight_version: str | None
    served_model: str


def is_url(model: str | None) -> bool:
    """Whether ``--model`` names a server rather than a checkpoint directory."""
    return model is not None and re.match(r"^https?://", model) is not None


def checkpoint_of(path: Path) -> tuple[Path, str | None]:
    """The Hugging Face directory inside ``path`` and the weight version it holds, if known.

    Raises:
        EvalSetupError: ``path`` is not a checkpoint of any kind this project writes.
    """
    from spade.inference.models import is_checkpoint

    path = path.expanduser()
    if not path.exists():
        raise EvalSetupError(f"no checkpoint at {path}: pass a checkpoint directory or a server URL")
    if (path / "model").is_dir() and is_checkpoint(path / "model"):  # a learner checkpoint
        version = None
        state = path / "state.json"
        if state.is_file():
            with contextlib.suppress(ValueError, OSError):
                version = json.loads(state.read_text()).get("version")
        return path / "model", None if version is None else str(version)
    if not is_checkpoint(path):
        raise EvalSetupError(
            f"{path} is not a checkpoint (needs config.json and *.safetensors, or model/ and state.json); "
            "pass a run's last_checkpoint, a published weights directory or a save_pretrained directory"
        )
    published = re.fullmatch(r"v0*(\d+)", path.name)  # the learner's published weights: v00000003
    return path, published.group(1) if published else None


@contextlib.asynccontextmanager
async def served_model(request: EvalRequest, settings: EvalSettings) -> AsyncIterator[ServedModel]:
    """Start (or reach) the model; stop what was started on exit.

    Raises:
        EvalSetupError: Missing checkpoint, unreachable server, or no tokenizer for a URL model.
    """
    async with contextlib.AsyncExitStack() as stack:
        if is_url(request.model):
            assert request.model is not None
            url = request.model.rstrip("/")
            tokenizer = await _tokenizer_for(url, request.tokenizer, settings)
            label = url
        else:
            from pydantic import ValidationError

            from services.inference.settings import InferenceSettings
            from services.inference.wiring import serve_in_thread
            from spade.config import describe_error
            from spade.inference.models import ModelError, resolve_model_path

            if request.model is None:
                try:
                    path, version = resolve_model_path(None), None
                except ModelError as exc:
                    raise EvalSetupError(str(exc)) from None
                label = str(path)
            else:
                path, version = checkpoint_of(Path(request.model))
                label = request.model
            overrides: dict[str, Any] = {
                "model_path": path,
                "http": {"host": "127.0.0.1", "port": 0},
                "fixed_weights": True,  # an eval serves one version: nothing publishes to it
            }
            if settings.torch_threads is not None:
                overrides["torch_threads"] = settings.torch_threads
            if version is not None:
                overrides["weight_version"] = version
            try:
                server = serve_in_thread(InferenceSettings(**overrides))
            except ValidationError as exc:
                problems = describe_error(exc, InferenceSettings).replace("\n", "; ")
                raise EvalSetupError(f"cannot serve {path}: {problems}") from None
            except (ModelError, OSError, ValueError, RuntimeError) as exc:
                raise EvalSetupError(f"cannot serve {path}: {exc}") from None
            stack.callback(server.stop)
            url, tokenizer = server.url, path
        client = InferenceClient([url], tokenizer_path=tokenizer, timeout_s=settings.request_timeout_s)
        stack.push_async_callback(client.aclose)
        info = await _ready(client, url, settings)
        yield ServedModel(client, label, info.weight_version, info.model_path)


async def _ready(client: InferenceClient, url: str, settings: EvalSettings) -> Any:
    """``/model_info`` once the server is ready; a server that is not there at all fails within seconds."""
    from spade.inference.client import InferenceError

    try:
        info = (await client.model_info())[0]  # the client's own retries: refused connections end quickly
        await client.wait_ready(timeout_s=settings.ready_timeout_s)
    except InferenceError as exc:
        raise EvalSetupError(f"the inference server at {url} is not answering: {exc}") from None
    return info


async def _tokenizer_for(url: str, tokenizer: Path | None, settings: EvalSettings) -> Path:
    """The chat template's directory for a server model: ``--tokenizer``, else the server's own path."""
    if tokenizer is not None:
        if not tokenizer.is_dir():
            raise EvalSetupError(f"--tokenizer {tokenizer} is not a directory; pass the model's checkpoint directory")
        return tokenizer
    async with InferenceClient([url], timeout_s=settings.request_timeout_s) as probe:
        info = await _ready(probe, url, settings)
    for candidate in (info.tokenizer_path, info.model_path):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    raise EvalSetupError(
        f"the server at {url} serves {info.model_path!r}, which is not a directory here; pass --tokenizer DIR "
        "(the model's checkpoint directory, for its chat template)"
    )


@dataclass(frozen=True)
class Preflight:
    """What was checked before the model is started (so bad input fails in a second, not after a load).

    Attributes:
        envs: The pool's playable envs (``pool`` suite only).
        source: Where they were read from.
    """

    envs: tuple[Any, ...] = ()
    source: str = ""


def preflight(request: EvalRequest, settings: EvalSettings, pool_source: str | None = None) -> Preflight:
    """Check the suite and its inputs without touching the model.

    Raises:
        EvalSetupError: Unknown suite, unknown datasets, missing bfcl-eval, or an unusable pool.
    """
    name = request.suite
    if name not in SUITES:
        raise EvalSetupError(f"unknown suite {name!r}; choose {', '.join(SUITES)}")
    if name == "reasoning-gym":
        from services.eval.suites.reasoning_gym import SuiteConfigError, hardest_config

        try:
            for dataset in settings.reasoning_gym.datasets:
                hardest_config(dataset, 0, 1)
        except SuiteConfigError as exc:
            raise EvalSetupError(str(exc)) from None
        return Preflight()
    if name == "bfcl-multi-turn":
        from services.eval.suites.bfcl import BfclSetupError, import_bfcl

        try:
            import_bfcl(request.out / "bfcl")
        except BfclSetupError as exc:
            raise EvalSetupError(str(exc)) from None
        return Preflight()
    from services.eval.pool_source import load_pool, playable

    source = pool_source or settings.pool.source
    if not source:
        raise EvalSetupError("the pool suite needs a pool: pass --pool RUN_DIR (or memory.db, envs.jsonl, a URL)")
    try:
        envs = playable(load_pool(source, read_memory_database), settings.pool.setting)
    except PoolSourceError as exc:
        raise EvalSetupError(str(exc)) from None
    if not envs:
        raise EvalSetupError(f"the pool at {source} has no env that passed validation; nothing to play")
    return Preflight(tuple(envs), source)


@contextlib.asynccontextmanager
async def build_suite(
    request: EvalRequest,
    settings: EvalSettings,
    model: ServedModel,
    checked: Preflight | None = None,
    sessions: Any = None,
) -> AsyncIterator[tuple[Suite, Sampling]]:
    """The suite named in ``request``, wired to ``model``; what it started is stopped on exit.

    Args:
        request: What to evaluate.
        settings: How.
        model: The model to ask.
        checked: The preflight's result (default: run here).
        sessions: Env sessions the ``pool`` suite plays through (``spade run``'s own sandbox pool);
            default: the sandbox of ``settings.pool.sandbox``, started here.

    Raises:
        EvalSetupError: Unknown suite or unusable suite settings.
    """
    name = request.suite
    checked = checked if checked is not None else preflight(request, settings)
    temperature, max_new_tokens = settings.sampling_for(name)
    invariance = await batch_invariance(model.client, settings.batch_invariant)
    sampling = Sampling(
        temperature=temperature, top_p=settings.top_p, max_new_tokens=max_new_tokens, batch_invariant=invariance
    )
    chat = ClientChatModel(model.client, sampling, run_key=f"eval:{name}:{request.seed}")
    if name == "reasoning-gym":
        from services.eval.suites.reasoning_gym import ReasoningGymSuite, SuiteConfigError

        rg = settings.reasoning_gym
        try:
            rg_suite = ReasoningGymSuite(chat, request.seed, rg.datasets, rg.items_per_category)
        except SuiteConfigError as exc:
            raise EvalSetupError(str(exc)) from None
        yield rg_suite, sampling
        return
    if name == "bfcl-multi-turn":
        from services.eval.suites.bfcl import BfclMultiTurnSuite, BfclSetupError

        b = settings.bfcl
        try:
            suite = BfclMultiTurnSuite(
                chat, request.seed, request.out / "bfcl", b.categories, b.items_per_category, b.max_steps
            )
        except BfclSetupError as exc:
            raise EvalSetupError(str(exc)) from None
        yield suite, sampling
        return
    async with _pool_suite(request, settings, model, sampling, checked, sessions) as pool_suite:
        yield pool_suite, sampling


async def batch_invariance(client: InferenceClient, requested: bool) -> Invariance:
    """Whether the servers behind ``client`` can make this eval's replies batch-invariant, and how.

    Asked of each worker's ``/get_server_info``; when they cannot honour a request for the mode the
    eval still runs (and still asks), with a warning that its replies may depend on the concurrency.
    """
    if not requested:
        return Invariance.OFF
    reason = "its /get_server_info shows neither enable_deterministic_inference nor per-request support"
    try:
        infos = await client.server_info()
    except InferenceRequestError as exc:
        infos, reason = [], f"its /get_server_info answered HTTP {exc.status}"
    if any(info is None for info in infos):
        reason = "it has no /get_server_info"
    invariance = invariance_of(True, infos)
    if invariance is Invariance.UNSUPPORTED:
        log.warning(
            "the inference server at %s cannot honour batch_invariant (%s): an item's reply may depend on how "
            "many items run at once; start SGLang with --enable-deterministic-inference (or evaluate a checkpoint "
            "directory, served by the embedded server), or set SPADE_EVAL_BATCH_INVARIANT=0. The run header "
            "records sampling.batch_invariant='unsupported'.",
            ", ".join(client.urls),
            reason,
        )
    return invariance


@contextlib.asynccontextmanager
async def _pool_suite(
    request: EvalRequest,
    settings: EvalSettings,
    model: ServedModel,
    sampling: Sampling,
    checked: Preflight,
    given: Any = None,
) -> AsyncIterator[Suite]:
    from services.eval.suites.pool import PoolSuite
    from services.rollout.policy import FormatterTemplate, InferenceGenerator
    from spade.agent.episode import EpisodeRunner, PlayLimits

    p = settings.pool
    limits = PlayLimits(
        max_turns=p.max_turns,
        max_tokens_per_turn=sampling.max_new_tokens,
        max_total_tokens=p.max_total_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
    )
    async with contextlib.AsyncExitStack() as stack:
        sessions = given if given is not None else await stack.enter_async_context(_sessions(settings))
        template = FormatterTemplate(model.client.formatter)
        client = model.client.batch_invariant() if sampling.asks_invariance else model.client
        runner = EpisodeRunner(sessions, InferenceGenerator(client), template, limits)
        yield PoolSuite(runner, template, checked.envs, request.seed, p.seeds_per_env, checked.source, p.retry)


@contextlib.asynccontextmanager
async def _sessions(settings: EvalSettings) -> AsyncIterator[Any]:
    """Env sessions: an isolated pool started here, or the sandbox service."""
    from spade.endpoints import PoolSandbox

    cfg = settings.pool.sandbox
    if isinstance(cfg, PoolSandbox):
        from services.rollout.sandbox import PoolSessions
        from services.sandbox.isolation import SandboxPool
        from services.sandbox.isolation.settings import IsolationSettings

        pool = SandboxPool(IsolationSettings.model_validate(cfg.isolation))
        try:
            await pool.start()
        except Exception as exc:  # a missing isolation layer: one line, not a traceback
            raise EvalSetupError(f"cannot start the sandbox pool: {exc}") from None
        try:
            yield PoolSessions(pool, cfg.checks)
        finally:
            await pool.stop()
        return
    from spade.sandbox.client import SandboxClient

    client = SandboxClient(
        cfg.target, cfg.key(), timeout_s=cfg.timeout_s, open_timeout_s=cfg.open_timeout_s, retry=cfg.retry
    )
    try:
        yield client
    finally:
        await client.close()


@dataclass(frozen=True)
class EvalOutcome:
    """What an eval left behind."""

    summary: Summary
    directory: Path
    ran: int
    resumed: int
    selected: int


async def run_eval(
    request: EvalRequest,
    settings: EvalSettings,
    *,
    pool_source: str | None = None,
    on_start: Callable[[int, int], None] | None = None,
    on_item: Callable[[ItemResult], None] | None = None,
    model: ServedModel | None = None,
    sessions: Any = None,
) -> EvalOutcome:
    """Run (or resume) an eval; returns its summary.

    Args:
        request: What to evaluate.
        settings: How.
        pool_source: The pool for the ``pool`` suite (overrides ``settings.pool.source``).
        model: A model already being served (``spade run``'s in-run eval asks its own server); default:
            ``request.model`` started or reached here.
        sessions: Env sessions for the ``pool`` suite (default: a sandbox started here).
        on_start: Called with ``(items to run, items already done)`` before the first item.
        on_item: Called with each finished item.

    Raises:
        EvalSetupError: The eval could not start (one line for a person).
        StoreError: The out directory holds another run.
    """
    checked = preflight(request, settings, pool_source)
    async with contextlib.AsyncExitStack() as stack:
        if model is None:
            model = await stack.enter_async_context(served_model(request, settings))
        suite, sampling = await stack.enter_async_context(build_suite(request, settings, model, checked, sessions))
        header = RunHeader(
            suite=suite.name,
            seed=request.seed,
            suite_config=suite.config(),
            model=model.label,
            weight_version=model.weight_version,
            served_model=model.served_model,
            sampling=sampling.to_dict(),
        )
        with RunStore(request.out, header) as store:
            todo, resumed = select(suite.items(), request.limit, store.done)
            if on_start is not None:
                on_start(len(todo), resumed)
            await run_items(suite, todo, store.append, concurrency=settings.concurrency, on_done=on_item)
            wanted = {item.id for item in suite.items()[: request.limit]} if request.limit else None
            items = [i for i in store.items if wanted is None or i.id in wanted]
            summary = summarise(header, items, resamples=settings.bootstrap_resamples, confidence=settings.confidence)
            store.write_summary(summary)
    return EvalOutcome(summary, request.out, len(todo), resumed, len(todo) + resumed)


def read_memory_database(url: str) -> list[PoolEnv]:
    """Envs of a memory database (oldest first) with the seeds each was played on (``pool_source.DatabaseReader``).

    Raises:
        PoolSourceError: No database there, or it cannot be read.
    """
    from sqlalchemy.exc import SQLAlchemyError

    from services.memory.store.sql import SqlStore, make_engine
    from spade.memory.errors import DatabaseUnavailable
    from spade.memory.records import EnvFilter

    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).is_file():
        raise PoolSourceError(f"no memory database at {url.removeprefix('sqlite:///')}; pass a run's memory.db")
    engine = make_engine(url)
    try:
        store = SqlStore(engine)
        envs = []
        for env in store.iter_environments(EnvFilter()):
            seeds: set[int] = set()
            cursor: str | None = None
            while True:
                plays, cursor = store.plays(env.id, limit=500, cursor=cursor)
                seeds.update(p.seed for p in plays)
                if not cursor:
                    break
            envs.append(
                PoolEnv(
                    env_id=env.id,
                    setting=env.setting,
                    skill=env.skill,
                    code=env.code,
                    hint=env.hint,
                    status=str(getattr(env.status, "value", env.status)),
                    corpus_ref=env.corpus_ref,
                    played_seeds=frozenset(seeds),
                )
            )
    except (SQLAlchemyError, DatabaseUnavailable) as exc:
        raise PoolSourceError(f"cannot read the memory at {engine.url!r}: {type(exc).__name__}") from None
    finally:
        engine.dispose()
    envs.reverse()  # the store lists newest first; oldest first reads like the run
    return envs
