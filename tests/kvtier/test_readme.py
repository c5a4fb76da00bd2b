"""The README's examples run as written: its tier backend passes the shipped conformance suite;
and the module it sends backend authors to holds the contract."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT


def _example(name: str) -> str:
    """The README's Python block whose first line is `# <name>`."""
    readme = (ROOT / "README.md").read_text()
    for block in re.findall(r"```python\n(.*?)```", readme, re.S):
        if block.startswith(f"# {name}\n"):
            return str(block)
    raise AssertionError(f"README.md has no Python block starting with '# {name}'")


@pytest.mark.slow
def test_the_readme_tier_backend_passes_the_conformance_suite(tmp_path: Path) -> None:
    for name in ("mytier.py", "test_mytier.py"):
        (tmp_path / name).write_text(_example(name))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_mytier.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert re.search(r"\b[1-9]\d+ passed", done.stdout), done.stdout[-500:]


def test_the_module_the_readme_names_for_the_contract_holds_it() -> None:
    """The README's "Writing a tier backend" sends authors to a module for the full contract:
    that module declares every primitive the README lists (the base, `Tier`, holds none of them)."""
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"The full contract is in `([\w/]+\.py)`", readme)
    assert found, "README.md no longer says where the full contract is"
    source = (ROOT / found.group(1)).read_text()
    for primitive in ("_read", "_write", "_delete", "_contains", "_stat", "_read_into"):
        assert f"def {primitive}(" in source, (found.group(1), primitive)
