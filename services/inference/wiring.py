"""Builds the embedded inference server from its settings: the only place adapters meet the engine."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI

from services.inference.app import create_app
from services.inference.engine import BatchEngine
from services.inference.settings import InferenceSettings
from spade.inference.published import published_model
from spade.serving import lifecycle
from spade.serving.http import http_server
from spade.serving.logs import get_logger

logger = get_logger(__name__)


def starting_weights(settings: InferenceSettings) -> tuple[Path | None, str]:
    """The model directory and weight version the server starts with.

    The newest version the learner published (``published_weights_dir``) when there is one, so a
    restarted server serves it; else ``model_path`` (``None``: the default model) at ``weight_version``.
    """
    if settings.published_weights_dir is not None:
        published = published_model(settings.published_weights_dir)
        if published is not None:
            path, version = published
            logger.info("serving the newest published weights: version %d from %s", version, path)
            return path, str(version)
    return settings.model_path, settings.weight_version


def build_engine(settings: InferenceSettings) -> BatchEngine:
    """Load the model and build the (not yet started) batching engine."""
    model_path, weight_version = starting_weights(settings)
    return BatchEngine(
        model_path,
        weight_version=weight_version,
        max_batch_size=settings.max_batch_size,
        max_waiting=settings.max_waiting,
        max_prefill_tokens=settings.max_prefill_tokens,
        prefill_batch_tokens=settings.prefill_batch_tokens,
        context_length=settings.context_length,
        torch_threads=settings.torch_threads,
        prefix_cache_tokens=settings.prefix_cache_tokens,
        batch_invariant=settings.enable_deterministic_inference,
        weights=settings.weights,
    )


def build_app(settings: InferenceSettings, engine: BatchEngine | None = None) -> FastAPI:
    """The HTTP app; its lifespan starts the engine and closes it on shutdown."""
    engine = engine or build_engine(settings)
    app = create_app(
        engine,
        served_model_name=settings.served_model_name,
        health_timeout_s=settings.health_timeout_s,
        keys=settings.keyring(),
    )
    warning = settings.admin_off_warning()
    if warning is not None:
        logger.warning(warning)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.close()

    app.router.lifespan_context = lifespan
    app.state.engine = engine
    return app


@dataclass
class ServerHandle:
    """An embedded server running on its own event loop in a background thread of this process."""

    url: str
    engine: BatchEngine
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop
    stopping: asyncio.Event

    def stop(self, timeout_s: float = 30.0) -> None:
        """Shut the HTTP server and the engine down."""
        with contextlib.suppress(RuntimeError):  # the loop already ended
            self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(timeout=timeout_s)
        self.engine.close()


async def serve_forever(settings: InferenceSettings, stop: asyncio.Event) -> None:
    """Entry point of ``spade serve inference``: serve until ``stop`` is set (SIGTERM/SIGINT)."""
    engine = build_engine(settings)
    app = build_app(settings, engine)
    async with http_server(app, settings.http, service="inference", log_level="info", lifespan="on") as running:
        scheme = "https" if settings.http.tls is not None else "http"
        lifecycle.started(
            f"inference serving on {scheme}://{settings.http.host}:{running.port}",
            settings=settings,
            port=running.port,
            model=str(settings.model_path) if settings.model_path else None,
        )
        await stop.wait()
        # What the engine served, and what the stop cuts short (those requests fail with EngineClosed).
        lifecycle.note_finished(
            f"inference stopped at weight version {engine.weight_version}",
            requests_served=engine.work.prefills,
            generated_tokens=engine.work.generated_tokens,
            requests_cut_short=engine.num_running + engine.num_waiting,
        )


def serve_in_thread(settings: InferenceSettings, *, startup_timeout_s: float = 300.0) -> ServerHandle:
    """Start the server on ``settings.http`` (port 0 picks a free one) in a thread with its own loop.

    Used by the embedded ``spade run`` and by tests; returns once the server accepts requests.

    Raises:
        RuntimeError: The server did not start within ``startup_timeout_s`` (or failed to).
    """
    engine = build_engine(settings)
    app = build_app(settings, engine)
    loop = asyncio.new_event_loop()
    stopping = asyncio.Event()
    started = threading.Event()
    result: dict[str, object] = {}

    async def main() -> None:
        try:
            async with http_server(app, settings.http, service="inference", lifespan="on") as running:
                result["port"] = running.port
                started.set()
                await stopping.wait()
        except BaseException as exc:
            result["error"] = exc
            raise
        finally:
            started.set()

    def run() -> None:
        with contextlib.suppress(BaseException):
            loop.run_until_complete(main())
        loop.close()

    thread = threading.Thread(target=run, name="inference-http", daemon=True)
    thread.start()
    if not started.wait(startup_timeout_s) or "port" not in result:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(stopping.set)
        thread.join(timeout=30)
        engine.close()
        raise RuntimeError(
            f"the inference server did not start on {settings.http.address}: {result.get('error', 'timed out')}"
        )
    url = f"http://{settings.http.host}:{result['port']}"
    logger.info("inference server listening on %s (model %s)", url, engine.model_path)
    return ServerHandle(url=url, engine=engine, thread=thread, loop=loop, stopping=stopping)
