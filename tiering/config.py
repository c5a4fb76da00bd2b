"""The kvtier YAML configuration, loaded into frozen dataclasses.

    version: 1
    primary:   {capacity: 8GiB, eviction: arc, directory: /dev/shm}
    tiers:
      - {name: nvme,  type: file,  path: /mnt/nvme/kvtier, capacity: 500GiB, write: back}
      - {name: redis, type: redis, url: "redis://127.0.0.1:6379/0", password: "${REDIS_PASSWORD}",
         ttl: 1h, write: through}
      - {name: s3, type: s3, bucket: kv-cache, prefix: prod/, write: back, blocks_per_object: 8}
    promotion: {deadline: 200ms, gate: auto, prefill_rate: 20000}
    faults:    {timeout: 500ms, breaker: {failures: 5, cooldown: 10s, latency: 2s}}
    metrics:   {prometheus_port: 9464}

Loading validates everything and fails with the dotted path of the offending field
(`tiers[1].capacity: expected a size like '8GiB', got 'lots'`); unknown keys are errors, so a typo
never falls back to a default silently. `${NAME}` in any string is replaced by the environment
variable NAME (an unset one is an error naming the field), so secrets stay out of the file. A
tier's own options (everything but the keys of `TierConfig`) are checked against its class.
"""

from __future__ import annotations

import inspect
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tiering.errors import ConfigError
from tiering.policies import get_policy_class

__all__ = [
    "SCHEMA_VERSION",
    "BreakerConfig",
    "Config",
    "FaultsConfig",
    "MetricsConfig",
    "PrimaryConfig",
    "PromotionConfig",
    "TierConfig",
    "json_schema",
    "load_config",
    "parse_config",
    "parse_duration",
    "parse_size",
]

SCHEMA_VERSION = 1

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGTP]i?B|B)?\s*\Z", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*\Z")
_SECONDS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}\Z")
WRITE_MODES = ("through", "back", "selective")
GATES = ("auto", "always", "never")


def parse_size(value: object, where: str) -> int:
    """Bytes from an int or a string like `8GiB`, `512 MB`, `1.5TiB`; `where` names the field."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (m := _SIZE.match(value)):
        size = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])
    else:
        raise ConfigError(
            f"{where}: expected a size like '8GiB' or a number of bytes, got {value!r}"
        )
    if size <= 0:
        raise ConfigError(f"{where}: must be positive, got {value!r}")
    return size


def parse_duration(value: object, where: str) -> float:
    """Seconds from a number or a string like `200ms`, `10s`, `5m`, `1h`, `2d`."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value)):
        seconds = float(m.group(1)) * _SECONDS[m.group(2) or "s"]
    else:
        raise ConfigError(f"{where}: expected a duration like '200ms' or '1h', got {value!r}")
    if seconds <= 0:
        raise ConfigError(f"{where}: must be positive, got {value!r}")
    return seconds


@dataclass(frozen=True, slots=True)
class PrimaryConfig:
    """The CPU primary tier."""

    capacity: int | None = None
    """Bytes over all workers; None takes vLLM's `cpu_bytes_to_use`."""
    eviction: str = "lru"
    """A registered eviction policy name (`lru`, `arc`, or a custom one)."""
    directory: str = "/dev/shm"
    """Where the shared-memory file of the primary region is created (a tmpfs)."""


@dataclass(frozen=True, slots=True)
class TierConfig:
    """One secondary tier: how the manager uses it, and its backend's own options."""

    name: str
    type: str
    write: str = "back"
    """`through`: demoted when stored in the primary; `back`: when evicted from it;
    `selective`: on eviction, once the block was hit `admit_after_hits` times."""
    admit_after_hits: int = 2
    min_age: float = 0.0
    """Seconds a block must have spent in the primary before it is demoted (spares SSD wear
    and network on blocks that die young)."""
    capacity: int | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    """The backend's constructor arguments (`path`, `url`, `bucket`, ...)."""


