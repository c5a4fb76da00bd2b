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
    metrics:   {prometheus_port: 9464, address: 127.0.0.1}
    auth:      {secret: "${KVTIER_SECRET}"}

Loading validates everything and fails with the dotted path of the offending field
(`tiers[1].capacity: expected a size like '8GiB', got 'lots'`); unknown keys are errors, so a typo
never falls back to a default silently. `${NAME}` in any string is replaced by the environment
variable NAME (an unset one is an error naming the field), so secrets stay out of the file.

Every value is read by a `Field` (kind and range) and handed to the code in the unit it takes
(sizes in bytes, durations in seconds): a tier's own options (everything but the keys of
`TierConfig`) by the fields its class's constructor annotations imply, refined by
`_TIER_RULES`. Numbers are finite and bounded (`MAX_SIZE`, `MAX_SECONDS`), and the YAML itself is
read within bounds (`tiering.safeyaml`), so no file makes loading slow, deep or large.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import json
import math
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Union

import yaml

from tiering import safeyaml
from tiering.errors import ConfigError
from tiering.policies import get_policy_class
from tiering.secrets import redact_text, secrets_in

__all__ = [
    "MAX_SECONDS",
    "MAX_SIZE",
    "SCHEMA_VERSION",
    "AuthConfig",
    "BreakerConfig",
    "Config",
    "FaultsConfig",
    "Field",
    "MetricsConfig",
    "PrimaryConfig",
    "PromotionConfig",
    "TierConfig",
    "json_schema",
    "load_config",
    "parse_config",
    "parse_duration",
    "parse_size",
    "tier_fields",
]

SCHEMA_VERSION = 1
MAX_SIZE = 2**62
"""The largest size any field takes (4 EiB): a larger one is a typo, not a disk."""
MAX_SECONDS = 100 * 365 * 86400.0
"""The longest duration any field takes (a century)."""
MAX_COUNT = 2**31 - 1
MIN_SECRET_BYTES = 16

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
_DIGITS = 40
"""A number written with more digits than this is refused before it is converted."""
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_WHOLE_ENV = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}\Z")
_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}\Z")
WRITE_MODES = ("through", "back", "selective")
GATES = ("auto", "always", "never")


def _short(value: object) -> str:
    """`repr(value)`, cut to a length a one-line message can carry."""
    text = repr(value)
    return text if len(text) <= 48 else f"{text[:40]}... ({len(text)} characters)"


def parse_size(value: object, where: str, minimum: int = 1) -> int:
    """Bytes from an int or a string like `8GiB`, `512 MB`, `1.5TiB`, from `minimum` to
    `MAX_SIZE`; `where` names the field."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (m := _SIZE.match(value)):
        if len(m.group(1)) > _DIGITS:
            raise ConfigError(f"{where}: too large, at most {MAX_SIZE:,} bytes: {_short(value)}")
        size = int(Fraction(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])
    else:
        raise ConfigError(
            f"{where}: expected a size like '8GiB' or a number of bytes, got {_short(value)}"
        )
    if size < minimum:
        raise ConfigError(
            f"{where}: must be positive, got {_short(value)}"
            if minimum == 1
            else f"{where}: must be at least {minimum:,} bytes, got {_short(value)}"
        )
    if size > MAX_SIZE:
        raise ConfigError(f"{where}: too large, at most {MAX_SIZE:,} bytes: {_short(value)}")
    return size


def parse_duration(value: object, where: str, allow_zero: bool = False) -> float:
    """Seconds from a number or a string like `200ms`, `10s`, `5m`, `1h`, `2d`: finite,
    positive (or zero with `allow_zero`), at most `MAX_SECONDS`."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_SECONDS:
        seconds = math.inf  # float(10**400) would raise OverflowError
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value)):
        seconds = float(m.group(1)) * _SECONDS[m.group(2) or "s"]
    else:
        raise ConfigError(f"{where}: expected a duration like '200ms' or '1h', got {_short(value)}")
    if math.isnan(seconds):
        raise ConfigError(f"{where}: expected a duration like '200ms' or '1h', got {value!r}")
    if seconds < 0 or (seconds == 0 and not allow_zero):
        raise ConfigError(f"{where}: must be positive, got {_short(value)}")
    if seconds > MAX_SECONDS:
        raise ConfigError(f"{where}: too long, at most 100 years: {_short(value)}")
    return seconds


