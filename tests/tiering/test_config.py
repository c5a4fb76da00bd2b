"""The YAML configuration: every shipped example loads; bad input names the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT
from tiering.config import (
    Config,
    PrimaryConfig,
    PromotionConfig,
    TierConfig,
    json_schema,
    load_config,
    parse_config,
)
from tiering.errors import ConfigError
from tiering.units import parse_duration, parse_size

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
        "regenerate: python -m tiering.config --schema configs/kvtier.schema.json"
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
        ({"shutdown": {"flush": "-1s"}}, "shutdown.flush: expected a duration"),
        ({"shutdown": {"resident": "maybe"}}, "shutdown.resident: expected true or false"),
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
            "primary.capcity: unknown key; expected one of capacity, directory, engine_id, "
            "eviction",
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


# -- every option typed and bounded (issue 15, item 11) -------------------------------------------


def _one_tier(**options: object) -> dict[str, object]:
    kind = str(options.pop("type", "file"))
    base: dict[str, object] = {"file": {"path": "/x"}, "s3": {"bucket": "b"}}.get(kind, {})
    return {"tiers": [{"name": "t", "type": kind, **base, **options}]}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_one_tier(codec="brotli"), r"tiers\[0\].codec: expected one of raw, lz4, zstd"),
        (_one_tier(checksum="md5"), r"tiers\[0\].checksum: expected one of xxh3, crc32c"),
        (_one_tier(layout="weird"), r"tiers\[0\].layout: expected one of files, segments"),
        (_one_tier(concurrency="lots"), r"tiers\[0\].concurrency: expected a positive integer"),
        (_one_tier(concurrency=0), r"tiers\[0\].concurrency: expected a positive integer"),
        (_one_tier(concurrency=10**6), r"tiers\[0\].concurrency: .* up to 4,096"),
        (_one_tier(direct="maybe"), r"tiers\[0\].direct: expected true or false, got 'maybe'"),
        (_one_tier(fsync=1), r"tiers\[0\].fsync: expected true or false, got 1"),
        (_one_tier(path=""), r"tiers\[0\].path: expected a directory path"),
        (_one_tier(min_free="some"), r"tiers\[0\].min_free: expected a size"),
        (_one_tier(timeout="soon"), r"tiers\[0\].timeout: expected a duration"),
        (_one_tier(timeout=float("inf")), r"tiers\[0\].timeout: expected a finite number"),
        (_one_tier(type="redis", ttl=-1), r"tiers\[0\].ttl: must be positive, got -1"),
        (_one_tier(type="redis", url=5), r"tiers\[0\].url: expected a URL"),
        (_one_tier(type="redis", fast_path="yes"), r"tiers\[0\].fast_path: expected true or"),
        (_one_tier(type="s3", blocks_per_object=-4), r"tiers\[0\].blocks_per_object: expected a"),
        (_one_tier(type="s3", retries=-1), r"tiers\[0\].retries: expected an integer >= 0"),
        (_one_tier(type="s3", prefix=5), r"tiers\[0\].prefix: expected a string, got 5"),
        (_one_tier(type="s3", part_size="0B"), r"tiers\[0\].part_size: must be positive"),
        (_one_tier(secret="x"), r"tiers\[0\].secret: not a tier option; .* auth.secret"),
        (_one_tier(capacity=10**400), r"tiers\[0\].capacity: too large, at most 4,611,686"),
        (_one_tier(capacity="9" * 400 + "GiB"), r"tiers\[0\].capacity: too large"),
        (_one_tier(admit_after_hits=True), r"tiers\[0\].admit_after_hits: expected a positive"),
        (
            {"faults": {"timeout": float("nan")}},
            "faults.timeout: expected a finite number, got nan",
        ),
        ({"faults": {"timeout": 10**400}}, "faults.timeout: too long"),
        (
            {"faults": {"breaker": {"latency": "-1s"}}},
            "faults.breaker.latency: expected a duration",
        ),
        (
            {"promotion": {"prefill_rate": float("inf")}},
            "promotion.prefill_rate: expected a finite",
        ),
        ({"primary": {"capacity": 2**62 + 1}}, "primary.capacity: too large"),
        ({"metrics": {"address": ""}}, "metrics.address: expected an address to listen on"),
        ({"version": True}, "version: this kvtier reads config version 1, got True"),
        ({"primary": {"directory": "a" * 100}, "x": {1: 2}}, "x: unknown key"),
    ],
)
def test_every_option_is_typed_and_bounded(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(data, {})


def test_options_come_in_the_units_the_tiers_take() -> None:
    """A duration is accepted wherever one is meant (and handed over in seconds), a size
    wherever a size is (in bytes)."""
    config = parse_config(
        {
            "tiers": [
                {"name": "f", "type": "file", "path": "/x", "timeout": "5s", "min_free": 0},
                {"name": "r", "type": "redis", "socket_timeout": "1500ms", "ttl": "1h"},
                {"name": "s", "type": "s3", "bucket": "b", "read_timeout": "1m"},
                {"name": "p", "type": "s3", "bucket": "b", "part_size": "16MiB"},
            ]
        },
        {},
    )
    f, r, s, p = (t.options for t in config.tiers)
    assert f == {"path": "/x", "timeout": 5.0, "min_free": 0}
    assert r == {"socket_timeout": 1.5, "ttl": 3600.0}
    assert s["read_timeout"] == 60.0 and p["part_size"] == 16 << 20


def test_the_shutdown_section_loads() -> None:
    config = parse_config({"shutdown": {"flush": "2.5s", "resident": False}})
    assert (config.shutdown.flush, config.shutdown.resident) == (2.5, False)
    assert parse_config({"shutdown": {"flush": 0}}).shutdown.flush == 0.0
    assert (parse_config({}).shutdown.flush, parse_config({}).shutdown.resident) == (10.0, True)


def test_the_readme_example_sections_load() -> None:
    config = parse_config({"metrics": {"prometheus_port": 9464, "address": "0.0.0.0"}})
    assert (config.metrics.prometheus_port, config.metrics.address) == (9464, "0.0.0.0")


def _readme_yaml_blocks() -> list[tuple[int, str, str]]:
    """(line, fence info, text) of every ```yaml block of the README."""
    blocks, lines = [], (ROOT / "README.md").read_text().splitlines()
    start, info = -1, ""
    for number, line in enumerate(lines, 1):
        if start < 0 and line.startswith("```yaml"):
            start, info = number, line[3:].strip()
        elif start >= 0 and line.startswith("```"):
            blocks.append((start, info, "\n".join(lines[start : number - 1])))
            start = -1
    return blocks