@dataclass(frozen=True, slots=True)
class PromotionConfig:
    deadline: float = 0.2
    """Seconds a promotion may take before it is abandoned (a miss)."""
    gate: str = "auto"
    """`auto`: promote only when loading is estimated faster than recomputing; `always`;
    `never`."""
    prefill_rate: float = 20_000.0
    """Tokens per second the engine prefills, for the `auto` gate's recompute estimate."""


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    failures: int = 5
    """Consecutive failures that open a tier's breaker."""
    cooldown: float = 10.0
    """Seconds an open breaker waits before it lets one probe through."""
    latency: float | None = None
    """A call slower than this counts as a failure (None: only errors count)."""


@dataclass(frozen=True, slots=True)
class FaultsConfig:
    timeout: float = 0.5
    """Deadline of every tier call, in seconds."""
    breaker: BreakerConfig = field(default_factory=BreakerConfig)


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    prometheus_port: int | None = None
    """Serve kvtier's metrics at `http://<address>:<port>/metrics` (0 picks a free port)."""
    address: str = "127.0.0.1"
    """Where the endpoint listens; `0.0.0.0` for a scraper on another host."""


@dataclass(frozen=True, slots=True)
class Config:
    version: int = SCHEMA_VERSION
    primary: PrimaryConfig = field(default_factory=PrimaryConfig)
    tiers: tuple[TierConfig, ...] = ()
    promotion: PromotionConfig = field(default_factory=PromotionConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)