@dataclass(frozen=True, slots=True)
class Field:
    """How one value of the file is read: `read` returns it in the unit the code takes, or
    raises `ConfigError` naming the field; `schema` is its JSON Schema.

    Kinds: `flag` (true or false, nothing else), `integer` (`low` to `high`), `number`
    (finite, above `low`, at most `high`), `size` (bytes or '8GiB', up to `MAX_SIZE`),
    `duration` (seconds or '200ms', up to `MAX_SECONDS`): both positive, or with `zero` also 0,
    `text` (a string of at least `low` characters), `choice` (one of `choices`: the names
    themselves, or "module:NAME" of a tuple of them, imported when first used), `any` (only what
    every value gets: finite numbers, bounded nesting)."""

    kind: str
    low: float = 0
    high: float = MAX_COUNT
    choices: tuple[str, ...] | str = ()
    optional: bool = False
    """`null` is a value (None)."""
    zero: bool = False
    """A size or a duration may be 0."""
    what: str = ""
    """What the message says is expected, instead of the kind's own words."""

    def names(self) -> tuple[str, ...]:
        if isinstance(self.choices, tuple):
            return self.choices
        module, _, name = self.choices.partition(":")
        return tuple(getattr(importlib.import_module(module), name))

    def read(self, value: object, where: str) -> Any:
        if value is None:
            if self.optional:
                return None
            raise ConfigError(f"{where}: expected {self.describe()}, got null")
        kind = self.kind
        if kind == "size":
            return parse_size(value, where, 0 if self.zero else 1)
        if kind == "duration":
            return parse_duration(value, where, allow_zero=self.zero)
        if kind == "flag":
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: expected true or false, got {_short(value)}")
            return value
        if kind == "integer":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{where}: expected {self.describe()}, got {_short(value)}")
            if value < self.low:
                raise ConfigError(f"{where}: expected {self.describe()}, got {_short(value)}")
            if value > self.high:
                raise ConfigError(
                    f"{where}: expected {self.describe()} up to {int(self.high):,}, "
                    f"got {_short(value)}"
                )
            return value
        if kind == "number":
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{where}: expected {self.describe()}, got {_short(value)}")
            number = math.inf if isinstance(value, int) and abs(value) > 2**63 else float(value)
            if not math.isfinite(number) or not self.low < number <= self.high:
                raise ConfigError(f"{where}: expected {self.describe()}, got {_short(value)}")
            return number
        if kind == "text":
            if not isinstance(value, str) or len(value) < self.low:
                raise ConfigError(f"{where}: expected {self.describe()}, got {_short(value)}")
            return value
        if kind == "choice":
            names = self.names()
            if value not in names:
                raise ConfigError(
                    f"{where}: expected one of {', '.join(names)}, got {_short(value)}"
                )
            return value
        return value

    def describe(self) -> str:
        if self.what:
            return self.what
        if self.kind == "integer":
            return "a positive integer" if self.low == 1 else f"an integer >= {int(self.low)}"
        if self.kind == "number":
            return "a positive number" if self.low == 0 else "a finite number"
        if self.kind == "text":
            return "a non-empty string" if self.low else "a string"
        return {"size": "a size", "duration": "a duration", "flag": "true or false"}.get(
            self.kind, "a value"
        )

    def schema(self) -> dict[str, Any]:
        schema: dict[str, Any]
        if self.kind == "size":
            schema = {
                "oneOf": [
                    {"type": "integer", "minimum": 0 if self.zero else 1, "maximum": MAX_SIZE},
                    {"type": "string", "pattern": _SIZE.pattern.strip()},
                ]
            }
        elif self.kind == "duration":
            bound = "minimum" if self.zero else "exclusiveMinimum"
            schema = {
                "oneOf": [
                    {"type": "number", bound: 0, "maximum": MAX_SECONDS},
                    {"type": "string", "pattern": _DURATION.pattern.strip()},
                ]
            }
        elif self.kind == "flag":
            schema = {"type": "boolean"}
        elif self.kind == "integer":
            schema = {"type": "integer", "minimum": int(self.low), "maximum": int(self.high)}
        elif self.kind == "number":
            schema = {"type": "number"}
            if math.isfinite(self.low):
                schema["exclusiveMinimum"] = self.low
            if math.isfinite(self.high):
                schema["maximum"] = self.high
        elif self.kind == "text":
            schema = {"type": "string"} | ({"minLength": int(self.low)} if self.low else {})
        elif self.kind == "choice":
            schema = {"enum": list(self.names())}
        else:
            schema = {}
        if self.optional and schema:
            return {"anyOf": [schema, {"type": "null"}]}
        return schema


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
    """The backend's constructor arguments (`path`, `url`, `bucket`, ...), each already read by
    its `Field` (sizes in bytes, durations in seconds)."""


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
class AuthConfig:
    secret: bytes | None = field(default=None, repr=False)
    """The key of the MAC every stored object carries, and every object read must carry (the
    UTF-8 bytes of the environment variable the file names); None: objects carry none. Every
    engine sharing a tier needs the same one."""


