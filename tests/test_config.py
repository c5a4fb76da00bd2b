"""The YAML configuration: every shipped example loads; bad input names the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tiering.config import (
    Config,
    PrimaryConfig,
    PromotionConfig,
    TierConfig,
    json_schema,
    load_config,
    parse_config,
    parse_duration,
    parse_size,
)
from tiering.errors import ConfigError

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
ENV = {
    "REDIS_PASSWORD": "secret",
    "S3_ENDPOINT": "http://127.0.0.1:8333",
    "KVTIER_DEMO_DIR": "/tmp/kvtier-demo",
}


def test_there_are_example_configs() -> None:
    names = {p.stem for p in CONFIGS}
    assert {"primary", "nvme", "redis", "s3", "full", "demo"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_example_loads_and_matches_the_schema(path: Path) -> None:
    import jsonschema
    import yaml

    assert isinstance(load_config(path, ENV), Config)
    schema = json.loads((ROOT / "configs" / "kvtier.schema.json").read_text())
    jsonschema.validate(yaml.safe_load(path.read_text()), schema)


def test_the_shipped_schema_is_up_to_date() -> None:
    shipped = json.loads((ROOT / "configs" / "kvtier.schema.json").read_text())
    assert shipped == json.loads(json.dumps(json_schema())), (
        'regenerate: python -c "from tiering.config import write_json_schema; '
        "write_json_schema('configs/kvtier.schema.json')\""
    )


def test_full_hierarchy() -> None:
    config = load_config(ROOT / "configs" / "full.yaml", ENV)
    assert [t.name for t in config.tiers] == ["nvme", "redis", "s3"]
    nvme, redis, s3 = config.tiers
    assert nvme == TierConfig(
        name="nvme",
        type="file",
        write="back",
        capacity=500 * 2**40 // 1024,
        options={"path": "/mnt/nvme/kvtier"},
    )
    assert redis.options["password"] == "secret" and redis.write == "through"
    assert redis.capacity == 20 * 2**30 and s3.options["blocks_per_object"] == 8
    assert config.promotion == PromotionConfig(deadline=0.2, gate="auto")
    assert config.faults.timeout == 0.5 and config.faults.breaker.cooldown == 10.0
    assert config.metrics.prometheus_port == 9464


def test_missing_environment_variable_names_the_field() -> None:
    with pytest.raises(
        ConfigError, match="tiers\\[1\\].password: environment variable REDIS_PASSWORD is not set"
    ):
        load_config(ROOT / "configs" / "full.yaml", env={})


@pytest.mark.parametrize(
    ("tiers", "message"),
    [
        ([{"type": "file", "path": "/x"}], r"tiers\[0\].name: missing"),
        ([{"name": "a", "type": "s3"}], r"tiers\[0\].bucket: missing \(a s3 tier needs it\)"),
        ([{"name": "a", "type": "rediss"}], r"tiers\[0\].type: unknown tier type 'rediss'"),
        (
            [{"name": "a", "type": "file", "path": "/x", "colour": 1}],
            r"tiers\[0\].colour: unknown option of a file tier",
        ),
        (
            [{"name": "a", "type": "file", "path": "/x", "write": "around"}],
            r"tiers\[0\].write: expected one of through, back, selective",
        ),
        (
            [{"name": "a", "type": "memory", "capacity": "lots"}],
            r"tiers\[0\].capacity: expected a size",
        ),
        (
            [{"name": "a", "type": "memory"}, {"name": "a", "type": "memory"}],
            r"tiers\[1\].name: 'a' is used by another tier",
        ),
        ([{"name": "A B", "type": "memory"}], r"tiers\[0\].name: expected 1-32 lowercase"),
        (
            [{"name": "a", "type": "memory", "min_age": "soon"}],
            r"tiers\[0\].min_age: expected a duration",
        ),
        ({"name": "a"}, "tiers: expected a list of tiers, got dict"),
    ],
)
def test_tier_errors_name_the_field(tiers: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"tiers": tiers})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"promotion": {"gate": "sometimes"}},
            "promotion.gate: expected one of auto, always, never",
        ),
        ({"promotion": {"deadline": "now"}}, "promotion.deadline: expected a duration"),
        ({"promotion": {"prefill_rate": 0}}, "promotion.prefill_rate: expected tokens per second"),
        (
            {"faults": {"breaker": {"failures": 0}}},
            "faults.breaker.failures: expected a positive integer",
        ),
        ({"faults": {"retries": 3}}, "faults.retries: unknown key"),
        ({"metrics": {"prometheus_port": 70000}}, "metrics.prometheus_port: expected a TCP port"),
    ],
)
def test_section_errors_name_the_field(data: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(data)


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
        ({"tier": []}, "tier: unknown key"),
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
