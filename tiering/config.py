"""The kvtier YAML configuration, loaded into frozen dataclasses.

So far the schema covers the CPU primary tier; secondary tiers, promotion, faults and metrics
join it with the manager. Loading validates everything and fails with the dotted path of the
offending field (`primary.capacity: expected a size like '8GiB', got 'lots'`); unknown keys are
errors, so a typo never silently falls back to a default.

    version: 1
    primary: {capacity: 8GiB, eviction: arc}
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tiering.errors import ConfigError
from tiering.policies import get_policy_class

__all__ = [
    "SCHEMA_VERSION",
    "Config",
    "PrimaryConfig",
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


_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*\Z")
_SECONDS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


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
class Config:
    version: int = SCHEMA_VERSION
    primary: PrimaryConfig = field(default_factory=PrimaryConfig)


def load_config(path: str | Path) -> Config:
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
        return parse_config(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def parse_config(data: object) -> Config:
    """Validate an already parsed mapping (a YAML document, or vLLM's inline `kvtier` key)."""
    top = _mapping(data, "config")
    _only(top, {"version", "primary"}, "")
    version = top.get("version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise ConfigError(
            f"version: this kvtier reads config version {SCHEMA_VERSION}, got {version!r}"
        )
    primary = _mapping(top.get("primary", {}), "primary")
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
    return Config(
        version=version,
        primary=PrimaryConfig(
            capacity=None if capacity is None else parse_size(capacity, "primary.capacity"),
            eviction=eviction,
            directory=directory,
        ),
    )


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