@dataclass(frozen=True, slots=True)
class Config:
    version: int = SCHEMA_VERSION
    primary: PrimaryConfig = field(default_factory=PrimaryConfig)
    tiers: tuple[TierConfig, ...] = ()
    promotion: PromotionConfig = field(default_factory=PromotionConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)


# The fields of each section and of a tier's own keys (the defaults are the dataclasses').
_PRIMARY = {
    "capacity": Field("size", optional=True),
    "eviction": Field("text", low=1, what="a policy name"),
    "directory": Field("text", low=1, what="a directory path"),
}
_TIER = {
    "name": Field("text", low=1),
    "type": Field("text", low=1, what="a tier type"),
    "write": Field("choice", choices=WRITE_MODES),
    "admit_after_hits": Field("integer", low=1),
    "min_age": Field("duration", zero=True),
    "capacity": Field("size", optional=True),
}
_PROMOTION = {
    "deadline": Field("duration"),
    "gate": Field("choice", choices=GATES),
    "prefill_rate": Field("number", high=1e12, what="tokens per second (> 0)"),
}
_FAULTS = {"timeout": Field("duration")}
_BREAKER = {
    "failures": Field("integer", low=1),
    "cooldown": Field("duration"),
    "latency": Field("duration", optional=True),
}
_METRICS = {
    "prometheus_port": Field(
        "integer", high=65535, optional=True, what="a TCP port (0: any free one)"
    ),
    "address": Field("text", low=1, what="an address to listen on"),
}
_SECTIONS = ("version", "primary", "tiers", "promotion", "faults", "metrics", "auth")
_TIER_KEYS = set(_TIER)


# -- tier options -------------------------------------------------------------------------------

# What a constructor annotation says of an option's YAML value: `bool` true/false, `int` a
# count, `float` a number, `int | str` a size, `float | str` a duration, `str` (or a path) text;
# `X | None` (or a None default) admits null too; anything else is taken as it is.
_BY_ANNOTATION: dict[frozenset[type], Field] = {
    frozenset({bool}): Field("flag"),
    frozenset({int}): Field("integer", high=MAX_SIZE),
    frozenset({float}): Field("number", low=-math.inf, high=math.inf),
    frozenset({int, float}): Field("number", low=-math.inf, high=math.inf),
    frozenset({int, str}): Field("size"),
    frozenset({float, str}): Field("duration"),
    frozenset({int, float, str}): Field("duration"),
    frozenset({str}): Field("text"),
    frozenset({str, os.PathLike}): Field("text", low=1, what="a path"),
}

