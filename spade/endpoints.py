"""How a service reaches another one: the settings sections every caller of the sandbox or memory uses.

One shape per concept, in every service: ``sandbox: {target, api_key, timeout_s, open_timeout_s,
retry, tls}`` and ``memory: {target, timeout_s, api_key, tls}``, so the sandbox's address is
``SPADE_DESIGNER_SANDBOX__TARGET`` in the designer and ``SPADE_ROLLOUT_SANDBOX__TARGET`` in the
rollout. The inference servers are ``inference_urls`` with ``inference: {api_key, tls}`` for their
key and TLS, and queues ``queue`` (``spade.queues.config``).

>>> SandboxEndpoint(target="sandbox:50051").target
'sandbox:50051'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, SecretStr, Tag

from spade.envs import CheckConfig
from spade.retry import RetryPolicy
from spade.serving.tls import ClientTls

SANDBOX_RETRY = RetryPolicy(attempts=3, initial_s=0.05, multiplier=2.0, max_s=1.0, jitter_s=0.05)
"""Tries of one sandbox call on a transient failure (quick: a healthy replica answers at once)."""


class SandboxEndpoint(BaseModel):
    """The sandbox service over gRPC."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["grpc"] = "grpc"
    target: str = Field(
        default="127.0.0.1:50051", min_length=3, max_length=500, description="host:port of the sandbox's gRPC server."
    )
    api_key: SecretStr | None = Field(
        default=None, description="This service's sandbox tenant key (unset only in dev mode); never logged."
    )
    timeout_s: float = Field(
        default=120.0, gt=0, le=3600, description="Deadline of one validation or execution call, in seconds."
    )
    open_timeout_s: float = Field(default=60.0, gt=0, le=3600, description="Longest wait for a session to open.")
    retry: RetryPolicy = Field(
        default=SANDBOX_RETRY, description="Tries of one sandbox call (or session open) on a transient failure."
    )
    tls: ClientTls | None = Field(
        default=None,
        description="Reach the sandbox over TLS: the CA that signed its certificate and, for mutual TLS, this "
        "service's certificate and key. Unset: plaintext (the sandbox must then serve without TLS).",
    )

    def key(self) -> str | None:
        """The API key in clear, for the client's ``authorization`` header."""
        return self.api_key.get_secret_value() if self.api_key is not None else None


class PoolSandbox(BaseModel):
    """Play in an isolated worker pool started inside this process (embedded mode)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["pool"] = "pool"
    isolation: dict[str, Any] = Field(
        default_factory=dict, description="IsolationSettings fields for the pool (see the sandbox's settings)."
    )
    checks: CheckConfig = Field(default_factory=CheckConfig, description="Session limits (turn cap, observation size).")


def kind_of(default: str) -> Callable[[Any], str]:
    """The ``kind`` tag of a variant, ``default`` when absent (``SPADE_ROLLOUT_SANDBOX__TARGET=…`` alone)."""

    def pick(value: Any) -> str:
        if isinstance(value, dict):
            return str(value.get("kind", default))
        return str(getattr(value, "kind", default))

    return pick


SandboxConfig = Annotated[
    Annotated[SandboxEndpoint, Tag("grpc")] | Annotated[PoolSandbox, Tag("pool")], Discriminator(kind_of("grpc"))
]
"""Where envs are played: the sandbox service (``grpc``, the default) or an in-process pool (``pool``)."""


class MemoryEndpoint(BaseModel):
    """The memory service over gRPC."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["grpc"] = "grpc"
    target: str = Field(
        default="127.0.0.1:50052", min_length=3, max_length=500, description="host:port of the memory's gRPC server."
    )
    timeout_s: float = Field(default=30.0, gt=0, le=600, description="Deadline of each call, in seconds.")
    api_key: SecretStr | None = Field(
        default=None, description="This service's memory tenant key (unset only in dev mode); never logged."
    )
    tls: ClientTls | None = Field(
        default=None,
        description="Reach the memory over TLS: the CA that signed its certificate and, for mutual TLS, this "
        "service's certificate and key. Unset: plaintext (the memory must then serve without TLS).",
    )

    def key(self) -> str | None:
        """The API key in clear, for the client's ``authorization`` header."""
        return self.api_key.get_secret_value() if self.api_key is not None else None


class InferenceEndpoint(BaseModel):
    """How a service authenticates to the inference servers (their URLs stay in ``inference_urls``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    api_key: SecretStr | None = Field(
        default=None,
        description="Key sent as 'Authorization: Bearer' to every inference server (SGLang's --api-key; the "
        "embedded server's api_keys, or admin_keys for the learner, whose weight updates need one); never logged.",
    )
    tls: ClientTls | None = Field(
        default=None,
        description="For https:// inference URLs: the CA that signed the servers' certificates and, for mutual "
        "TLS, this service's certificate and key. Unset: the system's CAs.",
    )

    def key(self) -> str | None:
        """The API key in clear, for the client's ``Authorization`` header."""
        return self.api_key.get_secret_value() if self.api_key is not None else None
