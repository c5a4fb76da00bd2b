"""The YAML configuration: every shipped example loads; bad input names the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ROOT
from tiering.config import (
    Config,
    PrimaryConfig,
    load_config,
    parse_config,
    parse_duration,
    parse_size,
)
from tiering.errors import ConfigError

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_there_are_example_configs() -> None:
    assert CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_example_loads(path: Path) -> None:
    assert isinstance(load_config(path), Config)


def test_primary_example() -> None:
    config = load_config(ROOT / "configs" / "primary.yaml")
    assert config.primary == PrimaryConfig(capacity=8 * 2**30, eviction="arc")


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("8GiB", 8 * 2**30),
        ("512 MB", 512 * 10**6),
        ("1.5TiB", int(1.5 * 2**40)),
        ("4096", 4096),
        ("2kib", 2048),
    ],
)
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text, "x") == size
    assert parse_size(size, "x") == size


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"primary": {"capacity": "lots"}}, "primary.capacity: expected a size like '8GiB'"),
        ({"primary": {"capacity": 0}}, "primary.capacity: must be positive"),
        ({"primary": {"eviction": "lfu"}}, "primary.eviction: unknown eviction policy 'lfu'"),
        (
            {"primary": {"capcity": "1GiB"}},
            "primary.capcity: unknown key; expected one of capacity, directory, eviction",
        ),
        ({"tiers": []}, "tiers: unknown key"),
        ({"version": 2}, "version: this kvtier reads config version 1, got 2"),
        ({"primary": "8GiB"}, "primary: expected a mapping, got str"),
        ({"primary": {"directory": ""}}, "primary.directory: expected a directory path"),
        (["primary"], "config: expected a mapping, got list"),
    ],
)
def test_errors_name_the_field(data: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(data)


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("primary: {capacity: lots}\n")
    with pytest.raises(ConfigError, match=f"{bad}: primary.capacity"):
        load_config(bad)
    bad.write_text("primary: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("200ms", 0.2), ("10s", 10.0), ("5m", 300.0), ("1h", 3600.0), ("2d", 172800.0), ("1.5", 1.5)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text, "x") == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["soon", "-1s", 0, "1 week"])
def test_bad_durations(bad: object) -> None:
    with pytest.raises(ConfigError, match="ttl"):
        parse_duration(bad, "ttl")