# What an annotation cannot say (the names an option takes, a count that must be positive, a
# float that is a duration), by the class whose constructor declares the option.
_TIER_RULES: dict[str, dict[str, Field]] = {
    "tiering.tier.Tier": {
        "codec": Field("choice", choices="tiering.format:CODECS"),
        "checksum": Field("choice", choices="tiering.format:CHECKSUMS"),
        "concurrency": Field("integer", low=1, high=4096),
        "timeout": Field("duration", optional=True),
    },
    "tiers.file.FileTier": {
        "path": Field("text", low=1, what="a directory path"),
        "layout": Field("choice", choices="tiers.file:LAYOUTS"),
        "min_free": Field("size", zero=True),
    },
    "tiers.redis.RedisTier": {
        "url": Field("text", low=1, what="a URL like 'redis://host:6379/0'"),
        "socket_timeout": Field("duration"),
        "connect_timeout": Field("duration"),
    },
    "tiers.s3.S3Tier": {
        "bucket": Field("text", low=1, what="a bucket name"),
        "blocks_per_object": Field("integer", low=1, high=4096),
        "retries": Field("integer", high=100),
        "connect_timeout": Field("duration"),
        "read_timeout": Field("duration"),
    },
}
_NOT_OPTIONS = {"namespace", "secret", "capacity"}
"""Constructor parameters that are not tier options: given by the manager, `auth.secret`, or
`TierConfig` itself."""


def _annotation_field(hint: object, optional: bool) -> Field:
    union = typing.get_origin(hint) in (Union, types.UnionType)
    args = set(typing.get_args(hint)) if union else {hint}
    optional = optional or type(None) in args
    args.discard(type(None))
    plain = frozenset(typing.cast(type, typing.get_origin(a) or a) for a in args)
    found = _BY_ANNOTATION.get(plain)
    return dataclasses.replace(found or Field("any"), optional=optional or found is None)


@functools.cache
def tier_fields(cls: type) -> dict[str, tuple[Field, bool]]:
    """A tier class's options (keyword parameters of its and its bases' constructors): name ->
    (how it is read, whether it is required: some constructor has no default for it). The
    field is the most derived class's rule for the option, else its most derived annotation."""
    fields: dict[str, Field] = {}
    ruled: set[str] = set()
    required: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            hints = typing.get_type_hints(init)
        except Exception:  # noqa: BLE001 - a third party's unresolvable annotation: no typing
            hints = {}
        rules = _TIER_RULES.get(f"{klass.__module__}.{klass.__qualname__}", {})
        for p in inspect.signature(init).parameters.values():
            if p.kind is not p.KEYWORD_ONLY or p.name in _NOT_OPTIONS:
                continue
            if p.default is p.empty:
                required.add(p.name)
            if p.name in rules and p.name not in ruled:
                fields[p.name] = rules[p.name]
                ruled.add(p.name)
            elif p.name not in fields:
                fields[p.name] = _annotation_field(hints.get(p.name, Any), p.default is None)
    return {name: (f, name in required) for name, f in fields.items()}


def tier_options(cls: type) -> set[str]:
    """The option names a tier class takes (`capacity` is a key of `TierConfig` itself)."""
    return set(tier_fields(cls)) - _TIER_KEYS


def required_tier_options(cls: type) -> set[str]:
    """The options a tier class cannot do without (keyword parameters with no default)."""
    return {name for name, (_, required) in tier_fields(cls).items() if required}


