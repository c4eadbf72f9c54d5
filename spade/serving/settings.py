"""Where a server listens: one settings section, ``grpc`` or ``http`` in every service that serves.

``tls`` (``spade.serving.tls.ServerTls``) turns on TLS/HTTPS, and mutual TLS with a client CA.

>>> ServerAddress(host="0.0.0.0", port=50051).address
'0.0.0.0:50051'
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from spade.serving.tls import ServerTls

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
"""Hosts only this machine can reach."""


class ServerAddress(BaseModel):
    """The interface and port one server binds (``SPADE_<SERVICE>_GRPC__HOST``, ``..._HTTP__PORT``, ...)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(
        default="127.0.0.1",
        min_length=1,
        max_length=255,
        description="Interface to bind: 127.0.0.1 (this machine only) or 0.0.0.0 (every interface).",
    )
    port: int = Field(default=0, ge=0, le=65535, description="TCP port (0 picks a free one).")
    tls: ServerTls | None = Field(
        default=None,
        description="Serve over TLS (gRPC) or HTTPS (REST) with this certificate; with client_ca_file, mutual TLS. "
        "Unset: plaintext.",
    )

    @property
    def address(self) -> str:
        """``host:port``, as gRPC binds it."""
        return f"{self.host}:{self.port}"

    @property
    def secure(self) -> bool:
        """Whether the server speaks TLS (gRPC) or HTTPS (REST)."""
        return self.tls is not None

    @property
    def loopback(self) -> bool:
        """Whether only this machine can reach the server."""
        return self.host in LOOPBACK
