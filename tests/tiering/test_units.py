"""Sizes and durations: what `tiering.units` reads, refuses and writes back."""

from __future__ import annotations

import re

import pytest

from tiering.errors import ConfigError
from tiering.units import (
    DURATION_PATTERN,
    MAX_SIZE,
    SIZE_PATTERN,
    format_duration,
    format_size,
    parse_duration,
    parse_size,
    short_repr,
)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("8GiB", 8 * 2**30),
        ("512 MB", 512 * 10**6),
        ("1.5TiB", int(1.5 * 2**40)),
        ("4096", 4096),
        ("2kib", 2048),
        ("2KIB", 2048),
        (" 3 b ", 3),
    ],
)
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text, "x") == size
    assert parse_size(size, "x") == size
    assert re.fullmatch(rf"\s*{SIZE_PATTERN}\s*", text)


@pytest.mark.parametrize(
    ("value", "minimum", "message"),
    [
        ("lots", 1, "x: expected a size like '8GiB' or a number of bytes, got 'lots'"),
        (True, 1, "x: expected a size like '8GiB'"),
        (0, 1, "x: must be positive, got 0"),
        (100, 4096, "x: must be at least 4,096 bytes, got 100"),
        (MAX_SIZE + 1, 1, "x: too large, at most 4,611,686,018,427,387,904 bytes"),
        ("9" * 400 + "GiB", 1, r"x: too large, .*\(405 characters\)"),
    ],
)
def test_bad_sizes(value: object, minimum: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_size(value, "x", minimum)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("200ms", 0.2), ("10s", 10.0), ("5m", 300.0), ("1h", 3600.0), ("2d", 172800.0), ("1.5", 1.5)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text, "x") == pytest.approx(seconds)
    assert re.fullmatch(rf"\s*{DURATION_PATTERN}\s*", text)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("soon", "ttl: expected a duration like '200ms' or '1h', got 'soon'"),
        ("-1s", "ttl: expected a duration"),
        (0, "ttl: must be positive, got 0"),
        (float("nan"), "ttl: expected a duration like '200ms' or '1h', got nan"),
        (10**400, "ttl: too long, at most 100 years"),
        (False, "ttl: expected a duration"),
    ],
)
def test_bad_durations(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_duration(value, "ttl")


def test_zero_is_a_duration_only_when_allowed() -> None:
    assert parse_duration("0s", "x", allow_zero=True) == 0.0


@pytest.mark.parametrize(
    ("size", "text"),
    [(8 * 2**30, "8GiB"), (1536, "1536B"), (0, "0B"), (64 << 20, "64MiB"), (2**50, "1PiB")],
)
def test_sizes_are_written_back_exactly(size: int, text: str) -> None:
    assert format_size(size) == text and parse_size(text, "x", 0) == size


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.2, "200ms"),
        (10.0, "10s"),
        (300.0, "5m"),
        (3600.0, "1h"),
        (86400.0, "1d"),
        (1.5, "1500ms"),
        (0.0, "0s"),
    ],
)
def test_durations_are_written_back_exactly(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
    assert parse_duration(text, "x", allow_zero=True) == pytest.approx(seconds)


def test_a_long_value_is_cut_in_messages() -> None:
    assert short_repr("abc") == "'abc'"
    assert short_repr("a" * 100) == "'" + "a" * 39 + "... (102 characters)"


@pytest.mark.parametrize("text", ["٣d", "３h", "1٫5s", "٣", "1.٥m", "3\u2003s"])
def test_durations_take_ascii_digits_only(text: str) -> None:
    """Python's `\\d` and `float` read other scripts' digits (`٣d` was 3 days): refused."""
    with pytest.raises(ConfigError, match="expected a duration like"):
        parse_duration(text, "x")
    assert not re.fullmatch(rf"\s*{DURATION_PATTERN}\s*", text, re.ASCII)


@pytest.mark.parametrize("text", ["٣GiB", "４096", "1.５MiB"])
def test_sizes_take_ascii_digits_only(text: str) -> None:
    with pytest.raises(ConfigError, match="expected a size like"):
        parse_size(text, "x")


def test_the_config_refuses_non_ascii_digits() -> None:
    """The config reads every duration and size through `tiering.units`: the same refusal."""
    from tiering.config import parse_config

    with pytest.raises(ConfigError, match=r"faults.timeout: expected a duration"):
        parse_config({"faults": {"timeout": "٣s"}})
    with pytest.raises(ConfigError, match=r"primary.capacity: expected a size"):
        parse_config({"primary": {"capacity": "٣GiB"}})