# -- loading ------------------------------------------------------------------------------------


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> Config:
    """Read and validate a YAML file; errors name the file and the dotted field path (or the
    line and column, for YAML that does not parse)."""
    try:
        path = Path(path)
        with open(path, "rb") as f:
            raw = f.read(safeyaml.MAX_BYTES + 1)
    except (OSError, ValueError) as e:  # ValueError: a NUL in the name
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"{path}: cannot read config: {reason}") from e
    if len(raw) > safeyaml.MAX_BYTES:
        raise ConfigError(
            f"{path}: larger than {safeyaml.MAX_BYTES >> 20} MiB; not a kvtier config"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})"
        ) from None
    try:
        data = safeyaml.load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}{_yaml_where(e)}: not valid YAML: {_yaml_problem(e)}") from None
    try:
        return parse_config({} if data is None else data, env)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def _yaml_where(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    return "" if mark is None else f":{mark.line + 1}:{mark.column + 1}"


def _yaml_problem(e: yaml.YAMLError) -> str:
    parts = [getattr(e, "context", None), getattr(e, "problem", None)]
    text = ", ".join(str(p) for p in parts if p) or str(e)
    return " ".join(text.split())


def parse_config(data: object, env: Mapping[str, str] | None = None) -> Config:
    """Validate an already parsed mapping (a YAML document, or vLLM's inline `kvtier` key)."""
    env = os.environ if env is None else env
    raw_secret = _raw_secret(data)
    data = _interpolate(data, "", env, 0)
    top = _mapping(data, "config")
    _only(top, set(_SECTIONS), "")
    version = top.get("version", SCHEMA_VERSION)
    if type(version) is not int or version != SCHEMA_VERSION:
        raise ConfigError(
            f"version: this kvtier reads config version {SCHEMA_VERSION}, got {_short(version)}"
        )
    faults = _section(top.get("faults", {}), "faults", _FAULTS | {"breaker": Field("any")})
    breaker = BreakerConfig(**_section(faults.pop("breaker", {}), "faults.breaker", _BREAKER))
    return Config(
        version=version,
        primary=_primary(top.get("primary", {})),
        tiers=_tiers(top.get("tiers", [])),
        promotion=PromotionConfig(**_section(top.get("promotion", {}), "promotion", _PROMOTION)),
        faults=FaultsConfig(**faults, breaker=breaker),
        metrics=MetricsConfig(**_section(top.get("metrics", {}), "metrics", _METRICS)),
        auth=_auth(top.get("auth", {}), raw_secret),
    )


def _section(value: object, where: str, fields: Mapping[str, Field]) -> dict[str, Any]:
    """The keys present in a section, each read by its field."""
    section = _mapping(value, where)
    _only(section, set(fields), f"{where}.")
    return {key: fields[key].read(v, f"{where}.{key}") for key, v in section.items()}


def _primary(value: object) -> PrimaryConfig:
    primary = PrimaryConfig(**_section(value, "primary", _PRIMARY))
    try:
        get_policy_class(primary.eviction)
    except ConfigError as e:
        raise ConfigError(f"primary.eviction: {e}") from None
    return primary


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
                f"{where}.name: expected 1-32 lowercase letters, digits, '-' or '_', "
                f"got {_short(name)}"
            )
        if name in names:
            raise ConfigError(f"{where}.name: {name!r} is used by another tier")
        names.add(name)
        own = {k: _TIER[k].read(v, f"{where}.{k}") for k, v in tier.items() if k in _TIER_KEYS}
        options = _tier_options(
            own["type"], {k: v for k, v in tier.items() if k not in _TIER_KEYS}, where
        )
        tiers.append(TierConfig(**own, options=options))
    return tuple(tiers)


def _tier_options(type_name: str, options: dict[Any, Any], where: str) -> dict[str, Any]:
    """A tier's own options, each read by the field its class declares for it."""
    from tiering.registry import get_tier_class

    try:
        cls = get_tier_class(type_name)
    except ConfigError as e:
        raise ConfigError(f"{where}.type: {e}") from None
    fields = {k: v for k, v in tier_fields(cls).items() if k not in _TIER_KEYS}
    for name in sorted(required_tier_options(cls) - _TIER_KEYS):
        if name not in options:
            raise ConfigError(f"{where}.{name}: missing (a {type_name} tier needs it)")
    read = {}
    for key, value in options.items():
        if key == "secret":
            raise ConfigError(
                f"{where}.secret: not a tier option; the secret of every tier is auth.secret"
            )
        if key not in fields:
            raise ConfigError(
                f"{where}.{key}: unknown option of a {type_name} tier; expected one of "
                f"{', '.join(sorted(set(fields) | _TIER_KEYS))}"
            )
        try:
            read[key] = fields[key][0].read(value, f"{where}.{key}")
        except ConfigError as e:  # the message quotes the value: never a password or key
            raise ConfigError(redact_text(str(e), secrets_in(value, str(key)))) from None
    return read


