"""Keys for the teams that call the sandbox: made by one command, never an empty one configured."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from services.sandbox.settings import SandboxSettings
from spade.auth import EMPTY_KEY_SHA256, KeyRing, hash_key
from spade.cli import main


def test_keygen_prints_a_key_and_the_entry_that_configures_it() -> None:
    result = CliRunner().invoke(main, ["sandbox", "keygen", "--tenant", "rl-team", "--json"])
    assert result.exit_code == 0, result.output
    made = json.loads(result.stdout)
    assert made["sha256"] == hash_key(made["key"]) == made["entry"]["key_sha256"]
    settings = SandboxSettings(api_keys=[made["entry"]])  # the entry configures the service as printed
    ring = KeyRing({k.key_sha256: k.tenant for k in settings.api_keys})
    assert ring.authenticate(f"Bearer {made['key']}") == "rl-team"
    again = json.loads(CliRunner().invoke(main, ["sandbox", "keygen", "--json"]).stdout)
    assert again["key"] != made["key"]


@pytest.mark.parametrize("digest", [EMPTY_KEY_SHA256, EMPTY_KEY_SHA256.upper()])
def test_the_hash_of_an_empty_key_is_refused_as_configuration(digest: str) -> None:
    """`printf %s "$KEY" | sha256sum` with $KEY unset gives this digest: it must never open the door."""
    with pytest.raises(ValidationError, match="SHA-256 of an empty key") as refused:
        SandboxSettings(api_keys=[{"tenant": "oops", "key_sha256": digest}])
    assert "spade sandbox keygen" in str(refused.value)
