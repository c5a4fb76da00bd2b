"""Reading a configuration file (or vLLM's inline mapping) into a `Config`.

Loading validates everything and fails with the dotted path of the offending field
(`tiers[1].capacity: expected a size like '8GiB', got 'lots'`); unknown keys are errors, so a
typo never falls back to a default silently. `${NAME}` in any string is replaced by the
environment variable NAME (an unset one is an error naming the field), so secrets stay out of
the file. Every key is read by the `Field` its declaration gives it (`tiering.config.schema`;
a tier's own options: its class's `Options` record, `tiering.config.tiers`) and handed to the
code in the unit it takes (sizes in bytes, durations in seconds). Numbers are finite and
bounded (`tiering.units`), and the YAML itself is read within bounds (`tiering.config.safeyaml`), so
no file makes loading slow, deep or large.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tiering.config import safeyaml
from tiering.config.schema import (
    ENV_PATTERN,
    NAME,
    SCHEMA_VERSION,
    AuthConfig,
    Config,
    TierConfig,
    sections_of,
)
from tiering.config.tiers import TIER_KEYS, option_fields, required, tier_class
from tiering.errors import ConfigError
from tiering.policies import get_policy_class
from tiering.tier import MIN_SECRET_BYTES
from tiering.tier.options import TierOptions, fields_of, read_fields
from tiering.units import short_repr

__all__ = ["load_config", "parse_config"]

S = TypeVar("S")

_ENV = re.compile(ENV_PATTERN)
_WHOLE_ENV = re.compile(rf"{ENV_PATTERN}\Z")


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
    _only(top, set(fields_of(Config)) | set(sections_of(Config)) | {"tiers"}, "")
    version = top.get("version", SCHEMA_VERSION)
    if type(version) is not int or version != SCHEMA_VERSION:
        raise ConfigError(
            f"version: this kvtier reads config version {SCHEMA_VERSION}, got {short_repr(version)}"
        )
    # Every section the schema declares is read here (none is accepted and then ignored);
    # `auth` is read from the text before interpolation, so that its secret stays raw.
    sections: dict[str, Any] = {
        name: _section(top.get(name, {}), name, cls)
        for name, (cls, _) in sections_of(Config).items()
        if name != "auth"
    }
    try:
        reason = get_policy_class(sections["primary"].eviction).unavailable()
    except ConfigError as e:
        raise ConfigError(f"primary.eviction: {e}") from None
    if reason is not None:
        raise ConfigError(f"primary.eviction: {reason}")
    return Config(
        version=version,
        tiers=_tiers(top.get("tiers", [])),
        auth=_auth(top.get("auth", {}), raw_secret),
        **sections,
    )


def _section(value: object, where: str, cls: type[S]) -> S:
    """Section `cls` from the keys present in `value` (the rest take their defaults), each read
    by its field; the sections inside it after its own keys."""
    given = _mapping(value, where)
    fields, inner = fields_of(cls), sections_of(cls)
    _only(given, set(fields) | set(inner), f"{where}.")
    read: dict[str, Any] = {}
    for key, v in given.items():
        if key in fields:
            read |= read_fields({key: v}, fields, f"{where}.")
        elif v is None:
            raise ConfigError(f"{where}.{key}: expected a value, got null")
    for key, (section, _) in inner.items():  # after the section's own keys
        if key in given:
            read[key] = _section(given[key], f"{where}.{key}", section)
    return cls(**read)


def _tiers(value: object) -> tuple[TierConfig, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"tiers: expected a list of tiers, got {type(value).__name__}")
    keys = fields_of(TierConfig)
    tiers, names = [], set()
    for i, item in enumerate(value):
        where = f"tiers[{i}]"
        tier = _mapping(item, where)
        for key in ("name", "type"):
            if key not in tier:
                raise ConfigError(f"{where}.{key}: missing")
        name = tier["name"]
        if not isinstance(name, str) or not NAME.match(name):
            raise ConfigError(
                f"{where}.name: expected 1-32 lowercase letters, digits, '-' or '_', "
                f"got {short_repr(name)}"
            )
        if name in names:
            raise ConfigError(f"{where}.name: {name!r} is used by another tier")
        names.add(name)
        own = read_fields({k: v for k, v in tier.items() if k in TIER_KEYS}, keys, f"{where}.")
        options, record = _tier_options(
            own["type"], {k: v for k, v in tier.items() if k not in TIER_KEYS}, where
        )
        record = record.with_values({"capacity": own.get("capacity")})
        tiers.append(TierConfig(**own, options=options, record=record))
    return tuple(tiers)


def _tier_options(
    type_name: str, options: dict[Any, Any], where: str
) -> tuple[dict[str, Any], TierOptions]:
    """A tier's own options as given, each read by the field its class declares for it, and
    the record of the class they select, checked."""
    cls = tier_class(type_name, options, where)
    fields = option_fields(cls)
    for name in required(fields):
        if name not in options:
            raise ConfigError(f"{where}.{name}: missing (a {type_name} tier needs it)")
    read: dict[str, Any] = {}
    for key, value in options.items():
        if key == "secret":
            raise ConfigError(
                f"{where}.secret: not a tier option; the secret of every tier is auth.secret"
            )
        if key not in fields:
            raise ConfigError(
                f"{where}.{key}: unknown option of a {type_name} tier; expected one of "
                f"{', '.join(sorted(set(fields) | TIER_KEYS))}"
            )
        read |= read_fields({key: value}, fields, f"{where}.")
    try:  # the record's own checks of its values together (`__post_init__`), at load too
        record = cls.Options(**read)
    except ConfigError as e:
        raise ConfigError(f"{where}.{e}") from None
    return read, record


def _raw_secret(data: object) -> object:
    """`auth.secret` as written, before `${NAME}` is filled in (and each of `auth.previous`
    checked alike): only a whole `${NAME}` is accepted, so a secret never sits in the file
    itself."""
    if not isinstance(data, dict) or not isinstance(data.get("auth"), dict):
        return None
    secret = data["auth"].get("secret")
    previous = data["auth"].get("previous", [])
    if not isinstance(previous, list):
        raise ConfigError("auth.previous: expected a list of '${NAME}'s")
    for where, value in [("auth.secret", secret)] + [
        (f"auth.previous[{i}]", v) for i, v in enumerate(previous)
    ]:
        if value is not None and not (isinstance(value, str) and _WHOLE_ENV.match(value)):
            raise ConfigError(
                f"{where}: give the name of an environment variable that holds it, as "
                "'${NAME}'; a secret written in the file is refused"
            )
    return secret


def _auth(value: object, raw_secret: object) -> AuthConfig:
    read = _section(value, "auth", AuthConfig)
    raw_previous = value.get("previous", []) if isinstance(value, dict) else []
    if read.secret is None:
        if read.encrypt or raw_previous:
            what = "encrypt" if read.encrypt else "previous"
            raise ConfigError(f"auth.{what}: needs auth.secret (the secret written with)")
        return AuthConfig()
    secret = _secret_bytes(read.secret, "auth.secret")
    previous: list[bytes] = []
    for i, one in enumerate(raw_previous):
        old = _secret_bytes(one, f"auth.previous[{i}]")
        if old == secret or old in previous:
            raise ConfigError(f"auth.previous[{i}]: the same secret as auth.secret or an entry")
        previous.append(old)
    return AuthConfig(secret=secret, encrypt=read.encrypt, previous=tuple(previous))


def _secret_bytes(value: object, where: str) -> bytes:
    encoded = str(value).encode("utf-8", "surrogateescape")
    if len(encoded) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"{where}: the environment variable holds {len(encoded)} bytes; "
            f"a secret needs at least {MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)"
        )
    return encoded


def _interpolate(value: object, where: str, env: Mapping[str, str], depth: int) -> object:
    """`value` with `${NAME}` filled in from `env`; also refuses non-finite numbers and deep
    nesting (an inline config from vLLM did not come through `tiering.config.safeyaml`)."""
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
        key if isinstance(key, str) else short_repr(key) for key in section if key not in allowed
    )
    if unknown:
        raise ConfigError(
            f"{prefix}{unknown[0]}: unknown key; expected one of {', '.join(sorted(allowed))}"
        )