def _raw_secret(data: object) -> object:
    """`auth.secret` as written, before `${NAME}` is filled in: only a whole `${NAME}` is
    accepted, so a secret never sits in the file itself."""
    if not isinstance(data, dict) or not isinstance(data.get("auth"), dict):
        return None
    secret = data["auth"].get("secret")
    if secret is not None and not (isinstance(secret, str) and _WHOLE_ENV.match(secret)):
        raise ConfigError(
            "auth.secret: give the name of an environment variable that holds it, as "
            "'${NAME}'; a secret written in the file is refused"
        )
    return secret


def _auth(value: object, raw_secret: object) -> AuthConfig:
    auth = _section(value, "auth", {"secret": Field("text", optional=True)})
    secret = auth.get("secret")
    if secret is None:
        return AuthConfig()
    encoded = secret.encode("utf-8", "surrogateescape")
    if len(encoded) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"auth.secret: the environment variable in {raw_secret} holds {len(encoded)} bytes; "
            f"a secret needs at least {MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)"
        )
    return AuthConfig(secret=encoded)


def _interpolate(value: object, where: str, env: Mapping[str, str], depth: int) -> object:
    """`value` with `${NAME}` filled in from `env`; also refuses non-finite numbers and deep
    nesting (an inline config from vLLM did not come through `tiering.safeyaml`)."""
    if depth > safeyaml.MAX_DEPTH:
        raise ConfigError(f"{where or 'config'}: nested deeper than {safeyaml.MAX_DEPTH} levels")
    if isinstance(value, str):

        def replace(m: re.Match[str]) -> str:
            name = m.group(1)
            if name not in env:
                raise ConfigError(f"{where or 'config'}: environment variable {name} is not set")
            return env[name]

        return _ENV.sub(replace, value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where or 'config'}: expected a finite number, got {value!r}")
    if isinstance(value, dict):
        return {
            k: _interpolate(v, f"{where}.{k}" if where else str(k), env, depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_interpolate(v, f"{where}[{i}]", env, depth + 1) for i, v in enumerate(value)]
    return value


def _mapping(value: object, where: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _only(section: dict[Any, Any], allowed: set[str], prefix: str) -> None:
    unknown = sorted(
        key if isinstance(key, str) else _short(key) for key in section if key not in allowed
    )
    if unknown:
        raise ConfigError(
            f"{prefix}{unknown[0]}: unknown key; expected one of {', '.join(sorted(allowed))}"
        )


# -- JSON Schema ----------------------------------------------------------------------------------


def _object(fields: Mapping[str, Field], **more: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": {name: f.schema() for name, f in fields.items()} | more,
    }


def json_schema() -> dict[str, Any]:
    """The JSON Schema of the YAML file (`configs/kvtier.schema.json` is this, generated)."""
    from tiering.registry import _BUILTIN, get_tier_class

    tier_variants = []
    for type_name in sorted(_BUILTIN):
        try:
            options = tier_fields(get_tier_class(type_name))
        except ConfigError:
            options = {}
        properties: dict[str, Any] = {name: f.schema() for name, f in _TIER.items()}
        properties["name"] = {"type": "string", "pattern": _NAME.pattern.rstrip("\\Z")}
        properties["type"] = {"const": type_name}
        properties |= {
            name: f.schema() for name, (f, _) in sorted(options.items()) if name not in _TIER_KEYS
        }
        required = sorted(n for n, (_, req) in options.items() if req and n not in _TIER_KEYS)
        tier_variants.append(
            {
                "type": "object",
                "required": ["name", "type", *required],
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
            "primary": _object(_PRIMARY),
            "tiers": {"type": "array", "items": {"oneOf": tier_variants}},
            "promotion": _object(_PROMOTION),
            "faults": _object(_FAULTS, breaker=_object(_BREAKER)),
            "metrics": _object(_METRICS),
            "auth": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "secret": {"type": "string", "pattern": "^" + _WHOLE_ENV.pattern[:-2] + "$"}
                },
            },
        },
    }


def write_json_schema(path: str | Path) -> None:
    Path(path).write_text(json.dumps(json_schema(), indent=2) + "\n")
