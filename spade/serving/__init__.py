"""Serving a service: one gRPC bootstrap, one HTTP bootstrap, one error table, one way to start and stop.

- ``spade.serving.settings``: :class:`ServerAddress`, the ``grpc``/``http`` section of a service's settings.
- ``spade.serving.errors``: domain error kinds to HTTP and gRPC statuses (the only such table).
- ``spade.serving.grpc``: :func:`grpc_server` (reflection, health, auth/logging/metrics interceptor).
- ``spade.serving.http``: :func:`http_server` (uvicorn), the REST error shape, bearer auth, ``/healthz`` + ``/metrics``.
- ``spade.serving.run``: settings or a readable refusal (exit 2), and running until SIGTERM/SIGINT.

Heavy imports (grpc, uvicorn, FastAPI) stay in the submodules: import what you use from there.
"""

from spade.serving.settings import ServerAddress

__all__ = ["ServerAddress"]
