"""spade.envs (minus gym_adapter) runs under a bare python3.11 with no site-packages, as in the sandbox."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BARE_PYTHON = Path("/usr/bin/python3.11")

SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from spade.envs import EnvSession, check_env_source
from spade.envs.examples import EXAMPLES
valid = {e.name: check_env_source(e.code, e.setting).valid for e in EXAMPLES.values()}
session = EnvSession(EXAMPLES["order_desk"].code, "tool", seed=1)
session.reset()
ours = ("spade", "__main__")
third_party = sorted(m for m in sys.modules if m.split(".")[0] not in (*sys.stdlib_module_names, *ours))
print(json.dumps({"valid": valid, "third_party": third_party, "site": "site" in sys.modules}))
"""


@pytest.mark.skipif(not BARE_PYTHON.exists(), reason="no system python3.11 to run the sandbox's interpreter")
def test_library_runs_on_a_bare_interpreter() -> None:
    result = subprocess.run(
        [str(BARE_PYTHON), "-I", "-S", "-c", SCRIPT, str(ROOT)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["third_party"] == [] and report["site"] is False
    assert all(report["valid"].values()), report["valid"]


def test_gym_adapter_is_the_only_module_importing_third_party_code() -> None:
    for path in sorted((ROOT / "spade" / "envs").rglob("*.py")):
        text = path.read_text()
        if path.name == "gym_adapter.py":
            continue
        for banned in ("import gymnasium", "import numpy", "import pydantic", "from gymnasium", "from numpy"):
            assert banned not in text, f"{path.relative_to(ROOT)} uses {banned!r}"
