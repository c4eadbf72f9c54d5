"""Per-tenant API keys: bearer tokens checked against SHA-256 digests held in configuration, and roles.

Every service that authenticates callers (the sandbox's gRPC and REST APIs, the memory's gRPC and
REST APIs, the inference server) configures ``api_keys: [{tenant, key_sha256, ...}, ...]`` and
checks ``Authorization: Bearer <key>`` through one :class:`KeyRing`. Keys are never stored in clear;
the digest of a presented key is compared with every configured digest in constant time.

Two decisions, two errors, made here once for every service and wire:

- **who is calling** (:meth:`KeyRing.authenticate`): no key, a malformed header or a key nobody
  holds is :class:`Unauthenticated` (HTTP 401, gRPC ``UNAUTHENTICATED``);
- **may they do this** (:func:`authorize`): a known key whose :class:`Role` is below what the call
  needs is :class:`Forbidden` (HTTP 403, gRPC ``PERMISSION_DENIED``), never 401.

>>> ring = KeyRing({hash_key("s3cret"): "team-a"})
>>> ring.authenticate("Bearer s3cret")
'team-a'
>>> ring.verify("wrong") is None
True
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

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


class Forbidden(ServiceError):
    """A known key whose role does not allow the call (or a route the server has switched off)."""

    kind = ErrorKind.FORBIDDEN
    code = "forbidden"


class Role(enum.StrEnum):
    """What a key may do, each role allowing everything the ones before it do.

    - ``read``: look (the memory's REST API and web page, ``/healthz/details``, ``/metrics``);
    - ``write``: use the service (store plays and environments, run code in the sandbox, generate);
    - ``admin``: change how the service runs (replace the run spec, swap the served weights).

    >>> Role.ADMIN.allows(Role.WRITE), Role.READ.allows(Role.WRITE)
    (True, False)
    """

    READ = "read"
    WRITE = "write"
    ADMIN = "admin"

    @property
    def rank(self) -> int:
        return _RANKS[self]

    def allows(self, needed: Role) -> bool:
        """Whether this role may do what ``needed`` may."""
        return self.rank >= needed.rank


_RANKS = {Role.READ: 0, Role.WRITE: 1, Role.ADMIN: 2}

DEFAULT_ROLE = Role.WRITE
"""The role of a configured key that names none: what every service's own key needed before roles
existed (store plays, run code), short of ``admin`` (replace the run spec). Give a key handed to a
person or a dashboard ``"role": "read"``."""


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: its tenant name (logs, metrics) and its role."""

    tenant: str
    role: Role


def authorize(principal: Any, needed: Role, action: str) -> None:
    """Refuse ``action`` unless ``principal``'s role allows ``needed``: the one 403 decision.

    ``principal`` is what a :class:`KeyRing` answered: anything with a ``role`` (a :class:`Principal`,
    the sandbox's tenant); one without a role is refused (a keyring built without roles cannot vouch
    for any).

    Raises:
        Forbidden: The caller's role is below ``needed``.

    >>> authorize(Principal("web", Role.READ), Role.READ, "read the memory")
    >>> try:
    ...     authorize(Principal("web", Role.READ), Role.ADMIN, "replacing the run spec")
    ... except Forbidden as exc:
    ...     print(exc)
    tenant 'web' has the read role; replacing the run spec needs admin: use a key with "role": "admin"
    """
    role = getattr(principal, "role", None)
    if isinstance(role, Role) and role.allows(needed):
        return
    tenant = getattr(principal, "tenant", None) or getattr(principal, "name", None) or principal
    has = f"the {role.value} role" if isinstance(role, Role) else "no role"
    raise Forbidden(
        f'tenant {str(tenant)[:64]!r} has {has}; {action} needs {needed.value}: use a key with "role": "{needed.value}"'
    )


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


class RoleKey(ApiKey):
    """A tenant's key with the :class:`Role` it grants (the memory's and the sandbox's keys)."""

    role: Role = Field(
        default=DEFAULT_ROLE,
        description="read (look: REST inspection, web page, /healthz/details, /metrics), write (use the service: "
        "store plays and envs, run code; the default) or admin (also replace the run spec).",
    )

    def principal(self) -> Principal:
        return Principal(self.tenant, self.role)


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
    def principals(self) -> tuple[P, ...]:
        """Who the configured keys identify (never the keys), e.g. to tell whether any key has a role."""
        return tuple(self._keys.values())

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
