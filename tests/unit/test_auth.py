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
