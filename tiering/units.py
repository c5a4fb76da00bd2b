"""Sizes and durations as kvtier reads and writes them: `8GiB`, `512 MB`, `200ms`, `1h`.

Backends import this (not the configuration schema) to read a size or a duration given as text,
and the configuration reads every size and duration through it, so both accept and refuse the
same values with the same messages. Every bound is here: no size above `MAX_SIZE`, no duration
above `MAX_SECONDS`, no count above `MAX_COUNT`, no number written with more than `DIGITS`
digits (converting those costs time before any bound can be checked).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Final

from tiering.errors import ConfigError

__all__ = [
    "DIGITS",
    "DURATION_PATTERN",
    "MAX_COUNT",
    "MAX_SECONDS",
    "MAX_SIZE",
    "SIZE_PATTERN",
    "format_duration",
    "format_size",
    "parse_duration",
    "parse_size",
    "short_repr",
]

MAX_SIZE: Final = 2**62
"""The largest size any field takes (4 EiB): a larger one is a typo, not a disk."""
MAX_SECONDS: Final = 100 * 365 * 86400.0
"""The longest duration any field takes (a century)."""
MAX_COUNT: Final = 2**31 - 1
"""The largest count any field takes unless it says otherwise."""
DIGITS: Final = 40
"""A number written with more digits than this is refused before it is converted."""

SIZE_PATTERN: Final = r"([0-9]+(?:\.[0-9]+)?)\s*([KkMmGgTtPp][Ii]?[Bb]|[Bb])?"
"""What a size written as text looks like, blanks around it allowed (written without flags, so
that a JSON Schema can use it as it is). Digits are ASCII only: Python's `\\d` and `float`
also take other scripts' digits (`٣`, `３`), which an operator's eye does not read as numbers."""
DURATION_PATTERN: Final = r"([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h|d)?"
"""What a duration written as text looks like, blanks around it allowed."""

_SIZE = re.compile(rf"\s*{SIZE_PATTERN}\s*\Z", re.ASCII)
_DURATION = re.compile(rf"\s*{DURATION_PATTERN}\s*\Z", re.ASCII)
_UNITS: Final = {
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
_SECONDS: Final = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def short_repr(value: object) -> str:
    """`repr(value)`, cut to a length a one-line message can carry."""
    text = repr(value)
    return text if len(text) <= 48 else f"{text[:40]}... ({len(text)} characters)"


def parse_size(value: object, where: str, minimum: int = 1) -> int:
    """Bytes from an int or a string like `8GiB`, `512 MB`, `1.5TiB`, from `minimum` to
    `MAX_SIZE`; `where` names the field in the `ConfigError` a bad value raises."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (m := _SIZE.match(value)):
        if len(m.group(1)) > DIGITS:
            raise ConfigError(
                f"{where}: too large, at most {MAX_SIZE:,} bytes: {short_repr(value)}"
            )
        size = int(Fraction(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])
    else:
        raise ConfigError(
            f"{where}: expected a size like '8GiB' or a number of bytes, got {short_repr(value)}"
        )
    if size < minimum:
        raise ConfigError(
            f"{where}: must be positive, got {short_repr(value)}"
            if minimum == 1
            else f"{where}: must be at least {minimum:,} bytes, got {short_repr(value)}"
        )
    if size > MAX_SIZE:
        raise ConfigError(f"{where}: too large, at most {MAX_SIZE:,} bytes: {short_repr(value)}")
    return size


def parse_duration(value: object, where: str, allow_zero: bool = False) -> float:
    """Seconds from a number or a string like `200ms`, `10s`, `5m`, `1h`, `2d`: finite,
    positive (or zero with `allow_zero`), at most `MAX_SECONDS`; `where` names the field in the
    `ConfigError` a bad value raises."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_SECONDS:
        seconds = math.inf  # float(10**400) would raise OverflowError
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value)):
        seconds = float(m.group(1)) * _SECONDS[m.group(2) or "s"]
    else:
        raise ConfigError(
            f"{where}: expected a duration like '200ms' or '1h', got {short_repr(value)}"
        )
    if math.isnan(seconds):
        raise ConfigError(f"{where}: expected a duration like '200ms' or '1h', got {value!r}")
    if seconds < 0 or (seconds == 0 and not allow_zero):
        raise ConfigError(f"{where}: must be positive, got {short_repr(value)}")
    if seconds > MAX_SECONDS:
        raise ConfigError(f"{where}: too long, at most 100 years: {short_repr(value)}")
    return seconds


def format_size(size: int) -> str:
    """`size` bytes as the largest binary unit that writes it exactly (`8GiB`, `1536B`)."""
    for unit in ("PiB", "TiB", "GiB", "MiB", "KiB"):
        scale = _UNITS[unit.lower()]
        if size and size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B"


def format_duration(seconds: float) -> str:
    """`seconds` as the largest unit that writes it exactly (`200ms`, `10s`, `1h`)."""
    if seconds == 0:
        return "0s"
    for unit in ("d", "h", "m", "s"):
        count = seconds / _SECONDS[unit]
        if seconds and count == int(count):
            return f"{int(count)}{unit}"
    milliseconds = seconds * 1000
    if milliseconds == int(milliseconds):
        return f"{int(milliseconds)}ms"
    return f"{seconds:g}s"
