"""Builds the embedded inference server from its settings: the only place adapters meet the engine."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from services.inference.app import create_app
from services.inference.engine import BatchEngine
from services.inference.settings import InferenceSettings

logger = logging.getLogger(__name__)


def build_engine(settings: InferenceSettings) -> BatchEngine:
    """Load the model and build the (not yet started) batching engine."""
    return BatchEngine(
        settings.model_path,
        weight_version=settings.weight_version,
        max_batch_size=settings.max_batch_size,
        max_waiting=settings.max_waiting,
        max_prefill_tokens=settings.max_prefill_tokens,
        context_length=settings.context_length,
        torch_threads=settings.torch_threads,
        prefix_cache_tokens=settings.prefix_cache_tokens,
    )


def build_app(settings: InferenceSettings, engine: BatchEngine | None = None) -> FastAPI:
    """The HTTP app; its lifespan starts the engine and closes it on shutdown."""
    engine = engine or build_engine(settings)
    app = create_app(engine, served_model_name=settings.served_model_name, health_timeout_s=settings.health_timeout_s)

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
    """An embedded server running in a background thread of this process."""

    url: str
    engine: BatchEngine
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self, timeout_s: float = 30.0) -> None:
        """Shut the HTTP server and the engine down."""
        self.server.should_exit = True
        self.thread.join(timeout=timeout_s)
        self.engine.close()


def serve_in_thread(settings: InferenceSettings, *, startup_timeout_s: float = 300.0) -> ServerHandle:
    """Start the server on ``settings.host:settings.port`` (0 picks a free port) in a thread.

    Used by the embedded ``spade run`` and by tests; returns once the server accepts requests.
    """
    settings.check_safe()
    engine = build_engine(settings)
    app = build_app(settings, engine)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="inference-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            engine.close()
            raise RuntimeError(f"the inference server did not start on {settings.host}:{settings.port}")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://{settings.host}:{port}"
    logger.info("inference server listening on %s (model %s)", url, engine.model_path)
    return ServerHandle(url=url, engine=engine, server=server, thread=thread)