# -- loading ------------------------------------------------------------------------------------


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> Config:
    """Read and validate a YAML file; errors name the file and the dotted field path."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e.strerror or e}") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    try:
        return parse_config({} if data is None else data, env)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def parse_config(data: object, env: Mapping[str, str] | None = None) -> Config:
    """Validate an already parsed mapping (a YAML document, or vLLM's inline `kvtier` key)."""
    data = _interpolate(data, "", os.environ if env is None else env)
    top = _mapping(data, "config")
    _only(top, {"version", "primary", "tiers", "promotion", "faults", "metrics"}, "")
    version = top.get("version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise ConfigError(
            f"version: this kvtier reads config version {SCHEMA_VERSION}, got {version!r}"
        )
    return Config(
        version=version,
        primary=_primary(top.get("primary", {})),
        tiers=_tiers(top.get("tiers", [])),
        promotion=_promotion(top.get("promotion", {})),
        faults=_faults(top.get("faults", {})),
        metrics=_metrics(top.get("metrics", {})),
    )


def _primary(value: object) -> PrimaryConfig:
    primary = _mapping(value, "primary")
    _only(primary, {"capacity", "eviction", "directory"}, "primary.")
    capacity = primary.get("capacity")
    eviction = primary.get("eviction", "lru")
    if not isinstance(eviction, str):
        raise ConfigError(f"primary.eviction: expected a policy name, got {eviction!r}")
    try:
        get_policy_class(eviction)
    except ConfigError as e:
        raise ConfigError(f"primary.eviction: {e}") from None
    directory = primary.get("directory", "/dev/shm")
    if not isinstance(directory, str) or not directory:
        raise ConfigError(f"primary.directory: expected a directory path, got {directory!r}")
    return PrimaryConfig(
        capacity=None if capacity is None else parse_size(capacity, "primary.capacity"),
        eviction=eviction,
        directory=directory,
    )


_TIER_KEYS = {"name", "type", "write", "admit_after_hits", "min_age", "capacity"}


def _tiers(value: object) -> tuple[TierConfig, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"tiers: expected a list of tiers, got {type(value).__name__}")
    tiers, names = [], set()
    for i, item in enumerate(value):
        where = f"tiers[{i}]"
        tier = _mapping(item, where)
        for required in ("name", "type"):
            if required not in tier:
                raise ConfigError(f"{where}.{required}: missing")
        name = tier["name"]
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(
                f"{where}.name: expected 1-32 lowercase letters, digits, '-' or '_', got {name!r}"
            )
        if name in names:
            raise ConfigError(f"{where}.name: {name!r} is used by another tier")
        names.add(name)
        options = {k: v for k, v in tier.items() if k not in _TIER_KEYS}
        _check_tier_options(str(tier["type"]), options, where)
        write = tier.get("write", "back")
        if write not in WRITE_MODES:
            raise ConfigError(
                f"{where}.write: expected one of {', '.join(WRITE_MODES)}, got {write!r}"
            )
        hits = tier.get("admit_after_hits", 2)
        if isinstance(hits, bool) or not isinstance(hits, int) or hits < 1:
            raise ConfigError(
                f"{where}.admit_after_hits: expected a positive integer, got {hits!r}"
            )
        min_age = tier.get("min_age", 0)
        age = 0.0 if min_age in (0, "0") else parse_duration(min_age, f"{where}.min_age")
        capacity = tier.get("capacity")
        tiers.append(
            TierConfig(
                name=name,
                type=str(tier["type"]),
                write=write,
                admit_after_hits=hits,
                min_age=age,
                capacity=None if capacity is None else parse_size(capacity, f"{where}.capacity"),
                options=options,
            )
        )
    return tuple(tiers)


def _check_tier_options(type_name: str, options: dict[str, Any], where: str) -> None:
    from tiering.registry import get_tier_class

    try:
        cls = get_tier_class(type_name)
    except ConfigError as e:
        raise ConfigError(f"{where}.type: {e}") from None
    allowed = tier_options(cls)
    for name in sorted(required_tier_options(cls)):
        if name not in options:
            raise ConfigError(f"{where}.{name}: missing (a {type_name} tier needs it)")
    for key in options:
        if key not in allowed:
            raise ConfigError(
                f"{where}.{key}: unknown option of a {type_name} tier; expected one of "
                f"{', '.join(sorted(allowed | _TIER_KEYS))}"
            )


def _keyword_options(cls: type) -> dict[str, bool]:
    """A tier class's keyword parameters (its and its bases'): name -> whether it is required."""
    found: dict[str, bool] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.kind is p.KEYWORD_ONLY:
                found[p.name] = found.get(p.name, False) or p.default is p.empty
    found.pop("namespace", None)
    return found


def tier_options(cls: type) -> set[str]:
    """The option names a tier class takes (`capacity` is a key of `TierConfig` itself)."""
    return set(_keyword_options(cls)) - {"capacity"}


def required_tier_options(cls: type) -> set[str]:
    """The options a tier class cannot do without (keyword parameters with no default)."""
    return {name for name, required in _keyword_options(cls).items() if required}


def _promotion(value: object) -> PromotionConfig:
    promotion = _mapping(value, "promotion")
    _only(promotion, {"deadline", "gate", "prefill_rate"}, "promotion.")
    gate = promotion.get("gate", "auto")
    if gate not in GATES:
        raise ConfigError(f"promotion.gate: expected one of {', '.join(GATES)}, got {gate!r}")
    rate = promotion.get("prefill_rate", 20_000.0)
    if isinstance(rate, bool) or not isinstance(rate, int | float) or rate <= 0:
        raise ConfigError(f"promotion.prefill_rate: expected tokens per second (> 0), got {rate!r}")
    return PromotionConfig(
        deadline=parse_duration(promotion.get("deadline", 0.2), "promotion.deadline"),
        gate=gate,
        prefill_rate=float(rate),
    )


def _faults(value: object) -> FaultsConfig:
    faults = _mapping(value, "faults")
    _only(faults, {"timeout", "breaker"}, "faults.")
    breaker = _mapping(faults.get("breaker", {}), "faults.breaker")
    _only(breaker, {"failures", "cooldown", "latency"}, "faults.breaker.")
    failures = breaker.get("failures", 5)
    if isinstance(failures, bool) or not isinstance(failures, int) or failures < 1:
        raise ConfigError(f"faults.breaker.failures: expected a positive integer, got {failures!r}")
    latency = breaker.get("latency")
    return FaultsConfig(
        timeout=parse_duration(faults.get("timeout", 0.5), "faults.timeout"),
        breaker=BreakerConfig(
            failures=failures,
            cooldown=parse_duration(breaker.get("cooldown", 10.0), "faults.breaker.cooldown"),
            latency=None if latency is None else parse_duration(latency, "faults.breaker.latency"),
        ),
    )


def _metrics(value: object) -> MetricsConfig:
    metrics = _mapping(value, "metrics")
    _only(metrics, {"prometheus_port"}, "metrics.")
    port = metrics.get("prometheus_port")
    if port is not None and (
        isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536
    ):
        raise ConfigError(f"metrics.prometheus_port: expected a TCP port, got {port!r}")
    return MetricsConfig(prometheus_port=port)


def _interpolate(value: object, where: str, env: Mapping[str, str]) -> object:
    if isinstance(value, str):

        def replace(m: re.Match[str]) -> str:
            name = m.group(1)
            if name not in env:
                raise ConfigError(f"{where or 'config'}: environment variable {name} is not set")
            return env[name]

        return _ENV.sub(replace, value)
    if isinstance(value, dict):
        return {
            k: _interpolate(v, f"{where}.{k}" if where else str(k), env) for k, v in value.items()
        }
    if isinstance(value, list):
        return [_interpolate(v, f"{where}[{i}]", env) for i, v in enumerate(value)]
    return value


def _mapping(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _only(section: dict[str, Any], allowed: set[str], prefix: str) -> None:
    unknown = sorted(str(key) for key in section if key not in allowed)
    if unknown:
        raise ConfigError(
            f"{prefix}{unknown[0]}: unknown key; expected one of {', '.join(sorted(allowed))}"
        )


# -- JSON Schema ----------------------------------------------------------------------------------

_SIZE_SCHEMA = {
    "oneOf": [
        {"type": "integer", "minimum": 1},
        {"type": "string", "pattern": _SIZE.pattern.strip()},
    ]
}
_DURATION_SCHEMA = {
    "oneOf": [
        {"type": "number", "exclusiveMinimum": 0},
        {"type": "string", "pattern": _DURATION.pattern.strip()},
    ]
}


def json_schema() -> dict[str, Any]:
    """The JSON Schema of the YAML file (`configs/kvtier.schema.json` is this, generated)."""
    from tiering.registry import _BUILTIN, get_tier_class

    tier_variants = []
    for type_name in sorted(_BUILTIN):
        try:
            options = sorted(tier_options(get_tier_class(type_name)))
        except ConfigError:
            options = []
        properties: dict[str, Any] = {
            "name": {"type": "string", "pattern": _NAME.pattern.rstrip("\\Z")},
            "type": {"const": type_name},
            "write": {"enum": list(WRITE_MODES)},
            "admit_after_hits": {"type": "integer", "minimum": 1},
            "min_age": _DURATION_SCHEMA,
            "capacity": _SIZE_SCHEMA,
        }
        properties |= {name: {} for name in options}
        tier_variants.append(
            {
                "type": "object",
                "required": ["name", "type"],
                "additionalProperties": False,
                "properties": properties,
            }
        )
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "kvtier configuration",
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "version": {"const": SCHEMA_VERSION},
            "primary": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "capacity": _SIZE_SCHEMA,
                    "eviction": {"type": "string"},
                    "directory": {"type": "string", "minLength": 1},
                },
            },
            "tiers": {"type": "array", "items": {"oneOf": tier_variants}},
            "promotion": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "deadline": _DURATION_SCHEMA,
                    "gate": {"enum": list(GATES)},
                    "prefill_rate": {"type": "number", "exclusiveMinimum": 0},
                },
            },
            "faults": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "timeout": _DURATION_SCHEMA,
                    "breaker": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "failures": {"type": "integer", "minimum": 1},
                            "cooldown": _DURATION_SCHEMA,
                            "latency": _DURATION_SCHEMA,
                        },
                    },
                },
            },
            "metrics": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "prometheus_port": {"type": "integer", "minimum": 1, "maximum": 65535}
                },
            },
        },
    }


def write_json_schema(path: str | Path) -> None:
    Path(path).write_text(json.dumps(json_schema(), indent=2) + "\n")
