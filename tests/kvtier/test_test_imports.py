"""The test tree's own layering: test modules share code through `tests/helpers` and the
conftest files' fixtures, never by importing another test module or a conftest (pytest imports
those itself; a second import is a second copy of their fixtures and state)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import ROOT


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _forbidden(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return name.startswith("tests.") and (last.startswith("test_") or last == "conftest")


def test_no_test_module_imports_another_or_a_conftest() -> None:
    found = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for name in _imported(path)
        if _forbidden(name)
    }
    assert not found, sorted(found)