def test_every_yaml_block_of_the_readme_is_a_valid_config() -> None:
    """Each loads and matches the shipped schema. A block marked ```yaml fragment is part of a
    config by design: it only has to parse."""
    import re

    import jsonschema
    import yaml

    schema = json.loads((ROOT / "configs" / "kvtier.schema.json").read_text())
    blocks = _readme_yaml_blocks()
    assert blocks
    for line, info, text in blocks:
        if info.split()[1:] == ["fragment"]:
            yaml.safe_load(text)
            continue
        assert info == "yaml", f"README.md:{line}: unknown fence {info!r}"
        env = {name: "x" * 32 for name in re.findall(r"\$\{(\w+)\}", text)}
        try:
            parse_config(yaml.safe_load(text), env)
        except ConfigError as e:
            raise AssertionError(f"README.md:{line}: {e}") from None
        jsonschema.validate(yaml.safe_load(text), schema)


def test_yaml_that_would_cost_minutes_or_recurse_is_refused_fast(tmp_path: Path) -> None:
    import time

    bomb = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for previous, name in zip("abcdefgh", "bcdefghi", strict=True):
        bomb.append(f"{name}: &{name} [" + ", ".join([f"*{previous}"] * 9) + "]")
    cases = {
        "bomb": ("\n".join(bomb), r":6:4: not valid YAML: expands to more than 100,000 values"),
        "deep": ("a: " + "[" * 20_000 + "]" * 20_000, "nested deeper than 64 levels"),
        "chain": (
            "\n".join(["a0: &a0 [1]"] + [f"a{i}: &a{i} [*a{i - 1}]" for i in range(1, 100)]),
            r"nested deeper than 64 levels \(through aliases\)",
        ),
        "recursive": ("a: &a [*a]", "a recursive alias"),
        "digits": ("primary: {capacity: " + "9" * 5000 + "}", r":1:21: not valid YAML: cannot"),
        "date": ("primary: {capacity: 2024-13-45}", "cannot read '2024-13-45': month must be"),
    }
    for name, (text, message) in cases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        start = time.perf_counter()
        with pytest.raises(ConfigError, match=message):
            load_config(path)
        assert time.perf_counter() - start < 1.0, name


