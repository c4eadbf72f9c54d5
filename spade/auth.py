"""Per-tenant API keys: bearer tokens checked against SHA-256 digests held in configuration.

Every service that authenticates callers (the sandbox's gRPC and REST APIs, the memory's REST API)
configures ``api_keys: [{tenant, key_sha256}, ...]`` and checks ``Authorization: Bearer <key>``
through one :class:`KeyRing`. Keys are never stored in clear; the digest of a presented key is
compared with every configured digest in constant time.

>>> ring = KeyRing({hash_key("s3cret"): "team-a"})
>>> ring.authenticate("Bearer s3cret")
'team-a'
>>> ring.verify("wrong") is None
True
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping, Sequence
from typing import Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from spade.errors import ErrorKind, ServiceError

P = TypeVar("P")
"""What a key identifies: a tenant name, or a richer record (the sandbox's tenant with its quotas)."""


def hash_key(key: str) -> str:
    """The hex SHA-256 of an API key: the form configuration stores.

    >>> hash_key("secret")[:12]
    '2bb80d537b1d'
    """
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


EMPTY_KEY_SHA256 = hash_key("")
"""The digest of an empty key: what ``printf %s "$KEY" | sha256sum`` gives when ``$KEY`` is unset."""


def generate_key() -> tuple[str, str]:
    """A new random API key (256 bits, URL-safe) and its SHA-256, for ``api_keys[].key_sha256``.

    >>> key, digest = generate_key()
    >>> len(key) >= 43 and digest == hash_key(key)
    True
    """
    key = secrets.token_urlsafe(32)
    return key, hash_key(key)


class Unauthenticated(ServiceError):
    """No key, a malformed ``Authorization`` header, or a key no tenant holds."""

    kind = ErrorKind.UNAUTHENTICATED
    code = "unauthenticated"


class ApiKey(BaseModel):
    """One tenant's key, stored as the SHA-256 hex digest of the key (never the key itself)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: str = Field(min_length=1, max_length=64, description="Tenant name, shown in logs and metrics.")
    key_sha256: str = Field(
        pattern=r"^[0-9a-fA-F]{64}$",
        description="Hex SHA-256 of the key: `spade sandbox keygen` makes a key and prints it, or "
        '`printf %s "$KEY" | sha256sum` (never of an empty key).',
    )

    @field_validator("key_sha256")
    @classmethod
    def _not_empty_lowercase(cls, digest: str) -> str:
        if digest.lower() == EMPTY_KEY_SHA256:
            raise ValueError(
                f"key_sha256 {digest[:12]}... is the SHA-256 of an empty key (the variable holding the key was "
                "empty when it was hashed): make a key with `spade sandbox keygen` (or `spade envs hash-token "
                "--generate`) and configure its sha256"
            )
        return digest.lower()


def check_unique_keys(keys: Sequence[ApiKey]) -> None:
    """Refuse two tenants sharing a key (a key must identify exactly one tenant).

    Raises:
        ValueError: Two entries hold the same digest.
    """
    digests = [k.key_sha256 for k in keys]
    if len(set(digests)) != len(digests):
        raise ValueError("two tenants share one API key hash: give each tenant its own key")


class KeyRing(Generic[P]):
    """Maps a presented key to what it identifies.

    Args:
        keys: ``{sha256_hex_of_key: principal}``.
        anonymous: Dev mode only: what every request acts as when no key is configured (the API is
            then open: any key, or none, is let in). ``None``: keys are required.
    """

    def __init__(self, keys: Mapping[str, P], *, anonymous: P | None = None) -> None:
        self._keys = {digest.lower(): principal for digest, principal in keys.items()}
        self._anonymous = anonymous

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def open(self) -> bool:
        """Whether every request is let in (dev mode with no keys configured)."""
        return self._anonymous is not None and not self._keys

    def verify(self, key: str) -> P | None:
        """The principal holding ``key`` (every digest compared in constant time), else ``None``."""
        if self.open:
            return self._anonymous
        if not key:
            return None
        digest = hash_key(key)
        found: P | None = None
        for known, principal in self._keys.items():
            if hmac.compare_digest(known, digest):
                found = principal
        return found

    def authenticate(self, authorization: str | None) -> P:
        """The principal for an ``Authorization`` header value (``"Bearer <key>"``).

        Raises:
            Unauthenticated: The header is missing, malformed, or the key is unknown.
        """
        if self.open and self._anonymous is not None:
            return self._anonymous
        if not authorization:
            raise Unauthenticated("missing API key: send the header 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("malformed Authorization header: expected 'Bearer <key>'")
        principal = self.verify(token.strip())
        if principal is None:
            raise Unauthenticated("unknown API key: check the key or ask the operator for one")
        return principal
