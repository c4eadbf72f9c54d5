"""Per-tenant API keys: digests only, constant-time checks, dev mode open only without keys."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from spade.auth import ApiKey, KeyRing, Unauthenticated, check_unique_keys, hash_key


def test_keys_map_to_their_tenant_and_anything_else_is_refused() -> None:
    ring = KeyRing({hash_key("k-alice"): "alice", hash_key("k-bob").upper(): "bob"})
    assert ring.authenticate("Bearer k-alice") == "alice"
    assert ring.authenticate("bearer  k-bob ") == "bob"
    assert ring.verify("k-bob") == "bob" and ring.verify("") is None
    for header, fragment in (
        (None, "missing"),
        ("Bearer", "malformed"),
        ("Basic k-alice", "malformed"),
        ("Bearer x", "unknown"),
    ):
        with pytest.raises(Unauthenticated, match=fragment):
            ring.authenticate(header)


def test_dev_mode_is_open_only_when_no_key_is_configured() -> None:
    open_ring = KeyRing({}, anonymous="dev")
    assert open_ring.open and open_ring.authenticate(None) == "dev" and open_ring.verify("anything") == "dev"
    closed = KeyRing({hash_key("k"): "alice"}, anonymous="dev")
    assert not closed.open
    with pytest.raises(Unauthenticated):
        closed.authenticate(None)
    with pytest.raises(Unauthenticated):
        KeyRing({}).authenticate(None)


def test_settings_hold_digests_never_keys() -> None:
    key = ApiKey(tenant="a", key_sha256=hash_key("k").upper())
    assert key.key_sha256 == hash_key("k")
    with pytest.raises(ValidationError, match="key_sha256"):
        ApiKey(tenant="a", key_sha256="plaintext-key")
    with pytest.raises(ValueError, match="share one API key"):
        check_unique_keys([key, ApiKey(tenant="b", key_sha256=hash_key("k"))])


def test_roles_rank_and_a_key_without_a_role_writes() -> None:
    from spade.auth import DEFAULT_ROLE, Forbidden, Principal, Role, RoleKey, authorize

    assert [r.value for r in sorted(Role, key=lambda r: r.rank)] == ["read", "write", "admin"]
    assert RoleKey(tenant="svc", key_sha256=hash_key("k")).role is DEFAULT_ROLE is Role.WRITE
    assert RoleKey.model_validate({"tenant": "web", "key_sha256": hash_key("w"), "role": "read"}).role is Role.READ
    with pytest.raises(ValidationError, match="role"):
        RoleKey.model_validate({"tenant": "x", "key_sha256": hash_key("x"), "role": "root"})
    authorize(Principal("ops", Role.ADMIN), Role.WRITE, "storing plays")
    with pytest.raises(Forbidden, match="'web' has the read role; storing plays needs write") as refused:
        authorize(Principal("web", Role.READ), Role.WRITE, "storing plays")
    assert refused.value.kind.value == "forbidden"  # 403 / PERMISSION_DENIED, never 401
    with pytest.raises(Forbidden, match="has no role"):  # a principal without a role is never trusted with one
        authorize("alice", Role.READ, "reading")
