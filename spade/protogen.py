"""Generate the Python gRPC stubs from ``proto/spade/v1/*.proto``.

The protos are the single source of the wire contract. Stubs are written to ``spade/v1/`` (the
import path follows the proto package, ``spade.v1``) and committed; ``tests/unit/test_protos.py``
regenerates them into a temporary directory and fails when the committed files drift.

Run ``python -m spade.protogen`` after editing a proto.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"


def proto_files() -> list[Path]:
    """Return every ``.proto`` file of the contract, sorted for a stable generation order."""
    return sorted((PROTO_ROOT / "spade" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Generate ``*_pb2.py``, ``*_pb2_grpc.py`` and ``*_pb2.pyi`` under ``out_dir/spade/v1``.

    Args:
        out_dir: Root of the output tree (the repository root for the committed stubs).

    Returns:
        The generated files, sorted.

    Raises:
        RuntimeError: When ``protoc`` rejects a proto or dies; the message carries its output.

    ``protoc`` runs in a child interpreter (``python -m grpc_tools.protoc``, which adds the
    well-known types' include itself), not through ``grpc_tools.protoc.main`` in this process. Once,
    in a test worker that had inference engines and an asyncio child watcher running, protoc aborted
    inside ``main`` ("Fatal Python error: Aborted") and took the worker with it; why is not known
    (protoc runs its ``protoc-gen-mypy`` plugin as a child of its own). In a child, such an end is
    this one error.
    """
    target = out_dir / "spade" / "v1"
    target.mkdir(parents=True, exist_ok=True)
    plugin = Path(sys.executable).parent / "protoc-gen-mypy"
    protos = proto_files()
    args = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"--plugin=protoc-gen-mypy={plugin}",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        *[str(p) for p in protos],
    ]
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        names = [p.name for p in protos]
        raise RuntimeError(f"protoc failed for {names} (exit {done.returncode}):\n{done.stderr.strip()}")
    init = target / "__init__.py"
    init.write_text('"""Generated gRPC stubs for the ``spade.v1`` protos (see ``spade.protogen``)."""\n')
    return sorted(p for p in target.iterdir() if p.is_file())


def main() -> int:
    files = generate(REPO_ROOT)
    for f in files:
        print(f.relative_to(REPO_ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
