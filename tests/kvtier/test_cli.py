"""The `kvtier` command itself: its entry points, its version, help on every option, and the
demo's default config found from an installed (non-editable) kvtier."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvtier
from kvtier.cli import build_parser, main
from kvtier.demo import DEFAULT_CONFIG
from tests.helpers.paths import ROOT
from tiering.config import load_config


def parsers(
    parser: argparse.ArgumentParser, name: str = "kvtier"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """`parser` and every subcommand's parser under it, with their command lines."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, sub in action.choices.items():
                yield from parsers(sub, f"{name} {command}")


def test_every_option_and_argument_has_help() -> None:
    seen = dict(parsers(build_parser()))
    assert {"kvtier demo", "kvtier migrate", "kvtier bench", "kvtier replay"} <= set(seen)
    missing = [
        f"{name}: {'/'.join(action.option_strings) or action.dest}"
        for name, parser in seen.items()
        for action in parser._actions
        if not action.help or action.help == argparse.SUPPRESS
    ]
    assert missing == []


def test_every_subcommand_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    helped = {choice.dest for choice in commands._choices_actions if choice.help}
    assert helped == set(commands.choices)
    for name in commands.choices:
        with pytest.raises(SystemExit) as info:
            main([name, "--help"])
        assert info.value.code == 0 and f"usage: kvtier {name}" in capsys.readouterr().out


def test_the_readme_lists_every_command() -> None:
    """README's command table has a row for each subcommand (the CLI route in CONTRIBUTING
    ends there)."""
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    readme = (ROOT / "README.md").read_text()
    missing = [name for name in commands.choices if f"| `kvtier {name}" not in readme]
    assert missing == [], f"README.md's command table lacks: {missing}"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"kvtier {kvtier.__version__}\n"
    assert kvtier.__version__ == "0.1.0"  # pyproject's, from the installed metadata


def test_python_dash_m_kvtier_is_the_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvtier", "--version"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0 and done.stdout == f"kvtier {kvtier.__version__}\n"
    done = subprocess.run(
        [sys.executable, "-m", "kvtier", "ls"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 2 and done.stderr.count("error") == 1


def test_the_demo_config_is_package_data_equal_to_the_example(tmp_path: Path) -> None:
    assert DEFAULT_CONFIG == Path(kvtier.__file__).parent / "configs" / "demo.yaml"
    assert DEFAULT_CONFIG.read_bytes() == (ROOT / "configs" / "demo.yaml").read_bytes()
    config = load_config(DEFAULT_CONFIG, {"KVTIER_DEMO_DIR": str(tmp_path)})
    assert [t.type for t in config.tiers] == ["file"]


@pytest.mark.slow
def test_an_installed_kvtier_finds_the_demo_config(tmp_path: Path) -> None:
    """A wheel built from the sources, installed into a directory of its own (not editable, no
    checkout on the path): `kvtier demo --help` runs and the default config is there."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source)
    for package in ("tiering", "tiers", "connectors", "kvtier"):
        shutil.copytree(
            ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__", "*.so")
        )
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(source)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("kvtier-*.whl")
    target = tmp_path / "installed"
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    shutil.rmtree(source)  # nothing of the sources is left to find
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    path = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "KVTIER_DEMO_DIR": str(tmp_path / "nvme")}
    probe = (
        "import kvtier, kvtier.demo as d, tiering.config as c; "
        "print(kvtier.__file__); print(d.DEFAULT_CONFIG); "
        "print([t.name for t in c.load_config(d.DEFAULT_CONFIG).tiers])"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=elsewhere, env=env
    )
    assert done.returncode == 0, done.stderr
    module, config, tiers = done.stdout.splitlines()
    assert Path(module).is_relative_to(target) and Path(config).is_relative_to(target)
    assert Path(config).read_bytes() == (ROOT / "configs" / "demo.yaml").read_bytes()
    assert tiers == "['nvme']"
    done = subprocess.run(
        [sys.executable, "-m", "kvtier", "demo", "--help"],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        env=env,
    )
    assert done.returncode == 0 and "usage: kvtier demo" in done.stdout, done.stderr


def test_the_one_tier_factory_lets_every_extra_win_over_the_entry_options() -> None:
    """`tier_from_config(entry, namespace, config, **extra)`, which the commands use: `extra`
    wins over the entry's options, a deadline too."""
    import asyncio

    from tiering.config import parse_config, tier_from_config

    config = parse_config(
        {"tiers": [{"name": "m", "type": "memory", "timeout": "1s", "capacity": "1MiB"}]}
    )
    (entry,) = config.tiers
    tier = tier_from_config(entry, bytes(16), config, timeout=9.0, read_only=True)
    other = tier_from_config(entry, bytes(16), config)
    try:
        assert (tier.timeout, tier.read_only) == (9.0, True)
        assert other.timeout == 1.0 and not other.read_only
    finally:
        asyncio.run(tier.close())
        asyncio.run(other.close())


def test_each_newcomers_route_is_at_most_five_files_that_exist() -> None:
    """CONTRIBUTING.md's routes: each kind of change names at most five files (a sentence after
    `;` is a variant of the route), and every path it names exists."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    section = text.split("## A newcomer's routes", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) >= 6, rows  # the table's rows, without its head
    for row in rows[1:]:
        change, files = (cell.strip() for cell in row.strip("|").split(" | "))
        main_route = re.sub(r"\([^()]*\)", "", files.split(";")[0])
        items = [item for item in main_route.split(", ") if item.strip()]
        assert len(items) <= 5, (change, items)
        for path in re.findall(r"`([\w./-]+)`", files):
            if "/" in path and "<" not in path and not path.startswith(("vllm/", "kv_")):
                assert (ROOT / path).exists(), (change, path)
