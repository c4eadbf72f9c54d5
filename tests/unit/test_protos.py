"""The committed stubs in spade/v1 must be exactly what the protos generate."""

from __future__ import annotations

from pathlib import Path

import pytest

from spade import protogen


def test_committed_stubs_match_protos(tmp_path: Path) -> None:
    generated = {p.name: p.read_bytes() for p in protogen.generate(tmp_path)}
    committed_dir = protogen.REPO_ROOT / "spade" / "v1"
    committed = {p.name: p.read_bytes() for p in committed_dir.iterdir() if p.is_file()}
    assert sorted(generated) == sorted(committed), "stub files differ: run `python -m spade.protogen`"
    stale = [name for name in generated if generated[name] != committed[name]]
    assert not stale, f"stubs drifted from the protos in {stale}: run `python -m spade.protogen`"


def test_every_proto_has_stubs() -> None:
    names = {p.stem for p in protogen.proto_files()}
    assert {"sandbox", "queues"} <= names
    for stem in names:
        assert (protogen.REPO_ROOT / "spade" / "v1" / f"{stem}_pb2.py").exists()


def test_a_broken_proto_fails_with_protocs_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    protos = tmp_path / "proto" / "spade" / "v1"
    protos.mkdir(parents=True)
    (protos / "broken.proto").write_text('syntax = "proto3";\npackage spade.v1;\nmessage Broken { nope x = 1; }\n')
    monkeypatch.setattr(protogen, "PROTO_ROOT", tmp_path / "proto")
    with pytest.raises(RuntimeError, match=r"broken\.proto.*\n.*nope"):
        protogen.generate(tmp_path / "out")