def test_a_key_given_twice_is_refused_naming_it_and_its_lines(tmp_path: Path) -> None:
    """PyYAML keeps the last of two equal keys: a second `tiers:` dropped the first tiers
    without a word. At any depth, in block or flow style, `a` and "a" alike; a merge (`<<`)
    may still be overridden."""
    cases = {
        "tiers": (
            "tiers:\n  - {name: a, type: memory}\nprimary: {capacity: 1GiB}\n"
            "tiers:\n  - {name: b, type: memory}\n",
            r":4:1: not valid YAML: duplicate key 'tiers' \(first at line 1\)$",
        ),
        "flow": (
            "primary: {capacity: 1GiB, capacity: 2GiB}\n",
            r":1:27: not valid YAML: duplicate key 'capacity' \(first at line 1\)$",
        ),
        "quoted": (
            "tiers:\n  - name: a\n    type: memory\n    'name': b\n",
            r":4:5: not valid YAML: duplicate key 'name' \(first at line 2\)$",
        ),
    }
    for name, (text, message) in cases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_config(path)
    merged = tmp_path / "merged.yaml"
    merged.write_text(
        "tiers:\n  - &base {name: a, type: memory, capacity: 1GiB}\n"
        "  - {<<: *base, name: b, capacity: 2GiB}\n"
    )
    assert [t.name for t in load_config(merged).tiers] == ["a", "b"]


def test_a_warm_start_larger_than_the_primary_capacity_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "warm.yaml"
    path.write_text("primary: {capacity: 1GiB, warm_start: 1025MiB}\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value) == (
        f"{path}: primary.warm_start: 1025MiB is more than primary.capacity (1GiB); a warm "
        "start fills at most the primary"
    )
    path.write_text("primary: {capacity: 1GiB, warm_start: 1GiB}\n")
    assert load_config(path).primary.warm_start == 1 << 30


def test_a_tier_options_own_checks_run_at_load() -> None:
    """What a tier's options record checks of its values (`__post_init__`) failed only when
    the tier was built, at the engine's start; `kvtier validate` said valid."""
    segments = {"name": "s", "type": "file", "layout": "segments", "path": "/x"}
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.segment_size: at least 4KiB, got 1024$"):
        parse_config({"tiers": [segments | {"segment_size": "1KiB"}]})
    assert parse_config({"tiers": [segments | {"segment_size": "4KiB"}]}).tiers[0].name == "s"


def test_files_that_are_not_yaml_text_are_one_line_errors(tmp_path: Path) -> None:
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"primary: {capacity: 1GiB}\n# \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"binary.yaml: not UTF-8 text \(byte 0xff at offset 28"):
        load_config(binary)
    huge = tmp_path / "huge.yaml"
    huge.write_text("# " + "x" * (1 << 20) + "\n")
    with pytest.raises(ConfigError, match="larger than 1 MiB; not a kvtier config"):
        load_config(huge)
    with pytest.raises(ConfigError, match="cannot read config: Is a directory"):
        load_config(tmp_path)
    broken = tmp_path / "broken.yaml"
    broken.write_text("tiers: [\n")
    with pytest.raises(ConfigError) as info:
        load_config(broken)
    assert "\n" not in str(info.value) and ":2:1: not valid YAML" in str(info.value)


def test_an_inline_config_is_bounded_too() -> None:
    """vLLM's inline `kvtier` mapping does not come through the YAML reader."""
    deep: dict[str, object] = {}
    inner = deep
    for _ in range(5000):
        inner["a"] = {}
        inner = inner["a"]  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="nested deeper than 64 levels"):
        parse_config({"primary": deep})


# -- auth (issue 15, item 4) -----------------------------------------------------------------------

SECRET = "0123456789abcdef0123456789abcdef"


