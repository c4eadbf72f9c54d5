"""Per-tenant API keys: bearer tokens checked against SHA-256 hashes held in configuration."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from services.sandbox.core.errors import Unauthenticated


def hash_key(key: str) -> str:
    """Return the hex SHA-256 of an API key, the form stored in configuration.

    >>> hash_key("secret")[:12]
    '2bb80d537b1d'
    """
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Tenant:
    """A caller identity with its quotas."""

    name: str
    max_sessions: int
    executions_per_minute: int


DEV_TENANT = Tenant(name="dev", max_sessions=64, executions_per_minute=6000)


class Authenticator:
    """Maps an ``Authorization`` header value to a tenant.

    Args:
        keys: ``{sha256_hex_of_key: tenant}``.
        allow_anonymous: Dev mode only: requests without a key act as ``DEV_TENANT``.
    """

    def __init__(self, keys: dict[str, Tenant], *, allow_anonymous: bool = False) -> None:
        self._keys = {digest.lower(): tenant for digest, tenant in keys.items()}
        self._allow_anonymous = allow_anonymous

    def authenticate(self, authorization: str | None) -> Tenant:
        """Return the tenant for ``authorization`` (``"Bearer <key>"``).

        Raises:
            Unauthenticated: The header is missing, malformed, or the key is unknown.
        """
        if not authorization:
            if self._allow_anonymous:
                return DEV_TENANT
            raise Unauthenticated("missing API key: send the header 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("malformed Authorization header: expected 'Bearer <key>'")
        digest = hash_key(token.strip())
        for known, tenant in self._keys.items():
            if hmac.compare_digest(known, digest):
                return tenant
        raise Unauthenticated("unknown API key: check the key or ask the operator for one")
