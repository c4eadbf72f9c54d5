"""TLS for every server and client: one settings shape each, turned into gRPC credentials or an SSL context.

A server's ``grpc``/``http`` section takes ``tls: {cert_file, key_file, client_ca_file}``: with it the
gRPC server serves over TLS and the HTTP server over HTTPS; with ``client_ca_file`` too, each client
must present a certificate signed by that CA (mutual TLS) and any other is refused during the
handshake. A client's ``sandbox``/``memory`` section (``spade.endpoints``) and the inference client
take ``tls: {ca_file, cert_file, key_file}``: the CA that signed the server's certificate (unset: the
system's roots) and, for mutual TLS, its own certificate and key.

There is no fallback: a TLS client never retries in plaintext, and a server configured with TLS
never also listens without it.

    SPADE_MEMORY_GRPC__TLS__CERT_FILE=/etc/spade/tls/memory.crt
    SPADE_MEMORY_GRPC__TLS__KEY_FILE=/etc/spade/tls/memory.key
    SPADE_MEMORY_GRPC__TLS__CLIENT_CA_FILE=/etc/spade/tls/ca.crt      # mutual TLS
    SPADE_ROLLOUT_MEMORY__TLS__CA_FILE=/etc/spade/tls/ca.crt
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, FilePath, model_validator

if TYPE_CHECKING:  # grpc is imported where credentials are made: settings stay light to import
    import grpc


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(
            f"cannot read the {what} {path} ({exc.strerror or exc}); check the path and its permissions"
        ) from None


class ServerTls(BaseModel):
    """A server's certificate and key, and (for mutual TLS) the CA its clients' certificates must chain to."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cert_file: FilePath = Field(description="PEM certificate chain the server presents (its own certificate first).")
    key_file: FilePath = Field(description="PEM private key of that certificate (readable by the service only).")
    client_ca_file: FilePath | None = Field(
        default=None,
        description="PEM CA certificate(s): set it to require a client certificate signed by them (mutual TLS).",
    )

    @property
    def mutual(self) -> bool:
        """Whether clients must present a certificate."""
        return self.client_ca_file is not None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Credentials for ``server.add_secure_port`` (client certificates required when ``mutual``)."""
        import grpc

        pair = [(_read(self.key_file, "TLS key"), _read(self.cert_file, "TLS certificate"))]
        roots = _read(self.client_ca_file, "client CA") if self.client_ca_file is not None else None
        return grpc.ssl_server_credentials(pair, root_certificates=roots, require_client_auth=self.mutual)

    def uvicorn_options(self) -> dict[str, Any]:
        """``uvicorn.Config`` keyword arguments for HTTPS (and required client certificates when ``mutual``)."""
        options: dict[str, Any] = {"ssl_certfile": str(self.cert_file), "ssl_keyfile": str(self.key_file)}
        if self.client_ca_file is not None:
            options |= {"ssl_ca_certs": str(self.client_ca_file), "ssl_cert_reqs": ssl.CERT_REQUIRED}
        return options


class ClientTls(BaseModel):
    """How a client checks the server (and, for mutual TLS, proves who it is)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ca_file: FilePath | None = Field(
        default=None, description="PEM CA certificate(s) that signed the server's certificate; unset: the system's."
    )
    cert_file: FilePath | None = Field(
        default=None, description="This client's PEM certificate, for servers that require one (mutual TLS)."
    )
    key_file: FilePath | None = Field(default=None, description="The private key of cert_file.")
    server_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        description="Host name to check the server's certificate against, when it differs from the target's host.",
    )

    @model_validator(mode="after")
    def _pair(self) -> ClientTls:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together: set both for mutual TLS, or neither")
        return self

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        """Channel credentials for ``grpc.aio.secure_channel`` / ``grpc.secure_channel``."""
        import grpc

        roots = _read(self.ca_file, "CA certificate") if self.ca_file is not None else None
        key = _read(self.key_file, "TLS key") if self.key_file is not None else None
        cert = _read(self.cert_file, "TLS certificate") if self.cert_file is not None else None
        return grpc.ssl_channel_credentials(root_certificates=roots, private_key=key, certificate_chain=cert)

    def grpc_options(self) -> list[tuple[str, Any]]:
        """Channel options: the name to verify when ``server_name`` is set."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def ssl_context(self) -> ssl.SSLContext:
        """An SSL context for an HTTPS client (httpx ``verify=``): the CA to trust and the client certificate."""
        context = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file is not None else None)
        if self.cert_file is not None and self.key_file is not None:
            context.load_cert_chain(str(self.cert_file), str(self.key_file))
        return context


def secure_channel(
    target: str, tls: ClientTls | None, options: list[tuple[str, Any]] | None = None
) -> grpc.aio.Channel:
    """An asyncio gRPC channel to ``target``: TLS when ``tls`` is given, plaintext otherwise."""
    import grpc

    opts = [*(options or []), *(tls.grpc_options() if tls is not None else [])]
    if tls is None:
        return grpc.aio.insecure_channel(target, options=opts)
    return grpc.aio.secure_channel(target, tls.grpc_credentials(), options=opts)


def secure_sync_channel(
    target: str, tls: ClientTls | None, options: list[tuple[str, Any]] | None = None
) -> grpc.Channel:
    """A blocking gRPC channel to ``target``: TLS when ``tls`` is given, plaintext otherwise."""
    import grpc

    opts = [*(options or []), *(tls.grpc_options() if tls is not None else [])]
    if tls is None:
        return grpc.insecure_channel(target, options=opts)
    return grpc.secure_channel(target, tls.grpc_credentials(), options=opts)