def test_the_auth_secret_comes_from_the_environment() -> None:
    config = parse_config({"auth": {"secret": "${KVTIER_SECRET}"}}, {"KVTIER_SECRET": SECRET})
    assert config.auth.secret == SECRET.encode()
    assert SECRET not in repr(config)
    assert parse_config({}).auth.secret is None


@pytest.mark.parametrize(
    ("secret", "env", "message"),
    [
        (SECRET, {}, "auth.secret: give the name of an environment variable .* refused"),
        ("${A}${B}", {"A": SECRET, "B": SECRET}, "auth.secret: give the name of an environment"),
        ("pre${A}", {"A": SECRET}, "auth.secret: give the name"),
        (17, {}, "auth.secret: give the name"),
        ("${KVTIER_SECRET}", {}, "auth.secret: environment variable KVTIER_SECRET is not set"),
        ("${KVTIER_SECRET}", {"KVTIER_SECRET": ""}, "holds 0 bytes; a secret needs at least 16"),
        ("${KVTIER_SECRET}", {"KVTIER_SECRET": "short"}, "holds 5 bytes; a secret needs at least"),
    ],
)
def test_a_secret_in_the_file_or_a_short_one_is_refused(
    secret: object, env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"auth": {"secret": secret}}, env)


OLD = "fedcba9876543210fedcba9876543210"


def test_encryption_and_previous_secrets_come_from_the_environment() -> None:
    config = parse_config(
        {"auth": {"secret": "${NEW}", "encrypt": True, "previous": ["${OLD}"]}},
        {"NEW": SECRET, "OLD": OLD},
    )
    assert config.auth.encrypt and config.auth.previous == (OLD.encode(),)
    assert OLD not in repr(config) and SECRET not in repr(config)
    assert parse_config({}).auth.encrypt is False and parse_config({}).auth.previous == ()


@pytest.mark.parametrize(
    ("auth", "message"),
    [
        ({"encrypt": True}, "auth.encrypt: needs auth.secret"),
        ({"previous": ["${OLD}"]}, "auth.previous: needs auth.secret"),
        ({"secret": "${NEW}", "previous": [OLD]}, r"auth.previous\[0\]: give the name of an"),
        ({"secret": "${NEW}", "previous": "${OLD}"}, "auth.previous: expected a list"),
        ({"secret": "${NEW}", "previous": ["${SHORT}"]}, r"previous\[0\]: .* holds 5 bytes"),
        ({"secret": "${NEW}", "previous": ["${NEW}"]}, "the same secret as auth.secret"),
        ({"secret": "${NEW}", "encrypt": "yes"}, "auth.encrypt"),
    ],
)
def test_a_wrong_encrypt_or_previous_is_refused(auth: dict[str, object], message: str) -> None:
    env = {"NEW": SECRET, "OLD": OLD, "SHORT": "short"}
    with pytest.raises(ConfigError, match=message):
        parse_config({"auth": auth}, env)


def test_every_tier_gets_the_secret(tmp_path: Path) -> None:
    import asyncio

    from tiering.manager import build_tiers

    config = parse_config(
        {
            "auth": {"secret": "${KVTIER_SECRET}"},
            "tiers": [
                {"name": "m", "type": "memory"},
                {"name": "f", "type": "file", "path": str(tmp_path), "min_free": 0},
            ],
        },
        {"KVTIER_SECRET": SECRET},
    )
    built = build_tiers(config, bytes(16))
    try:
        assert [tier.authenticated for _, tier in built] == [True, True]
    finally:
        for _, tier in built:
            asyncio.run(tier.close())


@pytest.mark.parametrize(
    "tier",
    [
        '{name: r, type: redis, url: ["redis://:hunter2-secret@h/0"]}',
        "{name: r, type: redis, password: 12345678901}",
        "{name: r, type: s3, bucket: b, secret_key: [hunter2-secret]}",
        "{name: r, type: s3, bucket: b, access_key: {a: hunter2-secret}}",
    ],
)
def test_errors_about_a_secret_option_do_not_quote_it(tmp_path: Path, tier: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"tiers:\n  - {tier}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "hunter2-secret" not in message and "12345678901" not in message
    assert "tiers[0]." in message and "***" in message
