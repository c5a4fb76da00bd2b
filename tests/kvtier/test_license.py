"""What the repository carries for contributors: LICENSE is the Apache License 2.0 that
pyproject.toml declares, CONTRIBUTING.md gives the README's two commands, the README points at
both and at CHANGELOG.md, which has an "Unreleased" section."""

from __future__ import annotations

import hashlib
import re
import tomllib
from typing import Any

from tests.helpers.paths import ROOT

APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
"""SHA-256 of the Apache License 2.0 as the ASF publishes it
(https://www.apache.org/licenses/LICENSE-2.0.txt), appendix included."""

APACHE_2_SECTIONS = (
    "Definitions",
    "Grant of Copyright License",
    "Grant of Patent License",
    "Redistribution",
    "Submission of Contributions",
    "Trademarks",
    "Disclaimer of Warranty",
    "Limitation of Liability",
    "Accepting Warranty or Additional Liability",
)


def project() -> dict[str, Any]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        table: dict[str, Any] = tomllib.load(f)["project"]
    return table


def readme_setup_commands() -> list[str]:
    """The command lines of the shell blocks in the README's "Set up" section."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = re.search(r"^## Set up\n(.*?)^## ", readme, re.S | re.M)
    assert section, "README.md has no '## Set up' section"
    blocks = re.findall(r"```sh\n(.*?)```", section.group(1), re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_pyproject_declares_apache_2_and_ships_the_license_file() -> None:
    table = project()
    assert table["license"] == "Apache-2.0"
    assert table["license-files"] == ["LICENSE"]


def test_license_is_the_apache_2_text() -> None:
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    for number, title in enumerate(APACHE_2_SECTIONS, start=1):
        assert f"   {number}. {title}." in text, f"LICENSE lacks section {number}, {title}"
    assert "END OF TERMS AND CONDITIONS" in text
    assert "APPENDIX: How to apply the Apache License to your work." in text
    digest = hashlib.sha256((ROOT / "LICENSE").read_bytes()).hexdigest()
    assert digest == APACHE_2_SHA256, "LICENSE differs from the ASF's text of the license"


def test_contributing_gives_the_readmes_two_commands() -> None:
    commands = readme_setup_commands()
    assert commands == [
        "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/kvtier demo",
        "./scripts/test.sh",
    ]
    contributing = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    for command in commands:
        assert command in contributing, f"CONTRIBUTING.md does not give {command!r}"


def test_contributing_names_the_layering_contracts() -> None:
    contributing = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    assert ".importlinter" in contributing and "lint-imports" in contributing


def test_readme_points_at_contributing_changelog_and_license() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = re.search(r"^## Contributing and license\n(.*?)(?=^## |\Z)", readme, re.S | re.M)
    assert section, "README.md has no '## Contributing and license' section"
    for target in ("CONTRIBUTING.md", "CHANGELOG.md", "LICENSE"):
        assert f"]({target})" in section.group(1), f"the section does not link {target}"


def test_changelog_keeps_an_unreleased_section() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert changelog.startswith("# Changelog\n")
    assert "Keep a Changelog" in changelog
    assert re.search(r"^## \[Unreleased\]$", changelog, re.M)
