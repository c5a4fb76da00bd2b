"""vLLM's `OffloadingManager` contract on kvtier's adapter, method by method, on every release
kvtier speaks (`tests/connectors/vllm_harness/contract.py` runs the checks in vLLM's environment,
one process per release; docs/DESIGN.md, "vLLM's manager contract", lists where kvtier departs
from vLLM's reference manager, and why)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from connectors.vllm.versions import SUPPORTED_VLLM
from kvtier.venv import VLLM_TREE_VERSIONS, ensure_vllm_tree
from tests.helpers.paths import ROOT

pytestmark = [pytest.mark.vllm]

PROBE = ROOT / "tests" / "connectors" / "vllm_harness" / "contract.py"
CHECKS = sorted(
    node.name.removeprefix("check_")
    for node in ast.parse(PROBE.read_text()).body
    if isinstance(node, ast.FunctionDef) and node.name.startswith("check_")
)
TREES = {".".join(v.split(".")[:2]): v for v in VLLM_TREE_VERSIONS}


@pytest.fixture(scope="module", params=SUPPORTED_VLLM)
def contract(
    request: pytest.FixtureRequest, vllm_python: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Every check's outcome on one release."""
    version: str = request.param
    path = [str(ROOT)]
    if version in TREES:
        path.insert(0, str(ensure_vllm_tree(vllm_python, version=TREES[version])))
    result = tmp_path_factory.mktemp(f"contract-{version}") / "result.json"
    proc = subprocess.run(
        [str(vllm_python), "-m", "tests.connectors.vllm_harness.contract", str(result)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(path), "VLLM_TARGET_DEVICE": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if not result.exists():
        tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-30:])
        pytest.fail(
            f"the contract probe on vLLM {version} failed (exit {proc.returncode}):\n{tail}"
        )
    found: dict[str, str] = json.loads(result.read_text())
    assert sorted(found) == CHECKS
    return {"version": version, "found": found}


@pytest.mark.parametrize("check", CHECKS)
def test_the_adapter_keeps_the_manager_contract(contract: dict[str, Any], check: str) -> None:
    outcome = contract["found"][check]
    assert outcome == "ok", f"vLLM {contract['version']}, {check}:\n{outcome}"
