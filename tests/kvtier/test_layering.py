"""The layering of the planes is checked by import-linter (.importlinter, run by scripts/test.sh):
it passes on the tree, and it fails on a copy of the tree with a violation planted."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

PACKAGES = ("tiering", "tiers", "connectors", "kvtier")
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
CIRCLE = "no import circle: no two modules or packages of one package import each other"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120
    )


def test_the_tree_keeps_every_contract() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The four packages and the contracts, copied (lint-imports reads the copy: the current
    directory comes first on its path)."""
    root = tmp_path_factory.mktemp("tree")
    for package in PACKAGES:
        shutil.copytree(
            ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__", "*.so")
        )
    shutil.copy(ROOT / ".importlinter", root)
    return root


@pytest.mark.parametrize(
    ("where", "planted", "contract"),
    [
        (
            "tiering",
            "import connectors",
            "tiering (control) imports no tiers, connectors, vllm, torch",
        ),
        (
            "tiering",
            "from tiers import memory",
            "tiering (control) imports no tiers, connectors, vllm, torch",
        ),
        ("tiering", "import torch", "tiering (control) imports no tiers, connectors, vllm, torch"),
        ("tiers", "import connectors.identity", "tiers (data) imports no connectors, vllm"),
        ("connectors", "import kvtier", "kvtier (the application) is imported by no plane"),
        ("kvtier", "import vllm", "vllm is imported only in connectors.vllm"),
        ("tiers", "import pytest", "pytest is imported only in testing modules"),
    ],
)
def test_a_planted_violation_fails(
    tree_copy: Path, where: str, planted: str, contract: str
) -> None:
    module = tree_copy / where / "_planted.py"
    module.write_text(planted + "\n")
    try:
        result = lint_imports(tree_copy)
    finally:
        module.unlink()
    assert result.returncode != 0, result.stdout
    assert result.stdout.count(" BROKEN") == 1 and f"{contract} BROKEN" in result.stdout, (
        result.stdout
    )
    assert f"{where}._planted" in result.stdout


@pytest.mark.parametrize(
    ("where", "planted", "edge"),
    [
        # the circle issue 43 broke: the registry of tier types importing the configuration
        ("tiering/registry.py", "from tiering.config import Config", ".registry -> .config"),
        # one inside a package: the contract imports the base that subclasses it
        ("tiering/tier/contract.py", "import tiering.tier.base", ".contract -> .base"),
        # one only a function's import makes, between two packages of the data plane
        ("tiers/indexed.py", "def later():\n    import tiers.file", ".indexed -> .file"),
    ],
)
def test_a_planted_import_circle_fails(
    tree_copy: Path, where: str, planted: str, edge: str
) -> None:
    module = tree_copy / where
    kept = module.read_text()
    module.write_text(kept + "\n" + planted + "\n")
    try:
        result = lint_imports(tree_copy)
    finally:
        module.write_text(kept)
    assert result.returncode != 0, result.stdout
    assert result.stdout.count(" BROKEN") == 1 and f"{CIRCLE} BROKEN" in result.stdout, (
        result.stdout
    )
    assert edge in result.stdout, result.stdout
